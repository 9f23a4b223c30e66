"""The arithmetic of benchmarks/fidelity.py, pure (no processes, no sockets).

* Prometheus text: a histogram's cumulative bucket counts, summed over its
  series (one per engine), the delta between two scrapes and a quantile of
  that delta, interpolated inside a bucket as Prometheus' histogram_quantile
  does;
* the figures kept from `vllm bench serve --save-result`;
* the comparison of a mock's results with a real engine's repetitions: a
  markdown table with the run-to-run spread, the error and the verdict
  against the goals (GOALS).
"""

from __future__ import annotations

import math
import re
import statistics
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

#: Histograms read from the frontend's /metrics (vLLM 0.32 names).
HISTOGRAMS = {
    "ttft": "vllm:time_to_first_token_seconds",
    "itl": "vllm:inter_token_latency_seconds",
}
#: Quantiles taken of the bench's lists and of the histograms, in percent.
PERCENTILES = (50, 90, 99)
#: Latencies kept from the bench's result JSON: `p<P>_<name>_ms`.
BENCH_LATENCIES = ("ttft", "tpot", "itl", "e2el")

#: Allowed relative error per kind of metric (a mock value inside the real
#: runs' own range passes too).
GOALS = {"p50": 0.05, "p90": 0.05, "p99": 0.15, "throughput": 0.03}

_SAMPLE = re.compile(r'^(?P<name>[A-Za-z_:][A-Za-z0-9_:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)')
_LE = re.compile(r'(?:^|,)\s*le="(?P<le>[^"]*)"')


def fine_buckets(low: float = 0.0005, high: float = 60.0, ratio: float = 1.04) -> List[float]:
    """Geometric bucket bounds from `low` to at least `high`: a quantile read
    from them is within about (ratio - 1) / 2 of the true one, where vLLM's
    default buckets (10 ms wide at the bottom) cannot tell 4 ms from 6."""
    bounds, value = [], low
    while value < high * ratio:
        bounds.append(float(f"{value:.6g}"))
        value *= ratio
    return bounds


def histogram(text: str, name: str) -> Dict[float, float]:
    """Cumulative counts by upper bound (`le`, +Inf as math.inf) of the
    histogram `name` in Prometheus text `text`, summed over its series."""
    buckets: Dict[float, float] = {}
    wanted = name + "_bucket"
    for line in text.splitlines():
        if not line.startswith(wanted):
            continue
        match = _SAMPLE.match(line)
        if not match or match.group("name") != wanted:
            continue
        le = _LE.search(match.group("labels") or "")
        if not le:
            continue
        bound = math.inf if le.group("le") in ("+Inf", "Inf") else float(le.group("le"))
        buckets[bound] = buckets.get(bound, 0.0) + float(match.group("value"))
    return buckets


def delta(before: Mapping[float, float], after: Mapping[float, float]) -> Dict[float, float]:
    """Per-bound counts observed between two scrapes (bounds only in
    `after` count from zero)."""
    return {bound: count - before.get(bound, 0.0) for bound, count in after.items()}


