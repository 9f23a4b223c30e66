"""Figures at the engine boundary, from the record tap's traces: what the
engine itself did, without the frontend's and the client's noise.

    .venv/bin/python benchmarks/engine_boundary.py twin A.json B.json [--workload NAME ...]

A.json and B.json are `benchmarks/fidelity.py run` results whose runs have
traces (`--target real` or `emulated`, or `mock` with `--trace`). Per
workload (the window `t_start`..`t_end` each result stores) and per run:

* `step`: the engine's step times (tools/steps.py steps_from_trace: from
  the end of the previous step, on the engine's clock, or from the
  scheduling of the request that woke an idle engine);
* `ttft`: each request's time from its QUEUED event to the engine stamp of
  its first output with a token (the engine's clock);
* `itl`: the time between a request's consecutive outputs with tokens, per
  token (engine stamps);
* `req/s`: the requests whose ADD came in the window, over the time from
  the first such ADD to the last one's finish (the tap's clock).

`twin` prints, per workload and figure, the p50, p90 and p99 of each side
and their difference, and whether it is within TWIN_GOALS: a reference that
repeats itself is one whose two runs agree that closely; a mock given the
reference's own step function is judged against it the same way.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gmock_engine.tools.fit import quantile  # noqa: E402
from gmock_engine.tools.steps import steps_from_trace  # noqa: E402
from gmock_engine.timing.trace import read_trace  # noqa: E402

#: Largest |difference| of a twin, per percentile (and for req/s: throughput).
TWIN_GOALS = {"p50": 0.02, "p90": 0.02, "p99": 0.10, "throughput": 0.02}
FIGURES = ("step", "ttft", "itl")
#: The fidelity harness's token budget (benchmarks/fidelity.py MAX_NUM_BATCHED_TOKENS).
MAX_NUM_BATCHED_TOKENS = 2048


def window(records: Sequence[Mapping[str, object]], t_start: float, t_end: float) -> List[Mapping[str, object]]:
    """The records of the requests whose ADD the tap relayed in [t_start,
    t_end], with every output record in that span and after it up to the
    last of their finishes (outputs list only those requests)."""
    ids = {r["request_id"] for r in records if r.get("kind") == "add" and t_start <= r["t"] <= t_end}  # type: ignore[operator]
    out: List[Mapping[str, object]] = []
    for r in records:
        if r.get("kind") == "add":
            if r["request_id"] in ids:
                out.append(r)
        elif r.get("kind") == "output" and r["t"] >= t_start:  # type: ignore[operator]
            mine = [q for q in r.get("requests") or () if q["id"] in ids]  # type: ignore[union-attr]
            if mine or not r.get("requests"):
                out.append({**r, "requests": mine, "finished_requests": [i for i in r.get("finished_requests") or () if i in ids]})
    return out


def figures(records: Sequence[Mapping[str, object]], t_start: float, t_end: float,
            budget: int = MAX_NUM_BATCHED_TOKENS, priority: Optional[int] = None) -> Dict[str, object]:
    """The engine-boundary samples (ms) of one workload's window, and its
    req/s; `budget`: the engine's max_num_batched_tokens (the steps' reading);
    `priority`: only the requests of that priority (not the steps)."""
    rec = window(records, t_start, t_end)
    adds = {r["request_id"]: r for r in rec if r["kind"] == "add"}
    steps = [s.duration_ms for s in steps_from_trace(rec, budget) if s.batch]
    if priority is not None:
        adds = {rid: a for rid, a in adds.items() if (a.get("priority") or 0) == priority}
    queued: Dict[str, float] = {}
    scheduled: Dict[str, float] = {}
    last: Dict[str, float] = {}
    ttft: List[float] = []
    itl: List[float] = []
    finished_t: Dict[str, float] = {}
    for r in rec:
        if r["kind"] != "output":
            continue
        stamp = float(r["engine_timestamp"])  # type: ignore[arg-type]
        for q in r["requests"]:  # type: ignore[union-attr]
            rid = q["id"]
            if rid not in adds:
                continue
            for kind, ts in q.get("events") or ():
                if kind == 1 and rid not in queued:  # EngineCoreEventType.QUEUED
                    queued[rid] = ts
                elif kind == 2 and rid not in scheduled:  # SCHEDULED (the first: not a resumption after PREEMPTED)
                    scheduled[rid] = ts
            if q.get("tokens"):
                if rid not in last:
                    if rid in queued:
                        ttft.append((stamp - queued[rid]) * 1000.0)
                else:
                    itl.extend([(stamp - last[rid]) * 1000.0 / q["tokens"]] * q["tokens"])
                last[rid] = stamp
            if q.get("finish_reason") is not None:
                finished_t[rid] = float(r["t"])  # type: ignore[arg-type]
    queue = [(scheduled[rid] - queued[rid]) * 1000.0 for rid in scheduled if rid in queued]
    span = (max(finished_t.values()) - min(float(a["t"]) for a in adds.values())) if finished_t else 0.0  # type: ignore[arg-type]
    return {"step": steps, "ttft": ttft, "itl": itl, "queue": queue, "requests": len(adds), "finished": len(finished_t),
            "throughput": len(finished_t) / span if span > 0 else None}  # fmt: skip


def run_figures(result_path: str, workloads: Optional[Sequence[str]] = None) -> List[Dict[str, Dict[str, object]]]:
    """Per run of a fidelity.py result file: workload -> figures(), from the run's trace."""
    document = json.loads(Path(result_path).read_text())
    runs = []
    for run in document["runs"]:
        if not run.get("trace"):
            raise SystemExit(f"{result_path}: a run without a trace (run the target behind the tap: --trace)")
        _, records = read_trace(run["trace"])
        runs.append({name: figures(records, w["t_start"], w["t_end"]) for name, w in run["workloads"].items()
                     if workloads is None or name in workloads})  # fmt: skip
    return runs


