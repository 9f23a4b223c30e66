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
    row = results["gmock"]
    ref = results.get("reference")
    if ref is not None:
        row["ratio_vs_reference"] = row["cpu_us_per_token"] / ref["cpu_us_per_token"]
    ttft = f"ttft p50/p99 {row['ttft_p50_ms']:6.2f}/{row['ttft_p99_ms']:6.2f} ms" if row.get("ttft_count") else "ttft -"
    if ref is not None and ref.get("ttft_count"):
        ttft += f" (floor {ref['ttft_p50_ms']:.2f}/{ref['ttft_p99_ms']:.2f})"
    print(
        f"{label:<40} {row['tokens_per_s']:>11,.0f} tok/s  gmock {row['cpu_us_per_token']:5.2f} µs/tok"
        + (f"  floor {ref['cpu_us_per_token']:5.2f}  ratio {row['ratio_vs_reference']:4.2f}" if ref else "")
        + f"  {ttft}  late p99 {row.get('lateness_p99_us') or 0:5.0f} µs"
        + (f" (floor {ref['lateness_p99_us']:.0f})" if ref is not None and ref.get("lateness_p99_us") else "")
        + f"  drv {row['driver_cpu_us_per_token']:4.2f} µs/tok",
        flush=True,
    )
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2 s windows instead of 5 s, and no P5 million")
    parser.add_argument("--json", help="write every result to this file")
    options = parser.parse_args()
    window = ["--duration", "2" if options.quick else "5", "--warmup", "1", "--idle", "2"]
    started = time.monotonic()
    results: Dict[str, Any] = {}

    def row(label: str, argv: List[str], targets=("gmock", "reference")) -> Dict[str, Dict[str, Any]]:
        results[label] = run(label, argv, targets)
        return results[label]

    print("== matrix: CPU per token against the floor (closed loop, max_tokens 1024) ==")
    for engines in (1, 4):
        for chunk in (1, 4):
            for concurrency in (256, 2048):
                row(f"engines {engines} chunk {chunk} C {concurrency}",
                    ["--engines", str(engines), "--chunk", str(chunk), "--concurrency", str(concurrency), "--max-tokens", "1024", *window])  # fmt: skip
    print("== features (engines 1, chunk 1, C 256): what each costs; the floor makes the same logprobs, prefix caching and KV events and paces the same way, and none of the rest ==")
    base = ["--concurrency", "256", "--max-tokens", "1024", *window]
    row("an EOS id in every ADD (as the frontends')", ["--eos-token-id", "31999", *base])
    row("logprobs 5 for half the requests", ["--logprobs-share", "0.5", *base])
    row("prefix caching", ["--engine-arg=--prefix-caching", *base])
    kv_events = '{"enable_kv_cache_events": true, "endpoint": "tcp://127.0.0.1:0", "replay_endpoint": "tcp://127.0.0.1:0"}'
    row("prefix caching + KV events", ["--engine-arg=--prefix-caching", f"--engine-arg=--kv-events-config={kv_events}", *base])
    # paced: the floor steps on the same grid (its own timerfd) and reports its lateness too
    row("paced --itl-ms 5", ["--itl-ms", "5", "--concurrency", "256", "--max-tokens", "64", *window])
    row("paced --itl-ms 5, 4 engines", ["--itl-ms", "5", "--engines", "4", "--concurrency", "256", "--max-tokens", "64", *window])
    print("== P6: ADD -> first output, open loop ==")
    for rate in (1000, 10000):
        for tokens in (64, 256):
            row(f"rate {rate}/s max_tokens {tokens}", ["--rate", str(rate), "--max-tokens", str(tokens), *window])
    print("== scaling: --processes 1 vs 2 (4 engines, chunk 1, C 256) ==")
    for processes in (1, 2):
        row(f"engines 4 processes {processes} C 256",
            ["--engines", "4", "--processes", str(processes), "--concurrency", "256", "--max-tokens", "1024", *window], ("gmock",))  # fmt: skip
    print("== P3: --itl-ms 10, 8192 running per engine ==")
    p3 = row("itl 10 ms C 8192", ["--itl-ms", "10", "--concurrency", "8192", "--max-tokens", "100000", *window])
    print("== P5: requests in flight; engines joining ==")
    many = 100_000 if options.quick else 1_000_000
    p5 = row(f"C {many} itl 60 s",
             # the warm-up allows 40 µs for taking in each ADD; a step a
             # minute (one of 1 000 000 outputs takes seconds to send and read)
             ["--concurrency", str(many), "--itl-ms", "60000", "--max-tokens", "1000000000", "--duration", "4",
              "--warmup", str(many * 40e-6 + 3),
              "--idle", "1", "--join-timeout", "120"], ("gmock",))  # fmt: skip
    join = row("256 engines", ["--engines", "256", "--concurrency", "1", "--duration", "1", "--warmup", "0", "--idle", "2"], ("gmock",))

    def ratio(label: str) -> float:
        return results[label]["gmock"]["ratio_vs_reference"]

    def ttft_ratio(label: str) -> float:
        g, r = results[label]["gmock"], results[label]["reference"]
        return g["ttft_p99_ms"] / r["ttft_p99_ms"] if r.get("ttft_count") and r["ttft_p99_ms"] > 0 else float("nan")

    p1 = {label: ratio(label) for label in results if label.startswith("engines 1 chunk")}
    p6 = {label: results[label]["gmock"]["ttft_p99_ms"] for label in results if label.startswith("rate ")}
    saturated = max(ttft_ratio(label) for label in results if label.startswith("engines 1 chunk"))
    idle = max(r[t]["idle_cpu_pct"] for r in results.values() for t in r)
    scaling = results["engines 4 processes 2 C 256"]["gmock"]["tokens_per_s"] / results["engines 4 processes 1 C 256"]["gmock"]["tokens_per_s"]
    targets = [
        ("P1 CPU/token vs floor, 1 engine, chunk 1/4, C 256/2048 (worst)", f"{max(p1.values()):.2f}x", "<= 1.5x", max(p1.values()) <= 1.5),
        ("P2 mock CPU / frontend CPU", "see behind_frontend.py", "<= 10 % / 25 %", None),
        ("P3 step lateness p99, itl 10 ms, C 8192", f"{p3['gmock']['lateness_p99_us'] / 1000:.2f} ms (floor {p3['reference']['lateness_p99_us'] / 1000:.2f})",
         "<= 1 ms", p3["gmock"]["lateness_p99_us"] <= 1000),
        ("P4 idle CPU per process (worst run)", f"{idle:.2f} %", "<= 0.5 %", idle <= 0.5),
        (f"P5 RSS per request in flight ({many:,})", f"{p5['gmock']['rss_kb_per_request']:.2f} KB", "<= 1 KB", p5["gmock"]["rss_kb_per_request"] <= 1),
        ("P5 256 engines join", f"{join['gmock']['join_s']:.2f} s", "<= 1 s", join["gmock"]["join_s"] <= 1),
        ("P6 ADD -> first output p99, open loop (worst)", f"{max(p6.values()):.2f} ms", "<= 0.5 ms", max(p6.values()) <= 0.5),
        ("P6 TTFT p99 at saturation vs floor (worst)", f"{saturated:.2f}x", "<= 1.5x", saturated <= 1.5),
        ("scaling 2 processes / 1 (tokens/s)", f"{scaling:.2f}x", ">= 1.8x", scaling >= 1.8),
    ]
    print("== targets ==")
    for name, value, target, met in targets:
        verdict = "" if met is None else ("met" if met else "MISSED")
        print(f"{name:<62} {value:>22}  target {target:<14} {verdict}")
    print(f"suite took {time.monotonic() - started:.0f} s")
    if options.json:
        with open(options.json, "w") as handle:
            json.dump(results, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
