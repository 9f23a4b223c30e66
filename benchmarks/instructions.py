"""Instructions per token and per request over real sockets: `gmock-engine
bench` with the engine under callgrind, its counts zeroed when the measured
window starts and dumped when it ends.

On this shared 2-core VM the CPU-time figures of `./run.sh bench` move by
10-30 % from run to run; a count of instructions does not (well under 1 %
between runs of the same code), so a change of a few per cent in the cost
of a step or of an ADD shows here when the wall-clock benches cannot see
it. It counts user-space instructions of every thread of the engine
process (the ZMQ I/O thread too), not the kernel's, and no cache misses:
a yardstick for code paths, not a replacement for the timed benches.

    .venv/bin/python benchmarks/instructions.py [bench options], e.g.
        --concurrency 4 --max-tokens 64      (steps of a few requests: P2's regime)
        --concurrency 1 --max-tokens 1024    (the fixed cost of a step)

Every bench option passes through (`--target gmock` for gmock alone; the
default runs the floor too and prints the ratio). Needs valgrind
(`callgrind_control` on PATH). Under callgrind the engine runs ~50x
slower, so the stepper's hub-round interval (runner.YIELD_INTERVAL_S,
100 µs) is stretched by the same factor (`--yield-interval`), or nearly
every step would pay a hub round that a real run pays every ~20 steps.
"""

from __future__ import annotations

import argparse
import glob
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gmock_engine.tools import bench  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--yield-interval", type=float, default=0.005, help="the engine's hub-round interval under callgrind, seconds")
    ours, rest = parser.parse_known_args()
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        print("instructions.py: needs valgrind (callgrind_control) on PATH", file=sys.stderr)
        return 2
    out_dir = tempfile.mkdtemp(prefix="gmock-callgrind-")
    counts: Dict[str, Dict[str, Any]] = {}
    engine_command, run = bench.engine_command, bench.Driver.run

    def under_callgrind(target: str, args: argparse.Namespace, handshake: str) -> List[str]:
        command = engine_command(target, args, handshake)
        if command[1:3] == ["-m", "gmock_engine"]:
            # the engine's own entry point, with the stepper's interval stretched
            code = (
                "from gevent import monkey; monkey.patch_all(); import sys, gmock_engine.runtime.runner as r; "
                f"r.YIELD_INTERVAL_S = {ours.yield_interval!r}; from gmock_engine.runtime.cli import main; sys.exit(main())"
            )
            command = [command[0], "-c", code, *command[3:]]
        return ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out_dir}/{target}.%p", "--dump-instr=no", *command]

    def counted(self: Any, seconds: float, measure: bool, **kw: Any) -> Any:
        if not measure:
            return run(self, seconds, measure, **kw)
        pid = str(self.pids[0])  # valgrind runs the engine in its own process
        subprocess.run(["callgrind_control", "-z", pid], check=True, capture_output=True)
        load = run(self, seconds, measure, **kw)
        subprocess.run(["callgrind_control", "-d", pid], check=True, capture_output=True)
        time.sleep(0.5)
        total = 0
        for path in glob.glob(f"{out_dir}/*.{pid}.1"):  # part 1: from the zero to the dump
            with open(path) as dump:
                total = next(int(line.split()[1]) for line in dump if line.startswith(("summary:", "totals:")))
        target = "gmock" if glob.glob(f"{out_dir}/gmock.{pid}.1") else "reference"
        counts[target] = {"instructions": total, "tokens": load.tokens, "requests": load.finished}
        return load

    bench.engine_command = under_callgrind
    bench.Driver.run = counted
    try:
        status = bench.main([*rest, "--join-timeout", "180"])
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    print("\ninstructions in the window (callgrind, user space, all threads of the engine process):")
    for target, c in counts.items():
        per_token = c["instructions"] / max(c["tokens"], 1)
        per_request = c["instructions"] / max(c["requests"], 1)
        print(f"{target:10s} {c['instructions']:>14,} for {c['tokens']:>8,} tokens, {c['requests']:>6,} requests: "
              f"{per_token:>9,.0f} per token {per_request:>12,.0f} per request")
    if len(counts) == 2:
        g, r = counts["gmock"], counts["reference"]
        ratio_token = (g["instructions"] / max(g["tokens"], 1)) / (r["instructions"] / max(r["tokens"], 1))
        print(f"ratio gmock/reference instructions per token: {ratio_token:.2f}", end="")
        if g["requests"] and r["requests"]:
            print(f", per request: {(g['instructions'] / g['requests']) / (r['instructions'] / r['requests']):.2f}")
        else:
            print()
    return status


if __name__ == "__main__":
    sys.exit(main())
