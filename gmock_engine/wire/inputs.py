"""Decoding what an engine receives on its input sockets (§3): frames ->
`EngineCoreRequest`, `InvalidRequest`, `AbortRequests`, `UtilityCall`,
`StartDPWave`, or a `ProtocolError` with a sentence that says what was
wrong. Every value of an ADD the engine relies on is checked here.

Nothing is ever unpickled: msgpack ext types 1 (pickle) and 2 (cloudpickle)
are refused (§0).
"""

from __future__ import annotations

import array
import json
from dataclasses import dataclass, field
from operator import countOf
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import msgpack

from gmock_engine.wire.eras import Wire, WireLayout
from gmock_engine.wire.mm_features import MultiModalFeature, decode_mm_features
from gmock_engine.wire.types import (
    COORDINATOR_READY,
    DEFAULT_MAX_TOKENS,
    MAX_CLIENTS,
    PICKLE_EXT_TYPES,
    TOKEN_ID_LIMIT,
    BadValue,
    EngineCoreRequestType,
    ProtocolError,
    is_int,
)

@dataclass
class EngineCoreRequest:
    """The fields of an ADD (§3.2) that the mock uses."""

    request_id: str
    prompt_len: int
    #: None when `sampling_params` is nil (a pooling request, §3.2).
    max_tokens: Optional[int]
    has_sampling_params: bool
    client_index: int = 0
    current_wave: int = 0
    priority: int = 0
    arrival_time: Optional[float] = None
    external_req_id: Optional[str] = None
    abort_immediately: bool = False
    #: The prompt's ids (None: embeddings only); only the echo source keeps them.
    prompt_token_ids: Optional[List[int]] = None
    #: Stop conditions from SamplingParams (§3.3).
    stop_token_ids: Tuple[int, ...] = ()
    eos_token_id: Optional[int] = None
    all_stop_token_ids: Tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    #: SamplingParams.logprobs / prompt_logprobs: top-k alternatives asked
    #: for each sampled / prompt token (0: the token's own only; None: none).
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    #: Sampling controls a mock can honour (§3.3): the ids it may draw from,
    #: tokenized bad words, and logit_bias (-100 bans an id, +100 forces it).
    allowed_token_ids: Optional[Tuple[int, ...]] = None
    bad_words_token_ids: Tuple[Tuple[int, ...], ...] = ()
    logit_bias: Dict[int, float] = field(default_factory=dict)
    #: SamplingParams.extra_args: what a client put in `vllm_xargs`.
    extra_args: Dict[str, Any] = field(default_factory=dict)
    #: `lora_request` (index 6) as decoded by msgpack; core/lora.py checks it.
    lora_request: Any = None
    #: SamplingParams.structured_outputs (guided_decoding before 0.12), None: none.
    structured_outputs: Optional["StructuredOutputsParams"] = None
    #: `pooling_params` (index 4) as decoded by msgpack, read only when
    #: sampling_params is nil; content/pooling.py checks it (§3.7).
    pooling_params: Any = None
    #: `mm_features` (index 2): the request's images and other items, checked
    #: (wire/mm_features.py), their tensors in the payload or in aux frames.
    mm_features: Tuple[MultiModalFeature, ...] = ()


