"""wire_rules for SchedulerStats (docs/protocol.md §7.1): the fields vllm-rs
cannot do without, their types, the spec-decoding and prefix-cache stats in
them. The sources cited: wire_rules.py."""

from __future__ import annotations

from typing import Any, Dict

from wire_rules_checker import U64_MAX, _Checker, _is_float, _is_int, _short

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
