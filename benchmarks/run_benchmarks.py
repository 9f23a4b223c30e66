"""The benchmark suite: the bench driver over a matrix, then the targets P1-P6.

    .venv/bin/python benchmarks/run_benchmarks.py [--quick] [--json FILE]

Every row is one `gmock-engine bench` run (gmock and, where a ratio is
needed, the bare reference emitter in the same run). Figures are printed,
never asserted: this machine is shared and noisy; ratios against the
reference emitter measured in the same run are what to compare across runs.
P2 (behind the real Python frontend) is benchmarks/behind_frontend.py.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gmock_engine.tools import bench  # noqa: E402


def run(label: str, argv: List[str], targets=("gmock", "reference")) -> Dict[str, Dict[str, Any]]:
    args = bench.build_parser().parse_args(argv)
    results = {}
    for target in targets:
        result = bench.run_target(target, args)
        result["label"] = label
        results[target] = result
    if "reference" in results:
        results["gmock"]["ratio_vs_reference"] = results["gmock"]["cpu_us_per_token"] / results["reference"]["cpu_us_per_token"]
    row = results["gmock"]
    ref = results.get("reference")
    print(
        f"{label:<34} {row['tokens_per_s']:>11,.0f} tok/s  gmock {row['cpu_us_per_token']:5.2f} µs/tok"
        + (f"  ref {ref['cpu_us_per_token']:5.2f}  ratio {row['ratio_vs_reference']:4.2f}" if ref else "")
        + f"  ttft p99 {row['ttft_p99_ms']:6.2f} ms  drv {row['driver_cpu_us_per_token']:4.2f} µs/tok",
        flush=True,
    )
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2 s windows instead of 5 s")
    parser.add_argument("--json", help="write every result to this file")
    options = parser.parse_args()
    window = ["--duration", "2" if options.quick else "5", "--warmup", "1", "--idle", "2"]
    started = time.monotonic()
    all_results: Dict[str, Any] = {}

    print("== matrix: CPU per token vs the bare reference emitter (closed loop, max_tokens 256) ==")
    for engines in (1, 4):
        for chunk in (1, 4):
            for concurrency in (16, 256, 2048):
                label = f"engines {engines} chunk {chunk} C {concurrency}"
                all_results[label] = run(
                    label, ["--engines", str(engines), "--chunk", str(chunk), "--concurrency", str(concurrency), *window]
                )

    print("== scaling: --processes 1 vs 2 (4 engines, chunk 1, C 256) ==")
    for processes in (1, 2):
        label = f"engines 4 processes {processes} C 256"
        all_results[label] = run(
            label, ["--engines", "4", "--processes", str(processes), "--concurrency", "256", *window], targets=("gmock",)
        )

    print("== P3: --itl-ms 10, 2048 running per engine ==")
    p3 = run("itl 10 ms C 2048", ["--itl-ms", "10", "--concurrency", "2048", "--max-tokens", "100000", *window], ("gmock",))
    print("== P5: 100 000 requests in flight; 64 engines joining ==")
    p5 = run(
        "C 100000 itl 1000 ms",
        ["--concurrency", "100000", "--itl-ms", "1000", "--max-tokens", "1000000000", "--duration", "4", "--warmup", "3", "--idle", "1"],
        ("gmock",),
    )
    join = run("64 engines", ["--engines", "64", "--concurrency", "1", "--duration", "1", "--warmup", "0", "--idle", "2"], ("gmock",))
    print("== P6: ADD -> first output at 1000 requests/s (open loop, max_tokens 8) ==")
    p6 = run("rate 1000/s", ["--rate", "1000", "--max-tokens", "8", *window])

    p1 = all_results["engines 1 chunk 1 C 256"]
    idle = max(r[t]["idle_cpu_pct"] for r in all_results.values() for t in r)
    scaling = (
        all_results["engines 4 processes 2 C 256"]["gmock"]["tokens_per_s"]
        / all_results["engines 4 processes 1 C 256"]["gmock"]["tokens_per_s"]
    )
    rows = [
        ("P1 CPU/token vs reference, chunk 1, C 256", f"{p1['gmock']['ratio_vs_reference']:.2f}x", "<= 1.5x", p1["gmock"]["ratio_vs_reference"] <= 1.5),
        ("P2 mock CPU / Python frontend CPU", "see behind_frontend.py", "<= 10 %", None),
        ("P3 step lateness p99, itl 10 ms, C 2048", f"{p3['gmock']['lateness_p99_us'] / 1000:.2f} ms", "<= 1 ms", p3["gmock"]["lateness_p99_us"] <= 1000),
        ("P4 idle CPU per process (worst run)", f"{idle:.2f} %", "<= 0.5 %", idle <= 0.5),
        ("P5 RSS per request in flight (100 000)", f"{p5['gmock']['rss_kb_per_request']:.2f} KB", "<= 2 KB", p5["gmock"]["rss_kb_per_request"] <= 2),
        ("P5 64 engines join", f"{join['gmock']['join_s']:.2f} s", "<= 2 s", join["gmock"]["join_s"] <= 2),
        ("P6 ADD -> first output p99 at 1000 req/s", f"{p6['gmock']['ttft_p99_ms']:.2f} ms", "<= 0.5 ms", p6["gmock"]["ttft_p99_ms"] <= 0.5),
        ("scaling 2 processes / 1 (tokens/s)", f"{scaling:.2f}x", "(2 cores, shared with the driver)", None),
    ]
    print("== targets ==")
    for name, value, target, met in rows:
        verdict = "" if met is None else ("met" if met else "MISSED")
        print(f"{name:<44} {value:>24}  target {target:<10} {verdict}")
    print(f"suite took {time.monotonic() - started:.0f} s")
    if options.json:
        with open(options.json, "w") as handle:
            json.dump({"matrix": all_results, "p3": p3, "p5": p5, "join": join, "p6": p6}, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