#: The constraint keys of StructuredOutputsParams (§3.3): exactly one is set.
STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A request's structured-output constraint (§3.3), checked: `kind` is
    one of STRUCTURED_KINDS and `spec` its text (a JSON schema or a
    structural tag as JSON text, the choices as a JSON array, a regex or a
    grammar; "" for json_object). Hashable: content/structured_output.py caches
    compiled grammars by it."""

    kind: str
    spec: str


@dataclass
class AbortRequests:
    """An ABORT (§3.4): internal request ids, possibly unknown ones."""

    request_ids: List[str]


@dataclass
class UtilityCall:
    """A UTILITY (§3.5); the reply goes to `outputs[client_index]`."""

    client_index: int
    call_id: int
    method: str
    args: List[Any]


@dataclass
class StartDPWave:
    """START_DP_WAVE from the coordinator (§3.6, §6.3)."""

    wave: int
    exclude_engine_index: Any


@dataclass
class InvalidRequest:
    """An ADD whose request id and client are known but which carries a
    value the engine cannot accept (§3.2, §3.3): answered with an ERROR
    output for this request only; `reason` names the key and the value."""

    request_id: str
    client_index: int
    reason: str


InputMessage = Union[EngineCoreRequest, InvalidRequest, AbortRequests, UtilityCall, StartDPWave]


def _ext_hook(code: int, data: bytes) -> msgpack.ExtType:
    if code in PICKLE_EXT_TYPES:
        raise ProtocolError(f"payload contains a pickle ext type ({code}); refusing to decode it")
    return msgpack.ExtType(code, data)


def unpack(payload: bytes) -> Any:
    """msgpack-decode one frame the way vLLM's peers encode it (§0)."""
    try:
        return msgpack.unpackb(payload, raw=False, strict_map_key=False, ext_hook=_ext_hook)
    except ProtocolError:
        raise
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(f"undecodable msgpack ({type(exc).__name__}: {exc or 'invalid data'})") from None


#: The SamplingParams keys held so far (_hold_keys), and how many may be.
_HELD_KEYS: set = set()
HELD_KEYS_MAX = 512


def _hold_keys(mapping: Dict[str, Any]) -> None:
    """Keep the keys of a map that every ADD carries alive.

    msgpack interns each map key it decodes. A key that nothing else holds
    (SamplingParams fields the engine never reads: `watermarking`,
    `skip_clone`, ...) leaves the interpreter's table of interned strings
    when its frame is freed and is added again by the next frame; every
    addition takes a slot of that table, which is rebuilt when its slots run
    out, at a size set by how many strings are interned at that moment. So
    steady traffic would keep rebuilding a table of about a megabyte, and
    the engine's RSS would step up or down by that much on a rebuild: noise
    that a soak's leak check reads as growth. Held keys stay in the table
    once. The set stops at HELD_KEYS_MAX keys, so random keys in hostile
    frames cannot grow it without bound (they only churn the table).
    """
    if len(_HELD_KEYS) < HELD_KEYS_MAX and not _HELD_KEYS.issuperset(mapping):
        _HELD_KEYS.update(key for key in mapping if type(key) is str)


def _field(array: Sequence[Any], index: int, default: Any = None) -> Any:
    return array[index] if index < len(array) else default


def decode_add(payload: Any, layout: Union[WireLayout, Wire], aux: Sequence[bytes] = ()) -> Union[EngineCoreRequest, "InvalidRequest"]:
    """Decode an already-unpacked EngineCoreRequest array (§3.2, §8.2) by
    `layout`, or by the layout a `Wire` takes for it (detected from it with
    `auto`).

    Short arrays take defaults for missing trailing fields; longer ones
    (future appended fields) are accepted. What cannot be answered (no
    readable request id, no output socket to answer on) raises
    ProtocolError: the frame is dropped. `aux` are the message's frames
    from the payload on: vLLM's encoder numbers them so (aux[0] is the
    payload), and its mm_features' tensors that did not go inline name theirs
    by that index.
    A bad value in an ADD whose id and
    client are known gives an `InvalidRequest`, which the engine answers with
    an ERROR output for that request only, so its client is not left waiting.
    """
    if isinstance(layout, Wire):
        layout = layout.for_add(payload)
    ix = layout.request_index
    if not isinstance(payload, list) or len(payload) < 4:
        raise ProtocolError("ADD payload is not an EngineCoreRequest array of at least 4 elements")
    request_id = payload[ix["request_id"]]
    if not isinstance(request_id, str) or not request_id:
        raise ProtocolError("ADD request_id (index 0) is not a non-empty string")
    client_index = _field(payload, ix["client_index"], 0)
    if client_index is None:
        client_index = 0
    if not is_int(client_index) or not 0 <= client_index < MAX_CLIENTS:
        raise ProtocolError(f"ADD {_cut(request_id)}: client_index {_cut(client_index)} is not an output socket index")
    try:
        request = _decode_add_fields(payload, ix, request_id, client_index)
        position = ix["mm_features"]
        if position < len(payload) and payload[position] is not None:
            request.mm_features = decode_mm_features(payload[position], aux, request.prompt_len)
        return request
    except BadValue as exc:
        return InvalidRequest(request_id, client_index, str(exc))