def quantile(buckets: Mapping[float, float], q: float) -> Optional[float]:
    """The q-quantile (0 < q < 1) of cumulative `buckets`, linear inside the
    bucket the rank falls in (from 0 for the first bucket); the highest
    finite bound when it falls in +Inf; None for an empty histogram."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return None
    rank = q * buckets[bounds[-1]]
    low, below = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if math.isinf(bound):
                return low
            if count == below:
                return bound
            return low + (bound - low) * (rank - below) / (count - below)
        low, below = bound, count
    return low


def histogram_figures(before: str, after: str) -> Dict[str, Optional[float]]:
    """`metrics_<name>_p<P>_ms` and `metrics_<name>_count` for each of
    HISTOGRAMS, from two scrapes of /metrics."""
    out: Dict[str, Optional[float]] = {}
    for short, name in HISTOGRAMS.items():
        observed = delta(histogram(before, name), histogram(after, name))
        out[f"metrics_{short}_count"] = max(observed.values(), default=0.0)
        for p in PERCENTILES:
            value = quantile(observed, p / 100)
            out[f"metrics_{short}_p{p}_ms"] = None if value is None else value * 1000
    return out


def bench_figures(result: Mapping[str, object]) -> Dict[str, object]:
    """The figures kept from one `vllm bench serve --save-result` JSON."""
    keep = ["completed", "failed", "duration", "request_throughput", "output_throughput"]
    keep += [f"p{p}_{name}_ms" for name in BENCH_LATENCIES for p in PERCENTILES]
    keep += [f"mean_{name}_ms" for name in BENCH_LATENCIES]
    return {key: result.get(key) for key in keep}


# -- comparison --------------------------------------------------------------------

#: Rows of the comparison table: (label, key in a workload's results).
COMPARED: Tuple[Tuple[str, str], ...] = tuple(
    [(f"TTFT p{p}", f"p{p}_ttft_ms") for p in PERCENTILES]
    + [(f"ITL p{p}", f"p{p}_itl_ms") for p in PERCENTILES]
    + [("req/s", "request_throughput")]
    + [(f"/metrics TTFT p{p}", f"metrics_ttft_p{p}_ms") for p in PERCENTILES]
    + [(f"/metrics ITL p{p}", f"metrics_itl_p{p}_ms") for p in PERCENTILES]
)


def goal_for(key: str) -> float:
    """The allowed relative error of the metric stored under `key`."""
    if "throughput" in key:
        return GOALS["throughput"]
    match = re.search(r"p(\d+)", key)
    return GOALS.get(f"p{match.group(1)}", GOALS["p99"]) if match else GOALS["p99"]


def spread(values: Sequence[float]) -> Optional[float]:
    """(max - min) / mean of the real runs, or None for fewer than two."""
    if len(values) < 2 or not statistics.fmean(values):
        return None
    return (max(values) - min(values)) / statistics.fmean(values)


def verdict(real: Sequence[float], mock: Optional[float], key: str) -> Tuple[Optional[float], bool]:
    """(relative error of `mock` against the real runs' mean, within goal):
    within the goal, or inside the real runs' own range."""
    if mock is None or not real:
        return None, False
    mean = statistics.fmean(real)
    error = (mock - mean) / mean if mean else math.inf
    return error, abs(error) <= goal_for(key) or min(real) <= mock <= max(real)


def _num(value: Optional[float]) -> str:
    if value is None:
        return "-"
    return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"


def _pct(value: Optional[float], sign: str = "+") -> str:
    return "-" if value is None else f"{value * 100:{sign}.1f} %"


def compare_table(real_runs: Sequence[Mapping[str, Mapping[str, object]]],
                  mock_runs: Optional[Sequence[Mapping[str, Mapping[str, object]]]],
                  workloads: Iterable[str]) -> Tuple[str, List[str]]:
    """Markdown table and the list of misses: per workload and metric, each
    real run, the real spread, the mock value (the mean of its runs; with
    two or more, their spread too) and its error. Each run maps workload
    name -> figures (fidelity.py's `workloads`)."""
    heads = [f"real {i + 1}" for i in range(len(real_runs))]
    several = bool(mock_runs) and len(mock_runs) > 1  # type: ignore[arg-type]
    mock_heads = " | mock | mock spread" if several else " | mock"
    lines = ["| workload | metric | " + " | ".join(heads) + f" | spread{mock_heads} | error | ok |",
             "| --- | --- | " + " | ".join("---:" for _ in heads) + " | ---:" * (5 if several else 4) + " | --- |"]
    mock = mock_runs[0] if mock_runs else None
    misses: List[str] = []
    for name in workloads:
        for label, key in COMPARED:
            values = [run.get(name, {}).get(key) for run in real_runs]
            real = [float(v) for v in values if isinstance(v, (int, float))]
            of_mock = [run.get(name, {}).get(key) for run in mock_runs or ()]
            mock_values = [float(v) for v in of_mock if isinstance(v, (int, float))]
            mock_value = statistics.fmean(mock_values) if mock_values else None
            if not real and mock_value is None:
                continue
            error, ok = verdict(real, mock_value, key)
            mark = "" if mock is None else ("yes" if ok else "**no**")
            if mock is not None and not ok:
                misses.append(f"{name} {label}: {_pct(error)} (goal ±{goal_for(key) * 100:.0f} %)")
            lines.append(f"| {name} | {label} | " + " | ".join(_num(v if isinstance(v, (int, float)) else None) for v in values)
                         + f" | {_pct(spread(real), '')} | {_num(mock_value)}"
                         + (f" | {_pct(spread(mock_values), '')}" if several else "") + f" | {_pct(error)} | {mark} |")
    return "\n".join(lines), misses


def ttft_parts(records: Sequence[Mapping[str, object]], t_start: float, t_end: float) -> Dict[str, Optional[float]]:
    """Where a workload's time to first token goes, from a trace of its run
    (gmock_engine/timing/trace.py): medians in ms over the requests whose ADD the
    tap relayed inside [t_start, t_end] and which got a token.

    * `frontend`: the request's arrival at the frontend (the ADD's
      `arrival_time`) to the tap relaying its ADD: the frontend's own work;
    * `engine`: the ADD relayed to its first output reaching the tap: the
      engine's input path, its queue and its prefill step;
    * `queued_to_first`: the engine's QUEUED event to the first output's
      engine timestamp, on the engine's clock (None without events)."""
    adds = {r["request_id"]: r for r in records if r.get("kind") == "add" and t_start <= r["t"] <= t_end}  # type: ignore[operator]
    first_t: Dict[str, float] = {}
    first_e: Dict[str, float] = {}
    queued: Dict[str, float] = {}
    for record in records:
        if record.get("kind") != "output":
            continue
        for request in record.get("requests") or ():  # type: ignore[union-attr]
            rid = request["id"]
            if rid not in adds:
                continue
            if rid not in first_t:
                first_t[rid], first_e[rid] = record["t"], record["engine_timestamp"]  # type: ignore[assignment]
            for kind, ts in request.get("events") or ():
                if kind == 1 and rid not in queued:  # EngineCoreEventType.QUEUED
                    queued[rid] = ts

    def median_ms(values: List[float]) -> Optional[float]:
        return round(statistics.median(values) * 1000.0, 2) if values else None

    ids = [i for i in adds if i in first_t]
    return {
        "requests": len(ids),  # type: ignore[dict-item]
        "frontend": median_ms([adds[i]["t"] - adds[i]["arrival_time"] for i in ids]),  # type: ignore[operator]
        "engine": median_ms([first_t[i] - adds[i]["t"] for i in ids]),  # type: ignore[operator]
        "queued_to_first": median_ms([first_e[i] - queued[i] for i in ids if i in queued]),
    }
