"""Reading the golden files and building gmock_engine's frames for them.

tests/golden/vllm-<version>.json (written by generate.py with each vLLM
version's own classes) holds frames and the logical values they were built
from. `our_outputs` rebuilds the same logical content with
gmock_engine.wire for a layout; `differences` compares two unpacked
messages and names each index that differs. Used by
tests/unit/test_golden_frames.py (against the stored frames) and by
tests/e2e/test_wire_eras.py (which has the real decoders read our frames).

§N: section N of docs/protocol.md.
"""

from __future__ import annotations

import json
import math
import re
import struct
from pathlib import Path
from typing import Any, Dict, List, Optional

from gmock_engine.wire.eras import WireLayout
from gmock_engine.wire.inputs import EngineCoreRequest, unpack
from gmock_engine.wire.outputs import RAW_VIEW_EXT, engine_core_event, engine_core_output, engine_core_outputs, logprobs_lists, pack, prefill_stats, scheduler_stats
from gmock_engine.wire.types import EngineCoreEventType, FinishReason

GOLDEN_DIR = Path(__file__).resolve().parent


def version_key(version: str) -> tuple:
    """Sort key of a dotted version string."""
    return tuple(int(p) for p in re.findall(r"\d+", version)[:3])


def golden_files() -> List[Path]:
    """Every vllm-<version>.json, oldest first."""
    return sorted(GOLDEN_DIR.glob("vllm-*.json"), key=lambda p: version_key(p.stem))


def load(path: Path) -> Dict[str, Any]:
    """One golden file, with `unpacked` added to each frame and default."""
    document = json.loads(path.read_text())
    for item in document["requests"] + document["outputs"]:
        item["unpacked"] = unpack(bytes.fromhex(item["frame"]))
    document["default_values"] = {k: unpack(bytes.fromhex(v)) for k, v in document["defaults"].items()}
    return document


def expected_request(logical: Dict[str, Any], default_max_tokens: int) -> Dict[str, Any]:
    """What decode_add must return for a logical golden request (§3.2,
    §3.3): attribute name -> value (stop ids as a set). `default_max_tokens`
    is the version's SamplingParams().max_tokens, meant by an absent key."""
    sampling = logical["sampling"]
    return {
        "request_id": logical["request_id"],
        "prompt_len": len(logical["prompt_token_ids"]),
        "max_tokens": sampling.get("max_tokens", default_max_tokens),
        "client_index": logical.get("client_index", 0),
        "current_wave": logical.get("current_wave", 0),
        "priority": logical.get("priority", 0),
        "arrival_time": logical["arrival_time"],
        "stop_token_ids": set(sampling.get("stop_token_ids", [])),
        "eos_token_id": logical.get("eos_token_id"),
        "logprobs": sampling.get("logprobs"),
        "prompt_logprobs": sampling.get("prompt_logprobs"),
    }


def request_problems(request: Any, logical: Dict[str, Any], default_max_tokens: int) -> List[str]:
    """How a decoded request differs from `expected_request`, one line per
    attribute; every stopping id must also be in all_stop_token_ids."""
    if not isinstance(request, EngineCoreRequest):
        return [f"decoded to {request!r}"]
    expected = expected_request(logical, default_max_tokens)
    problems = []
    for key, value in expected.items():
        got = getattr(request, key)
        if key == "stop_token_ids":
            got = set(got)
        if got != value:
            problems.append(f"{key}: decoded {got!r}, built with {value!r}")
    stops = expected["stop_token_ids"] | ({expected["eos_token_id"]} - {None})
    if not stops <= set(request.all_stop_token_ids):
        problems.append(f"all_stop_token_ids {request.all_stop_token_ids!r} lacks some of {sorted(stops)}")
    return problems


# --------------------------------------------------------------------------
# Our frames for the same logical content
# --------------------------------------------------------------------------


def finish_reason(name: str) -> FinishReason:
    """Our FinishReason of that name (the engine's reason; the layout
    decides what goes on the wire, `WireLayout.wire_finish_reason`)."""
    return FinishReason[name]


def _logprobs(values: Dict[str, Any], layout: WireLayout, tensors: bool) -> List[Any]:
    # The engine hands logprobs_lists little-endian buffers: ids int32,
    # logprobs float32, ranks int64 (its docstring, Appendix E).
    ids = [t for row in values["token_ids"] for t in row]
    lps = [x for row in values["logprobs"] for x in row]
    rows, columns = len(values["ranks"]), len(values["token_ids"][0])
    return logprobs_lists(
        rows, columns,
        struct.pack(f"<{len(ids)}i", *ids), struct.pack(f"<{len(lps)}f", *lps), struct.pack(f"<{rows}q", *values["ranks"]),
        layout=layout, tensors=tensors,
    )


