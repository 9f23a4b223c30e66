"""`gmock-engine bench`: an engine-core load driver that plays the frontend.

The driver owns the handshake, input and output sockets (as `vllm serve`
would), starts the engine under test as a subprocess, keeps `--concurrency`
requests in flight per engine for `--duration` seconds (each finished one is
replaced at once) or sends `--rate` requests per second, and prints one
summary per target:

* output tokens/s and requests/s over the measured window;
* CPU µs per output token of the engine's processes (utime + stime from
  /proc, summed over the process tree; not wall time);
* ADD -> first output latency p50/p99, seen by the driver;
* step lateness p50/p99 (from the engine's own `gmock_stats`, with --itl-ms;
  the paced reference emitter answers it too);
* idle CPU % of the engine in a window with no requests;
* the driver's own CPU per token, so a driver bottleneck shows.

Targets: `gmock` (this package) and `reference`, the pyzmq + msgpack floor
of benchmarks/reference_emitter.py (the same wire messages at the least a
Python loop spends; in a source checkout only), run under the same load in the same run; gmock's CPU per token
and TTFT are reported as ratios to it.

It sends what the frontends send: full 22-element EngineCoreRequests and
ABORT / UTILITY frames from tools/frontend.py (the tests' fake frontend uses
the same encoder). This is a plain pyzmq program (no gevent): one thread,
one poll loop.
No vLLM is needed: it is also a newcomer's first look at the engine.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import msgpack
import zmq

from gmock_engine.utils.stats import summarize
from gmock_engine.runtime.steptimer import TimerFD
from gmock_engine.tools import report
from gmock_engine.tools.frontend import RequestTemplate, abort_frames, add_frames, identity, utility_frames
from gmock_engine.tools.procfs import process_tree, tree_cpu_seconds, tree_rss_bytes


# -- the frontend's side ----------------------------------------------------------


class DriverFrontend:
    """Binds the sockets a frontend binds and runs the handshake (§1-2)."""

    def __init__(self, engines: int, clients: int = 1) -> None:
        self.ctx = zmq.Context()
        self.engines = engines
        self.addresses: Dict[Any, str] = {}
        self.handshake = self._bind(zmq.ROUTER)
        self.inputs = [self._bind(zmq.ROUTER) for _ in range(clients)]
        self.outputs = [self._bind(zmq.PULL) for _ in range(clients)]
        self.pack = msgpack.Packer(use_bin_type=True).pack

    def _bind(self, kind: int) -> Any:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        port = sock.bind_to_random_port("tcp://127.0.0.1")
        self.addresses[sock] = f"tcp://127.0.0.1:{port}"
        return sock

    def accept(self, timeout: float, proc: subprocess.Popen) -> None:
        """HELLO/INIT/READY for every engine, then every registration."""
        init = self.pack(
            {
                "addresses": {
                    "inputs": [self.addresses[s] for s in self.inputs],
                    "outputs": [self.addresses[s] for s in self.outputs],
                    "coordinator_input": None,
                    "coordinator_output": None,
                    "frontend_stats_publish_address": None,
                },
                "parallel_config": {},
            }
        )
        deadline = time.monotonic() + timeout
        ready = 0
        while ready < self.engines:
            self._wait(self.handshake, deadline, proc, "the handshake")
            ident, payload = self.handshake.recv_multipart()
            status = msgpack.unpackb(payload)["status"]
            if status == "HELLO":
                self.handshake.send_multipart([ident, init])
            elif status == "READY":
                ready += 1
        for sock in self.inputs:
            for _ in range(self.engines):
                self._wait(sock, deadline, proc, "registrations")
                sock.recv_multipart()

    @staticmethod
    def _wait(sock: Any, deadline: float, proc: subprocess.Popen, what: str) -> None:
        while not sock.poll(100):
            if proc.poll() is not None:
                raise RuntimeError(f"engine exited with status {proc.returncode} during {what}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out waiting for {what}")

    def close(self) -> None:
        self.ctx.destroy(linger=0)


@dataclass
class Load:
    """What one measured window saw."""

    seconds: float = 0.0
    tokens: int = 0
    finished: int = 0
    ttft: List[float] = field(default_factory=list)
    engine_cpu: float = 0.0
    driver_cpu: float = 0.0
    peak_rss: int = 0
    #: (seconds since the window opened, output tokens so far), about once a
    #: second: taken in the poll loop, not per token (the report's time series)
    ticks: List[Tuple[float, int]] = field(default_factory=list)


#: Messages the driver reads from one output socket before it looks at the clock again.
RECV_SLICE = 256


class Driver:
    """Closed-loop (concurrency) or open-loop (rate) load over the sockets."""

    def __init__(self, frontend: DriverFrontend, args: argparse.Namespace, pids: List[int]) -> None:
        self.fe = frontend
        self.args = args
        self.pids = pids
        self.ids = itertools.count()
        self.inflight: Dict[str, int] = {}  # request id -> rank
        self.per_engine = [0] * frontend.engines
        self.sent_at: Dict[str, float] = {}
        self.clients = len(frontend.inputs)
        self.identities = [identity(rank) for rank in range(frontend.engines)]
        # One full EngineCoreRequest per client, copied per ADD (tools/frontend.py).
        sampling: Dict[str, Any] = {"temperature": 1.0, "max_tokens": args.max_tokens}
        if args.eos_token_id is not None:
            # as every request of vllm serve and vllm-rs names its model's EOS
            # (tests/data/frames.json): the engine must avoid it (and any stop id)
            sampling.update({"stop_token_ids": [], "_eos_token_id": args.eos_token_id, "_all_stop_token_ids": [args.eos_token_id]})
        prompt = list(range(args.prompt_len))
        self.templates = [RequestTemplate(prompt, sampling, client) for client in range(self.clients)]
        # --logprobs-share: that share of the requests asks for --logprobs alternatives per token
        with_logprobs = {**sampling, "logprobs": args.logprobs}
        self.logprob_templates = [RequestTemplate(prompt, with_logprobs, client) for client in range(self.clients)]
        self._logprob_credit = 0.0
        #: UtilityOutputs by call id, as run() sees them.
        self.replies: Dict[int, List[Any]] = {}

    def add(self, rank: int, now: float, measure: bool) -> None:
        rid = f"bench-{next(self.ids)}"
        client = rank % self.clients
        templates = self.templates
        if self.args.logprobs_share:
            self._logprob_credit += self.args.logprobs_share
            if self._logprob_credit >= 1.0:
                self._logprob_credit -= 1.0
                templates = self.logprob_templates
        request = templates[client].request(rid)
        self.fe.inputs[client].send_multipart([self.identities[rank], *add_frames(request, self.fe.pack)])
        self.inflight[rid] = rank
        self.per_engine[rank] += 1
        if measure:
            self.sent_at[rid] = now

    def run(self, seconds: float, measure: bool, keep_loading: bool = True) -> Load:
        """Drive load for `seconds`; with measure, count what happens."""
        args, fe = self.args, self.fe
        load = Load()
        poller = zmq.Poller()
        for sock in fe.outputs:
            poller.register(sock, zmq.POLLIN)
        unpack = msgpack.unpackb
        sent_at = self.sent_at
        concurrency = args.concurrency
        start = time.monotonic()
        cpu0, drv0 = tree_cpu_seconds(self.pids), time.process_time()
        end = start + seconds
        rate_gap = 1.0 / args.rate if args.rate else 0.0
        next_send = start
        # Open loop: a timerfd wakes the poll at each send time. A poll
        # timeout is whole milliseconds (pyzmq truncates it), so below 1 ms
        # gaps it was 0: the driver spun a whole core, and the engine under
        # test shared the other with its own I/O thread and the driver's
        # (TTFT then measures the OS scheduler's time slices, for gmock and
        # the floor alike).
        timer = TimerFD.create() if args.rate and keep_loading else None
        if timer is not None:
            poller.register(timer.fileno(), zmq.POLLIN)
        rr = itertools.cycle(range(fe.engines))
        if keep_loading and not args.rate:
            for rank in range(fe.engines):
                while self.per_engine[rank] < concurrency:
                    self.add(rank, start, measure)
        next_rss = start
        next_tick = start + 1.0
        while True:
            now = time.monotonic()
            if now >= end:
                break
            if args.rate and keep_loading:
                while next_send <= now:
                    self.add(next(rr), now, measure)
                    next_send += rate_gap
                if timer is not None:
                    timer.arm(next_send)  # (if refused: the timeout below, up to 1 ms late)
                timeout = max(0.0, min(next_send, end) - now) * 1000
            else:
                timeout = max(0.0, end - now) * 1000
            if measure:
                if now >= next_tick:
                    load.ticks.append((now - start, load.tokens))
                    next_tick += 1.0
                timeout = min(timeout, max(0.0, next_tick - now) * 1000)
            if measure and now >= next_rss:
                load.peak_rss = max(load.peak_rss, tree_rss_bytes(self.pids))
                next_rss = now + 0.5
            # rounded up: a truncated sub-millisecond timeout is 0, a spin
            for sock, _ in poller.poll(math.ceil(timeout)):
                if sock.__class__ is int:  # the send timer
                    timer.consume()
                    continue
                # a slice per socket and round: engines that make messages
                # faster than the driver reads them would keep it in this
                # loop past the window's end
                for _ in range(RECV_SLICE):
                    try:
                        frame = sock.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    message = unpack(frame, strict_map_key=False)
                    received = time.monotonic()
                    if len(message) > 4 and message[4] is not None:
                        self.replies[message[4][0]] = message[4]  # a UtilityOutput
                        continue
                    for output in message[1]:
                        load.tokens += len(output[1])
                        if sent_at:
                            sent = sent_at.pop(output[0], None)
                            if sent is not None:
                                load.ttft.append(received - sent)
                    if len(message) > 5 and message[5]:
                        for rid in message[5]:
                            rank = self.inflight.pop(rid, None)
                            if rank is None:
                                continue
                            load.finished += 1
                            self.per_engine[rank] -= 1
                            if keep_loading and not args.rate:
                                self.add(rank, received, measure)
        if timer is not None:
            poller.unregister(timer.fileno())
            timer.close()
        load.seconds = time.monotonic() - start
        if measure:
            load.ticks.append((load.seconds, load.tokens))
        load.engine_cpu = tree_cpu_seconds(self.pids) - cpu0
        load.driver_cpu = time.process_time() - drv0
        return load

    def drain(self, timeout: float = 30.0) -> None:
        """Abort everything in flight and read until each has ended."""
        by_rank: Dict[int, List[str]] = {}
        for rid, rank in self.inflight.items():
            by_rank.setdefault(rank, []).append(rid)
        for rank, rids in by_rank.items():
            # every request of a rank went to client rank % clients (see add)
            self.fe.inputs[rank % self.clients].send_multipart([self.identities[rank], *abort_frames(rids, self.fe.pack)])
        deadline = time.monotonic() + timeout
        while self.inflight and time.monotonic() < deadline:
            self.run(0.05, measure=False, keep_loading=False)
        self.sent_at.clear()
        if self.inflight:
            raise RuntimeError(f"{len(self.inflight)} requests still in flight {timeout} s after aborting them")

    def utility(self, rank: int, method: str, args: Sequence[Any] = (), timeout: float = 30.0) -> Any:
        """Call a utility method on one engine; the outputs that arrive
        meanwhile are accounted as usual (not dropped), without new load."""
        call_id = next(self.ids) + 1
        self.fe.inputs[0].send_multipart([self.identities[rank], *utility_frames(0, call_id, method, args, self.fe.pack)])
        deadline = time.monotonic() + timeout
        while call_id not in self.replies and time.monotonic() < deadline:
            self.run(0.002, measure=False, keep_loading=False)  # a reply takes ~1 ms: 256 engines' calls in < 1 s
        reply = self.replies.pop(call_id, None)
        if reply is None:
            raise RuntimeError(f"no answer to {method} from engine {rank}")
        return reply[2][1] if reply[2] else None


# -- one target ---------------------------------------------------------------------


#: --engine-arg flags the reference emitter takes as well, as `--flag` or
#: `--flag=value` (its features: prefix caching, KV events, pacing).
#: The floor (target `reference`): a script of the source checkout, not of the package.
REFERENCE_EMITTER = Path(__file__).resolve().parents[2] / "benchmarks" / "reference_emitter.py"
FLOOR_FLAGS = ("--prefix-caching", "--kv-events-config", "--num-gpu-blocks", "--block-size", "--itl-ms")


def floor_engine_args(engine_args: Sequence[str]) -> List[str]:
    """The gmock flags among `engine_args` that the reference emitter takes too."""
    return [a for a in engine_args if a.split("=", 1)[0] in FLOOR_FLAGS]


def engine_command(target: str, args: argparse.Namespace, handshake: str) -> List[str]:
    common = [
        "--handshake-address",
        handshake,
        "--engine-count",
        str(args.engines),
        "--output-token-chunk-size",
        str(args.chunk),
    ]
    if target == "reference":
        # the features the floor does too take gmock's flags of the same names
        floor_args = floor_engine_args(args.engine_arg)
        if args.itl_ms:
            floor_args += ["--itl-ms", str(args.itl_ms)]
        return [sys.executable, str(REFERENCE_EMITTER), *common, *floor_args]
    command = [sys.executable, "-m", "gmock_engine", *common, "--log-level", "WARNING"]
    if args.itl_ms:
        command += ["--itl-ms", str(args.itl_ms)]
    if args.processes > 1:
        command += ["--processes", str(args.processes)]
    return command + list(args.engine_arg)


def run_target(target: str, args: argparse.Namespace) -> Dict[str, Any]:
    """Start one engine process, load it, measure, stop it."""
    fe = DriverFrontend(args.engines, args.clients)
    env = {k: v for k, v in os.environ.items() if not k.startswith("GMOCK_")}
    started = time.monotonic()
    proc = subprocess.Popen(engine_command(target, args, fe.addresses[fe.handshake]), env=env, start_new_session=True)
    result: Dict[str, Any] = {"target": target}
    try:
        fe.accept(args.join_timeout, proc)
        result["join_s"] = time.monotonic() - started
        pids = process_tree(proc.pid)
        result["rss_idle_mb"] = tree_rss_bytes(pids) / 2**20
        driver = Driver(fe, args, pids)
        if args.warmup:
            driver.run(args.warmup, measure=False)
        # step lateness: gmock's, and paced the floor's (both answer gmock_stats)
        lateness_of = target == "gmock" or bool(args.itl_ms)
        if args.itl_ms:
            # step lateness over the measured window only: the warm-up's
            # steps (every first output at once) would set its p99
            for rank in range(args.engines):
                driver.utility(rank, "gmock_stats", (True,))
        rss_before = tree_rss_bytes(pids)
        load = driver.run(args.duration, measure=True)
        if lateness_of:
            stats = [driver.utility(rank, "gmock_stats") for rank in range(args.engines)]
            lateness = [s["step_lateness_us"] for s in stats]
            result["lateness_p50_us"] = max(x["p50"] for x in lateness)
            result["lateness_p99_us"] = max(x["p99"] for x in lateness)
        driver.drain()
        time.sleep(0.2)  # let the engine settle before the idle window
        idle0 = tree_cpu_seconds(pids)
        time.sleep(args.idle)
        idle_cpu = tree_cpu_seconds(pids) - idle0
        ttft = summarize(load.ttft, scale=1e3)
        result.update(
            {
                "seconds": load.seconds,
                "tokens_per_s": load.tokens / load.seconds,
                "requests_per_s": load.finished / load.seconds,
                "cpu_us_per_token": 1e6 * load.engine_cpu / max(load.tokens, 1),
                "engine_cpu_pct": 100 * load.engine_cpu / load.seconds,
                "driver_cpu_us_per_token": 1e6 * load.driver_cpu / max(load.tokens, 1),
                "driver_cpu_pct": 100 * load.driver_cpu / load.seconds,
                "ttft_p50_ms": ttft["p50"],
                "ttft_p99_ms": ttft["p99"],
                "ttft_count": ttft["count"],
                "idle_cpu_pct": 100 * idle_cpu / args.idle / max(1, len(pids)),
                "processes": len(pids),
                "rss_mb": load.peak_rss / 2**20,
                "rss_before_mb": rss_before / 2**20,
                # per request in flight, from the idle engine to the loaded one
                "rss_kb_per_request": (load.peak_rss / 2**20 - result["rss_idle_mb"])
                * 1024
                / max(1, args.concurrency * args.engines),
                "tokens": load.tokens,
                # [t, tokens/s over the second before t] through the window
                "tokens_per_s_series": tokens_series(load.ticks),
            }
        )
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        fe.close()
    return result


def tokens_series(ticks: List[Tuple[float, int]]) -> List[List[float]]:
    """Cumulative (t, tokens) ticks -> [t, tokens/s since the previous tick]."""
    series, last_t, last_n = [], 0.0, 0
    for t, n in ticks:
        if t - last_t > 1e-3:
            series.append([round(t, 3), (n - last_n) / (t - last_t)])
            last_t, last_n = t, n
    return series


# -- the command ---------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gmock-engine bench",
        description="Load gmock_engine (and the bare reference emitter) over real sockets, "
        "playing the frontend; print throughput, CPU per token, latency and idle CPU.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--engines", type=int, default=1, help="engines (DP ranks)")
    parser.add_argument("--clients", type=int, default=1, help="frontend clients (API servers)")
    parser.add_argument("--processes", type=int, default=1, help="gmock worker processes (--processes)")
    parser.add_argument("--chunk", type=int, default=1, help="--output-token-chunk-size")
    parser.add_argument("--concurrency", type=int, default=256, help="requests kept in flight per engine (closed loop)")
    parser.add_argument("--rate", type=float, default=0.0, help="open loop: requests per second over all engines (0: closed loop)")
    parser.add_argument("--max-tokens", type=int, default=256, help="max_tokens of every request")
    parser.add_argument("--prompt-len", type=int, default=16, help="prompt length in tokens")
    parser.add_argument("--logprobs", type=int, default=5, help="logprobs asked by the --logprobs-share of the requests")
    parser.add_argument("--logprobs-share", type=float, default=0.0, help="share of the requests that ask for logprobs (0..1)")
    parser.add_argument(
        "--eos-token-id", type=int, default=None,
        help="every ADD names this EOS id (_eos_token_id, _all_stop_token_ids), as the real frontends' do; default: none",
    )  # fmt: skip
    parser.add_argument("--itl-ms", type=float, default=0.0, help="gmock --itl-ms (fixed step interval); the reference emitter paces the same way")
    parser.add_argument("--duration", type=float, default=5.0, help="measured window, seconds")
    parser.add_argument("--warmup", type=float, default=1.0, help="unmeasured load before the window, seconds")
    parser.add_argument("--idle", type=float, default=2.0, help="idle window after the load, seconds")
    parser.add_argument("--join-timeout", type=float, default=30.0, help="handshake deadline, seconds")
    parser.add_argument(
        "--target", choices=("both", "gmock", "reference"), default="both", help="what to run (both: gmock, then reference)"
    )
    parser.add_argument("--engine-arg", action="append", default=[], help="extra gmock flag (repeatable), e.g. --engine-arg=--seed=3; the reference emitter takes "
                        "the ones it knows too (bench.FLOOR_FLAGS: --prefix-caching, --kv-events-config, --num-gpu-blocks, --block-size, --itl-ms)")
    parser.add_argument("--json", metavar="FILE", help="also append the results as one JSON line to FILE")
    parser.add_argument(
        "--report", metavar="FILE.html", help="also write a self-contained HTML report with charts (needs the `report` extra: matplotlib)"
    )
    return parser


COLUMNS = [
    ("target", "{:<9}"),
    ("tokens_per_s", "{:>11,.0f}"),
    ("requests_per_s", "{:>8,.0f}"),
    ("cpu_us_per_token", "{:>9.2f}"),
    ("engine_cpu_pct", "{:>6.0f}"),
    ("ttft_p50_ms", "{:>8.2f}"),
    ("ttft_p99_ms", "{:>8.2f}"),
    ("lateness_p50_us", "{:>8.0f}"),
    ("lateness_p99_us", "{:>8.0f}"),
    ("idle_cpu_pct", "{:>6.2f}"),
    ("driver_cpu_us_per_token", "{:>8.2f}"),
    ("rss_mb", "{:>7.1f}"),
    ("join_s", "{:>6.2f}"),
]
HEADERS = ["target", "tokens/s", "req/s", "cpu µs/tok", "cpu%", "ttft p50", "ttft p99", "late p50", "late p99", "idle%", "drv µs/tok", "rss MB", "join s"]


def format_table(results: List[Dict[str, Any]]) -> str:
    widths = [len(fmt.format(0 if key != "target" else "")) for key, fmt in COLUMNS]
    lines = [" ".join(h.rjust(w) if i else h.ljust(w) for i, (h, w) in enumerate(zip(HEADERS, widths)))]
    for result in results:
        cells = []
        for (key, fmt), width in zip(COLUMNS, widths):
            value = result.get(key)
            cells.append(fmt.format(value) if value is not None else "-".rjust(width))
        lines.append(" ".join(cells))
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    for name in ("engines", "clients", "processes", "chunk", "concurrency", "max_tokens"):
        if getattr(args, name) < 1:
            print(f"gmock-engine bench: error: --{name.replace('_', '-')} must be >= 1", file=sys.stderr)
            return 2
    if args.report:
        problem = report.missing()
        if problem:
            print(f"gmock-engine bench: error: {problem}", file=sys.stderr)
            return 2
    targets = ["gmock", "reference"] if args.target == "both" else [args.target]
    if "reference" in targets and not REFERENCE_EMITTER.is_file():
        print(
            f"gmock-engine bench: error: the reference emitter ({REFERENCE_EMITTER}) is not there: it is part of the "
            "source checkout (benchmarks/), not of the installed package; run from a checkout, or pass --target gmock",
            file=sys.stderr,
        )
        return 2
    mode = f"rate {args.rate:g}/s" if args.rate else f"concurrency {args.concurrency}/engine"
    print(
        f"gmock-engine bench: engines {args.engines}, processes {args.processes}, clients {args.clients}, "
        f"chunk {args.chunk}, {mode}, max_tokens {args.max_tokens}, itl {args.itl_ms:g} ms, "
        f"window {args.duration:g} s (+{args.warmup:g} s warm-up, {args.idle:g} s idle)",
        flush=True,
    )
    results = []
    for target in targets:
        results.append(run_target(target, args))
    print(format_table(results))
    by_target = {r["target"]: r for r in results}
    if "gmock" in by_target and "reference" in by_target:
        ratio = by_target["gmock"]["cpu_us_per_token"] / by_target["reference"]["cpu_us_per_token"]
        print(f"ratio gmock/reference CPU per token: {ratio:.2f}")
        by_target["gmock"]["ratio_vs_reference"] = ratio
        g, r = by_target["gmock"], by_target["reference"]
        if g["ttft_count"] and r["ttft_count"] and r["ttft_p50_ms"] > 0 and r["ttft_p99_ms"] > 0:
            print(f"ratio gmock/reference TTFT p50: {g['ttft_p50_ms'] / r['ttft_p50_ms']:.2f}, p99: {g['ttft_p99_ms'] / r['ttft_p99_ms']:.2f}")
    if args.json:
        with open(args.json, "a") as handle:
            handle.write(json.dumps({"args": vars(args), "results": results}) + "\n")
    if args.report:
        report.bench_report(args.report, results, vars(args))
        print(f"report: {args.report}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