def percentiles(values: Sequence[float]) -> Dict[str, Optional[float]]:
    """p50, p90, p99 of `values` (None when empty)."""
    ordered = sorted(values)
    return {f"p{p}": (quantile(ordered, p / 100.0) if ordered else None) for p in (50, 90, 99)}


def compare(a: Mapping[str, object], b: Mapping[str, object],
            names: Sequence[str] = FIGURES) -> List[Tuple[str, Optional[float], Optional[float], Optional[float], bool]]:
    """Rows (figure, a, b, (b - a) / a, within TWIN_GOALS) for two windows' figures() (`names`, then req/s)."""
    rows = []
    for name in names:
        pa, pb = percentiles(a[name]), percentiles(b[name])  # type: ignore[arg-type]
        for p in ("p50", "p90", "p99"):
            x, y = pa[p], pb[p]
            diff = (y - x) / x if x and y is not None else None
            rows.append((f"{name} {p}", x, y, diff, diff is not None and abs(diff) <= TWIN_GOALS[p]))
    x, y = a["throughput"], b["throughput"]
    diff = (y - x) / x if x and y is not None else None  # type: ignore[operator]
    rows.append(("req/s", x, y, diff, diff is not None and abs(diff) <= TWIN_GOALS["throughput"]))  # type: ignore[arg-type]
    return rows


def twin(options: argparse.Namespace) -> int:
    """`twin`: the first run of A against the first run of B (or A's runs 1 and 2 when B is not given)."""
    a_runs = run_figures(options.a, options.workload or None)
    b_runs = run_figures(options.b, options.workload or None) if options.b else a_runs[1:]
    if not b_runs:
        raise SystemExit("twin: give a second result file, or one with two runs (--repeat 2)")
    a, b = a_runs[0], b_runs[0]
    goals = ", ".join(f"{k} ±{v * 100:.0f} %" for k, v in TWIN_GOALS.items())
    print(f"engine boundary: {options.a} against {options.b or 'its second run'} (goals: {goals})\n")
    print("| workload | figure | A (ms) | B (ms) | B - A | within |")
    print("| --- | --- | ---: | ---: | ---: | --- |")
    misses = 0
    for name in [n for n in a if n in b]:
        for figure, x, y, diff, ok in compare(a[name], b[name]):
            misses += not ok
            fmt = (lambda v: "-" if v is None else f"{v:.2f}")
            print(f"| {name} | {figure} | {fmt(x)} | {fmt(y)} | {'-' if diff is None else f'{diff * 100:+.1f} %'} | {'yes' if ok else '**no**'} |")
    print(f"\nOutside the goals: {misses}")
    return 0


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("twin", help="markdown table: two runs compared at the engine boundary")
    t.add_argument("a", help="fidelity.py results with traces")
    t.add_argument("b", nargs="?", help="another such file (default: A's second run)")
    t.add_argument("--workload", action="append", default=[], help="only these workloads")
    options = parser.parse_args(argv)
    return twin(options)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