def our_output(spec: Dict[str, Any], layout: WireLayout) -> List[Any]:
    """wire.outputs.engine_core_output for one logical EngineCoreOutput."""
    kwargs: Dict[str, Any] = {"layout": layout}
    if spec.get("finish_reason"):
        kwargs["finish_reason"] = finish_reason(spec["finish_reason"])
    if spec.get("stop_reason") is not None:
        kwargs["stop_reason"] = spec["stop_reason"]
    if spec.get("events"):
        kwargs["events"] = [engine_core_event(EngineCoreEventType(t), ts) for t, ts in spec["events"]]
    if spec.get("prefill"):
        kwargs["prefill_stats"] = prefill_stats(spec["prefill"]["num_prompt_tokens"], spec["prefill"]["num_cached_tokens"])
    if spec.get("new_logprobs"):
        kwargs["new_logprobs"] = _logprobs(spec["new_logprobs"], layout, tensors=False)
    if spec.get("new_prompt_logprobs_tensors"):
        kwargs["new_prompt_logprobs_tensors"] = _logprobs(spec["new_prompt_logprobs_tensors"], layout, tensors=True)
    return engine_core_output(spec["request_id"], list(spec["new_token_ids"]), **kwargs)


def our_outputs(logical: Dict[str, Any], layout: WireLayout) -> List[Any]:
    """wire.outputs.engine_core_outputs for one logical EngineCoreOutputs,
    packed and unpacked again (the comparison is of wire values)."""
    stats = None
    if logical.get("scheduler_stats"):
        s = logical["scheduler_stats"]
        stats = scheduler_stats(s["num_running_reqs"], s["num_waiting_reqs"], s["kv_cache_usage"], s["step_counter"], s["current_wave"])
    message = engine_core_outputs(
        logical["engine_index"],
        [our_output(o, layout) for o in logical["outputs"]],
        logical["timestamp"],
        finished_requests=logical.get("finished_requests"),
        scheduler_stats=stats,
    )
    return unpack(pack(message))


# --------------------------------------------------------------------------
# Comparing wire values
# --------------------------------------------------------------------------

#: numpy dtype strings (ndarray fields) and torch names (tensor fields) by
#: struct code and kind, to read an array triple's values (§0).
_DTYPES = {"<i4": "i", "<i8": "q", "<f4": "f", "<f8": "d", "int32": "i", "int64": "q", "float32": "f", "float64": "d"}


def _array_triple(value: Any) -> Optional[tuple]:
    """(kind, shape, values) of an inline `[dtype, shape, ext 3]` array, or None."""
    if not (isinstance(value, list) and len(value) == 3 and isinstance(value[0], str) and value[0] in _DTYPES):
        return None
    data = value[2]
    if not (hasattr(data, "code") and data.code == RAW_VIEW_EXT and isinstance(value[1], list)):
        return None
    code = _DTYPES[value[0]]
    count = len(data.data) // struct.calcsize(code)
    kind = "float" if code in "fd" else "int"
    return kind, value[1], list(struct.unpack(f"<{count}{code}", data.data))


def _default_like(value: Any) -> bool:
    """A value an omitted field would decode to in any era: nil, 0, false,
    or empty (what ours may send beyond the real struct's length)."""
    return value is None or value is False or value == 0 or value in ([], {}, "")


def _equal_scalars(ours: Any, real: Any) -> bool:
    if isinstance(ours, float) or isinstance(real, float):
        return isinstance(ours, (int, float)) and isinstance(real, (int, float)) and not isinstance(ours, bool) \
            and (ours == real or (math.isnan(ours) and math.isnan(real)))
    return type(ours) is type(real) and ours == real


#: Fields whose msgpack array is a Python set on the sender: order is the
#: set's iteration order, so they compare as sorted lists.
UNORDERED = frozenset(("finished_requests",))


