"""Opcodes per request and per step, in-process: gmock's engine against the floor's.

A request's whole life without sockets: each ADD frame is decoded, applied,
stepped to its end and every message packed, for gmock (`wire.inputs.decode_input`,
`EngineCore.apply`, `EngineCore.step`, msgpack) and for the floor
(`reference_emitter.Engine`: `msgpack.unpackb`, `add`, `run_step`, which
packs). Both are fed the same frames, a real frontend's ADD from
tests/data/frames.json with a fresh request id each. The Python opcodes run in
a measured window are counted with `sys.settrace` (`f_trace_opcodes`), by
function: unlike a timing on this shared 2-core VM, the count does not move
from run to run, so it shows which layer a change made cheaper (what runs in
C, msgpack and list methods, is not counted; the timed benches are for that).

    .venv/bin/python benchmarks/opcodes.py                       # 2 ADDs a step: ~128 running, 2 ending each step
    .venv/bin/python benchmarks/opcodes.py --adds-every 20 --adds 1   # ~3 running: a step behind vllm serve
    .venv/bin/python benchmarks/opcodes.py --requests 4000 --timed 3  # and CPU µs a request, untraced

Prints opcodes per request and per step for both, the ratio, each one's
opcodes a request by module (the layer that pays), and gmock's most
expensive functions.
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable, Counter, List, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import msgpack  # noqa: E402

from gmock_engine.core.engine import EngineCore, EngineSettings  # noqa: E402
from gmock_engine.timing.latency import LatencyModel  # noqa: E402
from gmock_engine.timing.profile import read_profile  # noqa: E402
from gmock_engine.content.tokens import RandomTokens  # noqa: E402
from gmock_engine.wire.eras import DEFAULT_PROTOCOL_VERSION, layout_for_version  # noqa: E402
from gmock_engine.wire.inputs import decode_input  # noqa: E402
import reference_emitter  # noqa: E402  (beside this file: benchmarks/)

FRAMES = Path(__file__).resolve().parent.parent / "tests" / "data" / "frames.json"
TRACES = {"vllm-serve": "dp1.json", "vllm-rs": "rust_frontend_dp1.json"}


def add_frames(trace: str, count: int, max_tokens: int) -> List[List[bytes]]:
    """`count` ADD frames: the trace's first ADD with fresh ids and `max_tokens`."""
    records = json.loads(FRAMES.read_text())["records"]
    payload = next(bytes.fromhex(r["frames_hex"][1]) for r in records if r["trace"] == trace and r["frames_hex"][0] == "00")
    body = msgpack.unpackb(payload, strict_map_key=False)
    body[3]["max_tokens"] = max_tokens
    body[3].pop("min_tokens", None)  # every request runs to max_tokens
    frames = []
    for i in range(count):
        body[0] = f"opcodes-{i:08d}-{trace}"
        frames.append([b"\x00", msgpack.packb(body, use_bin_type=True)])
    return frames


class _Discard:
    """The floor's output socket: what it sends is packed, then dropped."""

    def send(self, data: bytes) -> None:
        pass


def gmock_loop(profile: str = "") -> Tuple[Callable[[List[bytes]], None], Callable[[], bool], Callable[[], None]]:
    # with a latency profile each step is also timed by it (Scheduler: LatencyModel.step_time)
    latency = LatencyModel(profile=read_profile(profile)) if profile else LatencyModel()
    settings = EngineSettings(rank=0, num_clients=1, reuse_outputs=True, latency=latency)
    engine = EngineCore(settings)
    pack = msgpack.Packer(use_bin_type=True).pack
    wire = settings.wire

    def add(frames: List[bytes]) -> None:
        for _, message in engine.apply(decode_input(frames, wire)):
            pack(message)

    def step() -> None:
        for _, message in engine.step():
            pack(message)  # encoded before the next step, as the runtime does (reused lists)

    return add, lambda: engine.has_work, step


def floor_loop() -> Tuple[Callable[[List[bytes]], None], Callable[[], bool], Callable[[], None]]:
    engine = reference_emitter.Engine(0, 1, RandomTokens(32000, 0, 0), layout_for_version(DEFAULT_PROTOCOL_VERSION))
    engine.outputs = [_Discard()]

    def add(frames: List[bytes]) -> None:
        engine.add(msgpack.unpackb(frames[1], strict_map_key=False))

    return add, lambda: engine.busy, engine.run_step


