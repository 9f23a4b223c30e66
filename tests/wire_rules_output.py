"""wire_rules for one EngineCoreOutput (docs/protocol.md §4.3): its fields,
its logprobs and ndarrays, as the real frontends decode them. The sources
cited: wire_rules.py."""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Tuple

import msgpack
from wire_rules_checker import U32_MAX, U64_MAX, _Checker, _fits, _is_int, _short

from gmock_engine.wire.eras import WireLayout

#: EngineCoreEventType: QUEUED 1, SCHEDULED 2, PREEMPTED 3
#: (output.rs `enum EngineCoreEventType` repr(u8); Python IntEnum of the same values).
EVENT_TYPES = (1, 2, 3)
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

#: ndarray dtype strings the logprob decoders take (docs/protocol.md Appendix E,
#: from vllm-rs logprobs/wire.rs and vllm/v1/serial_utils.py): numpy strings
#: for new_logprobs, torch names for the tensor fields.
NUMPY_DTYPES = {"<i4": 4, "<i8": 8, "<f4": 4}
TORCH_DTYPES = {"int32": 4, "int64": 8, "float32": 4}
#: msgpack ext type of an inline raw buffer (docs/protocol.md §0).
RAW_VIEW_EXT = 3


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
