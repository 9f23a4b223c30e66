"""What an engine sends on its output sockets (§4): EngineCoreOutput arrays
in the era's layout, the EngineCoreOutputs batches and utility replies
around them, the maps they carry (events, PrefillStats, SchedulerStats,
RequestError, logprobs arrays), and the packer; `salvage` and
`without_requests` for a message that cannot be packed. Pure: no sockets.
"""

from __future__ import annotations

import array
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import msgpack

from gmock_engine.wire.eras import DEFAULT_LAYOUT, WireLayout
from gmock_engine.wire.types import EngineCoreEventType, FinishReason

#: for engine_core_output's fast path (an enum member lookup is a metaclass attribute lookup)
_LENGTH = FinishReason.LENGTH


def engine_core_output(
    request_id: str,
    new_token_ids: List[int],
    finish_reason: Optional[FinishReason] = None,
    error: Optional[Dict[str, Any]] = None,
    layout: WireLayout = DEFAULT_LAYOUT,
    events: Optional[List[Dict[str, Any]]] = None,
    prefill_stats: Optional[Dict[str, Any]] = None,
    stop_reason: Optional[int] = None,
    new_logprobs: Optional[List[Any]] = None,
    new_prompt_logprobs_tensors: Optional[List[Any]] = None,
    kv_transfer_params: Optional[Dict[str, Any]] = None,
    pooling_output: Optional[List[Any]] = None,
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
    `pooling_output` (a tensor, index 4 in every era) ends a pooling request (§3.7).
    """
    if events is None and error is None and new_prompt_logprobs_tensors is None and kv_transfer_params is None and pooling_output is None:
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
    out[0], out[1], out[2], out[3], out[4] = request_id, new_token_ids, new_logprobs, new_prompt_logprobs_tensors, pooling_output
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
    layout = layout or DEFAULT_LAYOUT
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
    came over a KV transfer (P/D, kv/transfer.py)."""
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
    spec_decoding_stats: Optional[Dict[str, Any]] = None,
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
        # the drafts since the last stats (content/spec_decode.py), None without any
        "spec_decoding_stats": spec_decoding_stats,
        "kv_connector_stats": None,
        "ec_connector_stats": None,
        # requests per LoRA adapter name (vllm:lora_requests_info, lora.py)
        "waiting_lora_adapters": waiting_lora_adapters or {},
        "running_lora_adapters": running_lora_adapters or {},
        "cudagraph_stats": None,
        "perf_stats": None,
    }


def mm_cache_miss_output(request_id: str, hashes: List[str], error: Dict[str, Any], layout: WireLayout = DEFAULT_LAYOUT) -> List[Any]:
    """The ERROR output of a request whose stripped multimodal items the
    engine's cache lacks (vLLM's _handle_mm_cache_miss): `mm_cache_miss_hashes`
    (0.28+) names them, so the frontend drops them from its processor cache
    and a retry sends their data again; `error` where the era has the field."""
    out = engine_core_output(request_id, [], FinishReason.ERROR, error, layout)
    position = layout.output_index.get("mm_cache_miss_hashes")
    if position is not None:
        if len(out) <= position:
            out += layout.output_defaults[len(out) : position + 1]
        out[position] = list(hashes)
    return out


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
        #: message (every step's) costs no Python call around it
        self.pack: Callable[[Any], bytes] = self._packer.pack


def pack(obj: Any) -> bytes:
    """msgpack-encode one message (handshake maps and tests)."""
    return msgpack.packb(obj, use_bin_type=True)
