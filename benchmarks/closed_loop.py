"""The engine's side of TTFT under a latency profile, without the machine's noise.

    .venv/bin/python benchmarks/closed_loop.py --profile p.ini --real held1.jsonl \
        --prompt-len 768 --cached 256 --max-tokens 128 --clients 2 --requests 32

A closed loop of `--clients` clients drives one EngineCore (gmock_engine's
own, with `--latency-profile`'s model) on a virtual clock: each client
sends its next request when its previous one has finished plus a frontend
delay drawn from the real trace (from a finishing output to the next ADD
at the tap, for requests of the same prompt length). Prompts share their
first `--cached` tokens, so prefix caching hits as in a `vllm bench serve`
random run of that shape. Printed: ADD -> first token (ms, p50/p90/p99) of
the mock's engine over `--seeds` runs, beside the real engine's from the
same trace (ADD relayed -> first output at the tap), and how long the mock's
requests waited for their first step and took in it. The mock's engine
starts knowing the step sizes the real engine had run before the workload
(its steps in the trace), so that its new sizes are the real one's
(latency_profile.StepSizes).

A run through the real frontend (fidelity.py) is the test that counts; this
shows what the profile and the scheduler give on their own, so that a
change to either can be judged on a busy machine.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from typing import Dict, List, Sequence, Tuple

import msgpack

from gmock_engine.core.engine import EngineCore, EngineSettings
from gmock_engine.timing.latency import LatencyModel
from gmock_engine.timing.profile import StepSizes, read_profile
from gmock_engine.tools.steps import steps_from_trace
from gmock_engine.timing.trace import output_record, read_trace
from gmock_engine.wire.inputs import EngineCoreRequest

#: The engine limits of the real engine in fidelity.py (MOCK_ARGS).
LIMITS = dict(block_size=32, max_num_batched_tokens=2048, max_num_seqs=128)
SCHEDULED = 2


def quantile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))] if ordered else float("nan")


def real_figures(path: str, prompt_len: int) -> Tuple[List[float], List[float]]:
    """From a real trace, for requests of `prompt_len`: ADD -> first output
    at the tap (ms), and the frontend delays (s) from an output that
    finished one of them to the next ADD."""
    with open(path, encoding="utf-8") as f:
        records = [r for r in map(json.loads, f) if r.get("kind")]
    adds = sorted((r for r in records if r["kind"] == "add" and r.get("prompt_len") == prompt_len), key=lambda r: r["t"])
    ids = {a["request_id"]: a for a in adds}
    first: Dict[str, float] = {}
    finishes: List[float] = []
    for record in records:
        if record["kind"] != "output":
            continue
        for item in record.get("requests") or ():
            if item["id"] in ids:
                first.setdefault(item["id"], record["t"])
                if item.get("finish_reason") is not None:
                    finishes.append(record["t"])
    ttft = [(first[i] - a["t"]) * 1000.0 for i, a in ids.items() if i in first]
    finishes.sort()
    gaps = []
    for add in adds:
        before = [t for t in finishes if t <= add["t"]]
        if before and add["t"] - before[-1] < 0.1:  # the client's next request, not a new phase
            gaps.append(add["t"] - before[-1])
    return ttft, gaps


def sizes_before(path: str, prompt_len: int) -> List[int]:
    """The sizes of the real engine's steps (StepSizes), in order, before
    the first ADD of `prompt_len` tokens in the trace at `path`."""
    records = read_trace(path)[1]
    start = min(r["t"] for r in records if r.get("kind") == "add" and r.get("prompt_len") == prompt_len)
    return [s.decode + s.prefill_tokens for s in steps_from_trace(records, LIMITS["max_num_batched_tokens"]) if s.start < start]


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run(profile_path: str, gaps: Sequence[float], history: Sequence[int], args: argparse.Namespace, seed: int) -> Dict[str, List[float]]:
    """One closed-loop run, the engine having run steps of the sizes
    `history` before; per request (ms): ADD -> first token, ADD ->
    scheduled, scheduled -> first token."""
    rng = random.Random(seed)
    clock = _Clock()
    settings = EngineSettings(rank=0, num_clients=1, seed=seed, prefix_caching=args.cached > 0,
                              latency=LatencyModel(profile=read_profile(profile_path)), **LIMITS)  # fmt: skip
    engine = EngineCore(settings, clock=clock)
    sizes = StepSizes()
    for size in history:
        sizes.add(size)
    engine.scheduler.step_sizes = sizes
    prefix = [rng.randrange(1000) for _ in range(args.cached)]
    pending = [(0.0005 * i, f"r{i}") for i in range(args.clients)]
    issued = args.clients
    added: Dict[str, float] = {}
    scheduled: Dict[str, float] = {}
    first: Dict[str, float] = {}
    due = None
    while pending or engine.has_work:
        pending.sort()
        if pending and (due is None or pending[0][0] <= due):
            t, rid = pending.pop(0)
            clock.now = max(clock.now, t)
            ids = prefix + [rng.randrange(1000) for _ in range(args.prompt_len - args.cached)]
            engine.apply(EngineCoreRequest(rid, args.prompt_len, args.max_tokens, True, prompt_token_ids=ids, ignore_eos=True))
            added[rid] = clock.now
            due = clock.now if due is None else due
            continue
        clock.now = max(clock.now, due)
        started = clock.now
        for client, message in engine.step():
            record = output_record(clock.now, 0, client, [msgpack.packb(message, use_bin_type=True)])
            for item in record.get("requests") or ():
                rid = item["id"]
                for kind, at in item.get("events") or ():
                    if kind == SCHEDULED:
                        scheduled.setdefault(rid, at)
                first.setdefault(rid, clock.now)
                if item.get("finish_reason") is not None and issued < args.requests:
                    pending.append((clock.now + rng.choice(gaps), f"r{issued}"))
                    issued += 1
        due = engine.next_step_time(started) if engine.has_work else None
    return {
        "ttft": [(first[r] - added[r]) * 1000.0 for r in first],
        "wait": [(scheduled[r] - added[r]) * 1000.0 for r in first if r in scheduled],
        "step": [(first[r] - scheduled[r]) * 1000.0 for r in first if r in scheduled],
    }


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", action="append", required=True, help="latency profile (repeat to compare several)")
    parser.add_argument("--real", required=True, help="a trace of the real engine on this workload (record tap)")
    parser.add_argument("--prompt-len", type=int, required=True)
    parser.add_argument("--cached", type=int, default=0, help="prompt tokens every request shares (prefix-cache hits)")
    parser.add_argument("--max-tokens", type=int, required=True)
    parser.add_argument("--clients", type=int, required=True)
    parser.add_argument("--requests", type=int, required=True, help="requests per run")
    parser.add_argument("--seeds", type=int, default=5, help="runs, each with its own seed")
    args = parser.parse_args(argv)
    real_ttft, gaps = real_figures(args.real, args.prompt_len)
    if not real_ttft or not gaps:
        print(f"{args.real}: no requests of prompt length {args.prompt_len} with a frontend delay", file=sys.stderr)
        return 2

    def row(name: str, values: Sequence[float], extra: str = "") -> str:
        return f"{name:40s} {quantile(values, 0.5):7.1f} {quantile(values, 0.9):7.1f} {quantile(values, 0.99):7.1f}{extra}"

    history = sizes_before(args.real, args.prompt_len)
    print(f"frontend delay (finish -> next ADD) from {args.real}: p50 {1000 * quantile(gaps, 0.5):.1f} ms, {len(gaps)} samples; "
          f"the engine had run {len(set(history))} step sizes up to {max(history, default=0)} before")
    print(f"{'ADD -> first token, ms':40s} {'p50':>7s} {'p90':>7s} {'p99':>7s}")
    print(row("real engine (the trace)", real_ttft))
    for path in args.profile:
        found: Dict[str, List[float]] = {"ttft": [], "wait": [], "step": []}
        for seed in range(args.seeds):
            for key, values in run(path, gaps, history, args, seed).items():
                found[key].extend(values)
        extra = (f"   (to its first step p50/p90 {quantile(found['wait'], 0.5):.1f}/{quantile(found['wait'], 0.9):.1f},"
                 f" in it {quantile(found['step'], 0.5):.1f}/{quantile(found['step'], 0.9):.1f})")  # fmt: skip
        print(row(f"mock engine, {path}", found["ttft"], extra))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