#: An array typecode of 32 unsigned bits: filling an array of it checks in C
#: that every id is in 0..2**32-1 (OverflowError otherwise).
_U32 = next((code for code in "IL" if array.array(code).itemsize == 4), None)


def _all_ints(values: List[Any]) -> bool:
    """Every item's type is int (a bool's is not), counted in C."""
    return countOf(map(type, values), int) == len(values)


def _token_ids_ok(ids: List[Any]) -> bool:
    """Every item an int (not a bool) in 0..TOKEN_ID_LIMIT-1, checked in C
    (a type count, then an array fill) rather than by a Python loop, as
    every ADD's prompt is: the cost is per prompt token."""
    if not _all_ints(ids):
        return False
    if _U32 is None:
        return min(ids) >= 0 and max(ids) < TOKEN_ID_LIMIT
    try:
        array.array(_U32, ids)
    except OverflowError:
        return False
    return True


def _decode_add_fields(payload: List[Any], ix: Dict[str, int], request_id: str, client_index: int) -> EngineCoreRequest:
    # Every ADD takes this path: plain indexing and `type(x) is int` (no
    # bool) instead of helper calls, as it runs once per request; a field the
    # array is too short for (or the era lacks) takes its default.
    size = len(payload)
    position = ix["prompt_token_ids"]
    prompt = payload[position] if position < size else None
    if prompt is None:
        prompt_len = 0  # prompt given as embeddings only
    elif type(prompt) is list:
        prompt_len = len(prompt)
        # The common case in C (types, then the range); the slow path only
        # to say which id
        if prompt and not _token_ids_ok(prompt):
            for index, token in enumerate(prompt):
                if type(token) is not int or not 0 <= token < TOKEN_ID_LIMIT:
                    raise BadValue(f"prompt_token_ids[{index}] = {_cut(token)} is not a token id (an int in 0..2**32-1)")
    else:
        raise BadValue(f"prompt_token_ids is {type(prompt).__name__}, not a list of token ids or nil")
    position = ix["sampling_params"]
    sampling = payload[position] if position < size else None
    max_tokens: Optional[int] = None
    stops: Dict[str, Any] = _NO_STOPS
    if sampling is not None:
        if type(sampling) is not dict:
            raise BadValue(f"sampling_params is {type(sampling).__name__}, not a map or nil")
        _hold_keys(sampling)
        position = ix["eos_token_id"]
        stops = _decode_stops(sampling, payload[position] if position < size else None)
        max_tokens = sampling.get("max_tokens", DEFAULT_MAX_TOKENS)
        if max_tokens is None:
            max_tokens = DEFAULT_MAX_TOKENS  # Py-FE never sends nil; be lenient
        if type(max_tokens) is not int or max_tokens < 0:
            raise BadValue(f"max_tokens {_cut(max_tokens)} is not a non-negative int")
    position = ix["current_wave"]
    current_wave = payload[position] if position < size else 0
    if current_wave is None:
        current_wave = 0
    if type(current_wave) is not int or current_wave < 0:
        raise BadValue(f"current_wave {_cut(current_wave)} is not a non-negative int")
    position = ix["priority"]
    priority = payload[position] if position < size else 0
    if priority is None:
        priority = 0
    if type(priority) is not int:
        raise BadValue(f"priority {_cut(priority)} is not an int")
    position = ix["arrival_time"]
    arrival = payload[position] if position < size else None
    position = ix["external_req_id"]
    external = payload[position] if position < size else None
    position = ix["abort_immediately"]
    position_lora = ix["lora_request"]
    position_pooling = ix["pooling_params"]
    return EngineCoreRequest(
        request_id=request_id,
        prompt_len=prompt_len,
        max_tokens=max_tokens,
        has_sampling_params=sampling is not None,
        client_index=client_index,
        current_wave=current_wave,
        priority=priority,
        # informational only (never sent back): tolerated when odd
        arrival_time=float(arrival) if type(arrival) is float or type(arrival) is int else None,
        external_req_id=external if type(external) is str else None,
        abort_immediately=position < size and payload[position] is True,
        prompt_token_ids=prompt,
        lora_request=payload[position_lora] if position_lora < size else None,
        pooling_params=payload[position_pooling] if sampling is None and position_pooling < size else None,
        **stops,
    )