def drive(loop: Any, frames: List[List[bytes]], adds: int, every: int, counts: "Counter[Any] | None") -> int:
    """Feed `adds` ADDs before every `every`-th step until all are done; the
    steps taken. With `counts`, every opcode is counted by function."""
    add, busy, step = loop

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        if event == "call" and frame.f_code.co_filename == __file__:
            return None  # this driver's own loop and closures are neither engine's
        frame.f_trace_opcodes = True
        if event == "opcode":
            code = frame.f_code
            counts[(Path(code.co_filename).name, code.co_name)] += 1
        return tracer

    steps = i = 0
    if counts is not None:
        sys.settrace(tracer)
    try:
        while i < len(frames) or busy():
            steps += 1
            if steps % every == 0:
                for f in frames[i : i + adds]:
                    add(f)
                i += adds
            step()
    finally:
        sys.settrace(None)
    return steps


def measure(make: Callable[[], Any], frames: List[List[bytes]], warm: int, adds: int, every: int) -> Tuple["Counter[Any]", int]:
    loop = make()
    drive(loop, frames[:warm], adds, every, None)  # lanes, pools and the ledger's memory settle first
    counts: Counter[Any] = collections.Counter()
    steps = drive(loop, frames[warm:], adds, every, counts)
    return counts, steps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frontend", choices=sorted(TRACES), default="vllm-serve", help="whose traced ADD is sent")
    parser.add_argument("--requests", type=int, default=400, help="requests counted (after as many to warm up)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--adds", type=int, default=2, help="ADDs before a step that takes any")
    parser.add_argument("--adds-every", type=int, default=1, help="ADDs before every Nth step only")
    parser.add_argument("--top", type=int, default=12, help="gmock's functions listed")
    parser.add_argument("--latency-profile", default="", metavar="P.ini", help="time gmock's steps by this profile (its per-step cost)")
    parser.add_argument("--timed", type=int, default=0, metavar="N",
                        help="also N timed runs of each, untraced: CPU µs a request (process_time; noisy on a shared VM, "
                             "the opcodes are not)")
    args = parser.parse_args()
    if min(args.requests, args.max_tokens, args.adds, args.adds_every) < 1:
        parser.error("--requests, --max-tokens, --adds and --adds-every must be at least 1")
    gc.freeze()
    frames = add_frames(TRACES[args.frontend], 2 * args.requests, args.max_tokens)
    results = {}
    def gmock() -> Tuple[Callable[[List[bytes]], None], Callable[[], bool], Callable[[], None]]:
        return gmock_loop(args.latency_profile)

    for name, make in (("gmock", gmock), ("floor", floor_loop)):
        counts, steps = measure(make, frames, args.requests, args.adds, args.adds_every)
        results[name] = (counts, steps)
        total = sum(counts.values())
        print(f"{name:6} {total / args.requests:9,.0f} opcodes a request, {total / steps:7,.0f} a step "
              f"({steps} steps, {args.requests} requests x {args.max_tokens} tokens)")
    gmock_total = sum(results["gmock"][0].values())
    floor_total = sum(results["floor"][0].values())
    print(f"ratio gmock/floor opcodes: {gmock_total / floor_total:.2f}")
    # by module: which layer a request's price is paid in (the floor is one
    # module and what it calls of wire/ and content/tokens.py)
    for name in ("gmock", "floor"):
        modules: Counter[str] = collections.Counter()
        for (filename, _), count in results[name][0].items():
            modules[filename] += count
        print(f"{name}'s modules, opcodes a request: "
              + ", ".join(f"{filename} {count / args.requests:,.0f}" for filename, count in modules.most_common()))
    for run in range(args.timed):
        # the same drive without the tracer, each engine fresh and warmed
        # as above; CPU time, so a descheduled moment does not count
        line = []
        for name, make in (("gmock", gmock), ("floor", floor_loop)):
            loop = make()
            drive(loop, frames[: args.requests], args.adds, args.adds_every, None)
            started = time.process_time()
            drive(loop, frames[args.requests :], args.adds, args.adds_every, None)
            line.append((name, (time.process_time() - started) / args.requests * 1e6))
        print(f"timed run {run + 1}: " + ", ".join(f"{name} {us:.1f} µs a request" for name, us in line)
              + f", ratio {line[0][1] / line[1][1]:.2f}")
    if args.top:
        print(f"gmock's functions, opcodes a request (of {gmock_total / args.requests:,.0f}):")
    for (filename, function), count in results["gmock"][0].most_common(args.top):
        print(f"  {count / args.requests:8,.1f}  {filename}:{function}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