def differences(ours: Any, real: Any, default: Any = None, path: str = "$", names: Optional[List[str]] = None,
                defaults: Optional[Dict[str, Any]] = None) -> List[str]:
    """Where `ours` differs from `real` (both unpacked), one line per place.

    Arrays of array_like structs (`names` given: the struct's fields in wire
    order, `default` its default instance unpacked) may differ in length:
    ours may stop early where real's remaining elements are the defaults
    (msgspec fills omitted trailing fields, §0), and may run on with
    default-like values (msgspec ignores extra trailing elements, §0).
    Maps: ours may carry keys the era lacks (unknown keys are ignored, §0);
    a key only real has must hold its default. Inline arrays compare by
    kind, shape and values (not by element width: both decoders read the
    dtype they are given, Appendix E). `defaults` maps field names to the
    unpacked defaults of nested structs (SchedulerStats, PrefixCacheStats).
    """
    defaults = defaults or {}
    out: List[str] = []
    triple_ours, triple_real = _array_triple(ours), _array_triple(real)
    if triple_real is not None or triple_ours is not None:
        if triple_ours != triple_real:
            out.append(f"{path}: array {ours!r} != real {real!r}")
        return out
    if isinstance(real, dict):
        if not isinstance(ours, dict):
            return [f"{path}: ours {ours!r} is not a map like real {real!r}"]
        for key, value in real.items():
            sub_default = default.get(key) if isinstance(default, dict) else None
            if key in ours:
                nested = sub_default if sub_default is not None else defaults.get(key)
                out += differences(ours[key], value, nested, f"{path}.{key}", defaults=defaults)
            elif not (isinstance(default, dict) and key in default and _equal_values(value, default[key])):
                out.append(f"{path}.{key}: ours omits it, real has {value!r} (not its default)")
        return out
    if isinstance(real, list) and names is not None:
        if not isinstance(ours, list):
            return [f"{path}: ours {ours!r} is not an array like real {real!r}"]
        for index in range(max(len(ours), len(real))):
            name = names[index] if index < len(names) else "?"
            where = f"{path}[{index}] ({name})"
            if index >= len(real):
                if not _default_like(ours[index]):
                    out.append(f"{where}: ours has {ours[index]!r} beyond the era's {len(real)} fields")
                continue
            field_default = default[index] if isinstance(default, list) and index < len(default) else None
            if index >= len(ours):
                if not _equal_values(real[index], field_default):
                    out.append(f"{where}: ours omits it, real has {real[index]!r} (default {field_default!r})")
                continue
            out += _field_differences(ours[index], real[index], field_default, where, name, defaults)
        return out
    if isinstance(real, list):
        if not isinstance(ours, list) or len(ours) != len(real):
            return [f"{path}: ours {ours!r} != real {real!r}"]
        for index, (a, b) in enumerate(zip(ours, real)):
            out += differences(a, b, None, f"{path}[{index}]", defaults=defaults)
        return out
    if not _equal_scalars(ours, real):
        out.append(f"{path}: ours {ours!r} != real {real!r}")
    return out


def _field_differences(ours: Any, real: Any, default: Any, where: str, name: str, defaults: Dict[str, Any]) -> List[str]:
    if name in UNORDERED and isinstance(ours, list) and isinstance(real, list):
        return [] if sorted(ours) == sorted(real) else [f"{where}: ours {ours!r} != real {real!r} (as sets)"]
    if name in defaults.get("_tuples", {}) and isinstance(real, list):
        # a LogprobsLists / LogprobsTensors NamedTuple: trailing fields with
        # defaults may be left out (Appendix E)
        names, tuple_defaults = defaults["_tuples"][name]
        return differences(ours, real, tuple_defaults, where, names=names, defaults=defaults)
    if name == "outputs" and isinstance(real, list):
        if not isinstance(ours, list) or len(ours) != len(real):
            return [f"{where}: ours has {len(ours) if isinstance(ours, list) else ours!r} outputs, real {len(real)}"]
        out: List[str] = []
        for index, (a, b) in enumerate(zip(ours, real)):
            out += differences(a, b, defaults["EngineCoreOutput"], f"{where}[{index}]", names=defaults["_output_fields"],
                               defaults=defaults)
        return out
    return differences(ours, real, defaults.get(name) if default is None else default, where, defaults=defaults)


def _equal_values(a: Any, b: Any) -> bool:
    return not differences(a, b)


def output_differences(document: Dict[str, Any], item: Dict[str, Any], ours: List[Any]) -> List[str]:
    """`differences` of our EngineCoreOutputs and a golden one."""
    values = document["default_values"]
    defaults = {
        "EngineCoreOutput": values["EngineCoreOutput"],
        "_output_fields": document["fields"]["EngineCoreOutput"],
        "scheduler_stats": values["SchedulerStats"],
        "prefix_cache_stats": values["PrefixCacheStats"],
        "_tuples": {field: _tuple_defaults(document, cls)
                    for field, cls in (("new_logprobs", "LogprobsLists"), ("new_prompt_logprobs_tensors", "LogprobsTensors"))},
    }
    return differences(ours, item["unpacked"], values["EngineCoreOutputs"], "$", names=document["fields"]["EngineCoreOutputs"],
                       defaults=defaults)


class _Required:
    """The default of a field without one: equal to nothing."""

    def __eq__(self, other: Any) -> bool:
        return False

    def __repr__(self) -> str:
        return "<required>"


def _tuple_defaults(document: Dict[str, Any], cls: str) -> tuple:
    names = document["fields"][cls]
    known = document["namedtuple_defaults"][cls]
    return names, [known[n] if n in known else _Required() for n in names]