def _cut(value: Any, limit: int = 60) -> str:
    """repr() of a client's value for an error message, at most `limit` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _int_list(sampling: Dict[str, Any], key: str) -> Tuple[int, ...]:
    value = sampling.get(key)
    if value is None or value == []:  # (stop_token_ids of nearly every ADD)
        return ()
    if type(value) is not list or not _all_ints(value):
        raise BadValue(f"{key} is not an array of ints")
    return tuple(value)


#: SamplingParams keys only `_decode_stops`' full reading looks at. A request
#: that names none of them (every traced ADD of vllm serve and vllm-rs: both
#: send the EOS and stop ids, vllm-rs also min_tokens 0) takes the short
#: reading, without the per-key checks; the fields it leaves out keep
#: EngineCoreRequest's defaults, which are what the full reading gives for
#: an absent key.
_RARE_SAMPLING_KEYS = frozenset(
    (
        "extra_args",
        "logprobs",
        "prompt_logprobs",
        "allowed_token_ids",
        "_bad_words_token_ids",
        "logit_bias",
        "ignore_eos",
        "structured_outputs",
        "guided_decoding",
    )
)


def _decode_stops(sampling: Dict[str, Any], request_eos: Any = None) -> Dict[str, Any]:
    """Stop-related SamplingParams keys (§3.3), defaults for absent ones.

    The EOS id is SamplingParams._eos_token_id, or in eras up to 0.16 the
    request's own eos_token_id field (`request_eos`, §8.1). It may become a
    request's last token, so it must be a token id the frontends can decode
    (u32 in vllm-rs); stop ids are only avoided and never sent back, so any
    int is accepted, as vLLM does."""
    get = sampling.get
    eos = get("_eos_token_id")
    key = "_eos_token_id"
    if eos is None and request_eos is not None:
        eos, key = request_eos, "eos_token_id"
    if eos is not None and (type(eos) is not int or not 0 <= eos < TOKEN_ID_LIMIT):
        raise BadValue(f"{key} {_cut(eos)} is not a token id (an int in 0..2**32-1)")
    min_tokens = get("min_tokens") or 0
    if type(min_tokens) is not int or min_tokens < 0:
        raise BadValue(f"min_tokens {_cut(min_tokens)} is not a non-negative int")
    stop_token_ids = _int_list(sampling, "stop_token_ids")
    all_stop_token_ids = _int_list(sampling, "_all_stop_token_ids")
    if _RARE_SAMPLING_KEYS.isdisjoint(sampling):
        return {"stop_token_ids": stop_token_ids, "eos_token_id": eos, "all_stop_token_ids": all_stop_token_ids, "min_tokens": min_tokens}
    extra = get("extra_args") or {}
    if type(extra) is not dict:
        raise BadValue(f"extra_args is {type(extra).__name__}, not a map")
    logprobs = get("logprobs")
    if logprobs is not None:
        logprobs = _num_logprobs(sampling, "logprobs")
    prompt_logprobs = get("prompt_logprobs")
    if prompt_logprobs is not None:
        prompt_logprobs = _num_logprobs(sampling, "prompt_logprobs")
    allowed = get("allowed_token_ids")
    if allowed is not None:
        if not isinstance(allowed, list) or not allowed or not all(is_int(t) and 0 <= t < TOKEN_ID_LIMIT for t in allowed):
            raise BadValue(f"allowed_token_ids {_cut(allowed)} is not a non-empty array of token ids (ints in 0..2**32-1)")
        allowed = tuple(allowed)
    bad_words = get("_bad_words_token_ids") or ()
    if bad_words:
        if not isinstance(bad_words, list) or not all(isinstance(w, list) and w and all(is_int(t) for t in w) for w in bad_words):
            raise BadValue(f"_bad_words_token_ids {_cut(bad_words)} is not an array of non-empty arrays of ints")
        bad_words = tuple(tuple(w) for w in bad_words)
    bias = get("logit_bias") or {}
    if bias and (
        not isinstance(bias, dict)
        or not all(is_int(k) and isinstance(v, (int, float)) and not isinstance(v, bool) and v == v for k, v in bias.items())
    ):
        raise BadValue(f"logit_bias {_cut(bias)} is not a map of token ids to numbers")
    return {
        "logprobs": logprobs,
        "prompt_logprobs": prompt_logprobs,
        "allowed_token_ids": allowed,
        "bad_words_token_ids": bad_words,
        "logit_bias": bias if type(bias) is dict else {},
        "stop_token_ids": stop_token_ids,
        "eos_token_id": eos,
        "all_stop_token_ids": all_stop_token_ids,
        "ignore_eos": get("ignore_eos") is True,
        "min_tokens": min_tokens,
        "extra_args": extra,
        "structured_outputs": _structured_outputs(sampling),
    }


#: Longest structured-output spec accepted (a schema, regex or grammar text).
MAX_STRUCTURED_SPEC = 1 << 20


def _structured_outputs(sampling: Dict[str, Any]) -> Optional[StructuredOutputsParams]:
    """SamplingParams.structured_outputs (guided_decoding, the 0.11 name, when
    it is absent) as StructuredOutputsParams (§3.3), None when nil. The map
    must set exactly one constraint of its type, as vLLM's
    StructuredOutputsParams.__post_init__ requires; BadValue otherwise."""
    key = "structured_outputs" if sampling.get("structured_outputs") is not None else "guided_decoding"
    value = sampling.get(key)
    if value is None:
        return None
    if type(value) is not dict:
        raise BadValue(f"{key} is {type(value).__name__}, not a map")
    kinds = [kind for kind in STRUCTURED_KINDS if value.get(kind) is not None]
    if len(kinds) != 1:
        raise BadValue(f"{key} must set exactly one of {', '.join(STRUCTURED_KINDS)}, not {_cut(kinds or value)}")
    kind = kinds[0]
    spec = value[kind]
    if kind == "json_object":
        if type(spec) is not bool:
            raise BadValue(f"{key}.json_object {_cut(spec)} is not a bool")
        spec = ""
    elif kind == "choice":
        if type(spec) is not list or not spec or not all(type(c) is str for c in spec):
            raise BadValue(f"{key}.choice {_cut(spec)} is not a non-empty array of strings")
        spec = json.dumps(spec)
    elif kind in ("json", "structural_tag") and type(spec) is dict:
        try:
            spec = json.dumps(spec)
        except (TypeError, ValueError, RecursionError) as exc:
            raise BadValue(f"{key}.{kind} is not JSON ({exc})") from None
    elif type(spec) is not str:
        raise BadValue(f"{key}.{kind} is {type(spec).__name__}, not a string" + (" or a map" if kind == "json" else ""))
    if len(spec) > MAX_STRUCTURED_SPEC:
        raise BadValue(f"{key}.{kind} is longer than {MAX_STRUCTURED_SPEC} characters")
    return StructuredOutputsParams(kind, spec)


#: The stop-related fields of a request without sampling params (a pooling request).
_NO_STOPS: Dict[str, Any] = {}


#: The most top-k alternatives per token the mock computes (vLLM's default
#: --max-logprobs is 20; -1, the whole vocabulary, is refused).
MAX_LOGPROBS = 1024


def _num_logprobs(sampling: Dict[str, Any], key: str) -> Optional[int]:
    value = sampling.get(key)
    if value is None:
        return None
    if not is_int(value) or not 0 <= value <= MAX_LOGPROBS:
        raise BadValue(f"{key} {_cut(value)} is not an int in 0..{MAX_LOGPROBS} (-1, the whole vocabulary, is not supported)")
    return value


def decode_abort(payload: Any) -> AbortRequests:
    """Decode an ABORT payload: an array of request-id strings (§3.4)."""
    if not isinstance(payload, list) or not all(isinstance(r, str) for r in payload):
        raise ProtocolError("ABORT payload is not an array of request-id strings")
    return AbortRequests(list(payload))


def decode_utility(payload: Any) -> UtilityCall:
    """Decode `[client_index, call_id, method_name, args]` (§3.5)."""
    if not isinstance(payload, list) or len(payload) != 4:
        raise ProtocolError("UTILITY payload is not a 4-array [client_index, call_id, method, args]")
    client_index, call_id, method, args = payload
    if not is_int(client_index) or client_index < 0:
        raise ProtocolError(f"UTILITY client_index {client_index!r} is not a non-negative int")
    if not is_int(call_id):
        raise ProtocolError(f"UTILITY call_id {call_id!r} is not an int")
    if not isinstance(method, str):
        raise ProtocolError(f"UTILITY method name {method!r} is not a string")
    if args is None:
        args = []
    if not isinstance(args, list):
        raise ProtocolError(f"UTILITY {method}: args is {type(args).__name__}, not an array")
    return UtilityCall(client_index, call_id, method, args)


def decode_start_dp_wave(payload: Any) -> StartDPWave:
    """Decode `[wave, exclude_engine_index]` (§3.6); exclude may be bytes (≤0.32)."""
    if not isinstance(payload, list) or len(payload) != 2 or not is_int(payload[0]):
        raise ProtocolError("START_DP_WAVE payload is not [wave:int, exclude]")
    return StartDPWave(payload[0], payload[1])


#: request type byte -> its decoder (§3.1); only an ADD needs the layout
_DECODERS: Dict[bytes, Callable[..., InputMessage]] = {
    EngineCoreRequestType.ADD.value: decode_add,
    EngineCoreRequestType.ABORT.value: decode_abort,
    EngineCoreRequestType.UTILITY.value: decode_utility,
    EngineCoreRequestType.START_DP_WAVE.value: decode_start_dp_wave,
}


def decode_input(frames: Sequence[bytes], layout: Union[WireLayout, Wire]) -> InputMessage:
    """Decode one message from an input DEALER: `[type, payload, aux...]` (§3.1).

    Aux frames carry the tensors of a multimodal ADD (its mm_features name
    them by index). Raises ProtocolError for anything else.
    """
    if len(frames) < 2:
        raise ProtocolError(f"expected at least 2 frames [type, payload], got {len(frames)}")
    kind = bytes(frames[0])
    decode = _DECODERS.get(kind)  # (an Enum call per message costs more than a dict lookup by the raw byte)
    if decode is None:
        raise ProtocolError(f"unknown request type byte {kind.hex() or '(empty)'}")
    payload = unpack(frames[1])
    if decode is decode_add:
        return decode_add(payload, layout, frames[1:])
    return decode(payload)


def decode_coordinator(frames: Sequence[bytes], layout: Union[WireLayout, Wire]) -> Optional[InputMessage]:
    """Decode a message from the coordinator socket (§2.6, §3.6).

    Returns None for a (late) `READY` broadcast, which is to be ignored.
    """
    if len(frames) == 1 and bytes(frames[0]) == COORDINATOR_READY:
        return None
    message = decode_input(frames, layout)
    if not isinstance(message, StartDPWave):
        raise ProtocolError(f"coordinator sent a {type(message).__name__}, expected START_DP_WAVE")
    return message
