"""One engine host's link down while streams run, then up: what the client,
the frontend and the engines see (docs/operations.md, "Engines on several
hosts", the link-fault table).

A frontend host and two engine hosts (multihost.py, netns.py): 16 streams
run on all four ranks; after 2 s host 3's link (ranks 2..3) goes down for
the outage, new requests are sent meanwhile and /health is polled; then the
link comes up, every stream is waited for, 8 fresh streams must be exact,
and each engine process's books (SIGUSR1: the ledger's counters) must show
every request started once and ended once, with no ledger violation.

    python3 tests/e2e/link_faults.py [--frontend python|rust] [--outages 2,10,60]

prints the table (run as root; takes ~1 min per outage plus the 60 s one's).
test_multihost_e2e.py runs the short outages and checks the same results.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))

import e2e_harness as h  # noqa: E402
import multihost  # noqa: E402
import netns  # noqa: E402

COMPLETIONS = "/v1/completions"
PROMPT = "The quick brown fox jumps over the lazy dog"
#: Paced so that a stream spans the outage: ITL 10 ms.
ITL_MS = 10
ENGINE_ARGS = ["--itl-ms", str(ITL_MS)]
STREAMS = 16
DURING = 4
FRESH = 8
#: The host whose link goes down (ranks 2..3), and the other engine host.
CUT_HOST, OTHER_HOST = 3, 2
#: How long after the link is up every stream must have ended.
AFTER_UP_S = 240.0
#: Streams still open this long after the link is up are far past the
#: outage's pause: the sockets of every host are read then, so that a
#: failure says where the outputs wait (an engine's send queue, the
#: frontend's receive queue, or the frontend's HTTP socket to the client).
STUCK_AFTER_UP_S = 30.0

RE_SUMMARY = re.compile(r"engine (\d+) summary: (.*)")
RE_FINISHED = re.compile(r"mock request finished engine=(\d+) request_id=(\S+)")


def topology(kind: str) -> h.Topology:
    """DP 4: ranks 0..1 on host 2, 2..3 on host 3 (the Python frontend with 2 API servers)."""
    return h.Topology(kind, dp=4, api_servers=2, engine_processes=h.rank_slices(4, 2), label="2hosts")


@dataclass
class Stream:
    """One streaming completion as the client saw it."""

    max_tokens: int
    status: Optional[int] = None
    tokens: Optional[int] = None
    finish: Optional[str] = None
    done: bool = False
    error: Optional[str] = None
    #: monotonic times: sent, first and last data, and the longest silence (start, length)
    sent: float = 0.0
    last: float = 0.0
    gap: tuple = (0.0, 0.0)
    #: every silence of a second or more, (start, length)
    silences: List[tuple] = field(default_factory=list)

    @property
    def exact(self) -> bool:
        return self.status == 200 and self.done and self.tokens == self.max_tokens and self.finish == "length"

    def describe(self) -> str:
        if self.exact:
            return "exact"
        return f"HTTP {self.status} tokens {self.tokens}/{self.max_tokens} finish {self.finish} done {self.done} {self.error or ''}"


def run_stream(stack: h.Stack, s: Stream, read_timeout: float) -> None:
    """POST one streaming completion; fill `s` (never raises)."""
    body = {"model": h.MODEL_NAME, "prompt": PROMPT, "max_tokens": s.max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}
    s.sent = s.last = time.monotonic()
    try:
        with requests.post(stack.url(COMPLETIONS), json=body, timeout=(10, read_timeout), stream=True) as r:
            s.status = r.status_code
            if r.status_code != 200:
                s.error = r.text[:200]
                return
            for data in h.sse_data(r):
                now = time.monotonic()
                if now - s.last > s.gap[1]:
                    s.gap = (s.last, now - s.last)
                if now - s.last >= 1.0:
                    s.silences.append((s.last, now - s.last))
                s.last = now
                if data == "[DONE]":
                    s.done = True
                    continue
                chunk = json.loads(data)
                for choice in chunk.get("choices") or []:
                    if choice.get("finish_reason"):
                        s.finish = choice["finish_reason"]
                if chunk.get("usage"):
                    s.tokens = chunk["usage"]["completion_tokens"]
    except Exception as exc:  # noqa: BLE001 - the outcome is what is recorded
        s.error = f"{type(exc).__name__}: {str(exc)[:160]}"


def books(stack: h.Stack) -> Dict[int, Dict[str, int]]:
    """Every engine's ledger counters, by rank: SIGUSR1 to each engine process, then its summary lines."""
    offsets = stack.engine_log_offsets()
    for g in stack.engines:
        os.kill(g.popen.pid, signal.SIGUSR1)
    out: Dict[int, Dict[str, int]] = {}

    def logged() -> bool:
        text = stack.engine_logs_since(offsets)
        for m in RE_SUMMARY.finditer(text):
            out[int(m.group(1))] = {k: int(v) for k, v in (kv.split("=") for kv in m.group(2).split()) if v.isdigit()}
        return len(out) == stack.topology.dp

    h.wait_until(logged, 20, "every engine's summary line after SIGUSR1")
    return out


@dataclass
class Outage:
    """What one outage did, as measured."""

    frontend: str
    seconds: float
    silent: bool = False
    streams: List[Stream] = field(default_factory=list)
    during: List[Stream] = field(default_factory=list)
    fresh: List[Stream] = field(default_factory=list)
    health_during: collections.Counter = field(default_factory=collections.Counter)
    health_after: Optional[int] = None
    alive_after: Dict[str, bool] = field(default_factory=dict)
    books: Dict[int, Dict[str, int]] = field(default_factory=dict)
    finished_ids: collections.Counter = field(default_factory=collections.Counter)
    engine_lines: List[str] = field(default_factory=list)
    #: the engines' log lines written during the outage and after it
    engine_log: str = ""
    #: `ss` of every host, and the logs' tails, taken if streams were still
    #: open STUCK_AFTER_UP_S after the link came back ("" if none were)
    stuck_report: str = ""
    t_down: float = 0.0
    t_up: float = 0.0

    def stalled(self) -> List[Stream]:
        """Streams with a silence of at least half the outage (those on the cut host's ranks)."""
        return [s for s in self.streams if s.gap[1] >= max(1.0, self.seconds / 2)]

    def paused_while_down(self) -> List[Stream]:
        """Streams silent for at least half the outage while the link was down: those
        on the cut host's ranks. A silence that begins once the link is back is the
        frontend's recovery (the burst of what waited), not an engine that stopped."""
        def overlap(start: float, length: float) -> float:
            return min(start + length, self.t_up) - max(start, self.t_down)

        return [s for s in self.streams if any(overlap(*gap) >= max(1.0, self.seconds / 2) for gap in s.silences)]

    def problems(self) -> List[str]:
        """What breaks the engine's books or a client's stream (empty: all right)."""
        out = []
        for name, group in (("stream", self.streams), ("stream sent during the outage", self.during),
                            ("fresh stream", self.fresh)):
            out += [f"{name} {i}: {s.describe()}" for i, s in enumerate(group) if not s.exact]
        for rank, b in sorted(self.books.items()):
            ended = sum(v for k, v in b.items() if k.startswith("finished_"))
            if b.get("violations", 0) or b.get("active", 0) or b.get("started", 0) != ended:
                out.append(f"engine {rank} books: {b}")
        twice = [rid for rid, n in self.finished_ids.items() if n > 1]
        if twice:
            out.append(f"finished twice in the engine logs: {twice[:5]}")
        out += [f"{name} not running after the outage" for name, alive in self.alive_after.items() if not alive]
        if out and self.stuck_report:
            out.append(self.stuck_report)
        return out

    def row(self) -> List[str]:
        """frontend, outage, client, frontend, engine: the docs table's cells."""
        stalled = self.stalled()
        resumed = [s.gap[0] + s.gap[1] - self.t_up for s in stalled]
        client = (f"{len(stalled)}/{len(self.streams)} streams paused, "
                  + (f"resumed {min(resumed):.1f}-{max(resumed):.1f} s after the link came back; " if resumed else "")
                  + f"{sum(s.exact for s in self.streams)}/{len(self.streams)} exact; "
                  f"{sum(s.exact for s in self.during)}/{len(self.during)} streams sent meanwhile exact, "
                  f"{sum(s.last > self.t_up for s in self.during)} of them ending after the link came back")
        health = ", ".join(f"{code if code else 'no answer'} x{n}" for code, n in sorted(self.health_during.items(),
                                                                                        key=lambda kv: str(kv[0])))
        frontend = (f"/health during: {health}; after: {self.health_after}; "
                    f"{sum(s.exact for s in self.fresh)}/{len(self.fresh)} fresh streams exact")
        started = sum(b.get("started", 0) for b in self.books.values())
        ended = sum(v for b in self.books.values() for k, v in b.items() if k.startswith("finished_"))
        violations = sum(b.get("violations", 0) for b in self.books.values())
        engine = f"books: {started} started, {ended} ended, {violations} violations"
        if self.engine_lines:
            engine += "; logged: " + " / ".join(sorted(set(self.engine_lines))[:3])
        cut = "silent" if self.silent else "carrier"
        return [self.frontend, f"{self.seconds:g} s, {cut}", client, frontend, engine]


def _engine_lines(text: str) -> List[str]:
    """The engines' warnings and errors, without timestamps and ranks (for the table)."""
    lines = []
    for line in text.splitlines():
        m = re.match(r"^\S+ \S+ (WARNING|ERROR)\s+\S+\s+(.*)$", line)
        if m:
            lines.append(re.sub(r"\d+(\.\d+)?", "N", m.group(2))[:120])
    return lines


def stuck_report(stack: multihost.MultiHostStack, open_streams: int) -> str:
    """Every host's TCP sockets (`ss -tnmi`: send and receive queues, the
    retransmission state) and the processes' last log lines."""
    parts = [f"{open_streams} streams still open {STUCK_AFTER_UP_S:g} s after the link came back"]
    for i in (1, 2, 3):
        try:
            run = subprocess.run(stack.hosts.run(i, ["ss", "-tnmi"]), capture_output=True, text=True, timeout=10)
            lines = [" ".join(line.split()) for line in (run.stdout or run.stderr).splitlines()]
            parts.append(f"----- ss -tnmi in host {i}\n" + "\n".join(lines[:120]))
        except (OSError, subprocess.SubprocessError) as exc:
            parts.append(f"----- ss -tnmi in host {i}: {exc}")
    parts.append(stack.logs_report(30))
    return "\n".join(parts)


def outage(stack: multihost.MultiHostStack, seconds: float, silent: bool = False) -> Outage:
    """Streams on every rank, host 3's link down for `seconds` (netns.Hosts.link_down:
    carrier lost, or `silent`), then up; see the module doc."""
    hosts = stack.hosts
    result = Outage(stack.topology.frontend, seconds, silent)
    before = books(stack)
    offsets = stack.engine_log_offsets()
    run_s = seconds + 6.0
    read_timeout = seconds + AFTER_UP_S
    result.streams = [Stream(int(run_s * 1000 / ITL_MS) + i) for i in range(STREAMS)]
    threads = [threading.Thread(target=run_stream, args=(stack, s, read_timeout), daemon=True) for s in result.streams]
    for t in threads:
        t.start()
    time.sleep(2.0)
    hosts.link_down(CUT_HOST, silent)
    result.t_down = time.monotonic()
    try:
        result.during = [Stream(20 + i) for i in range(DURING)]
        for s in result.during:
            t = threading.Thread(target=run_stream, args=(stack, s, read_timeout), daemon=True)
            t.start()
            threads.append(t)
        while time.monotonic() - result.t_down < seconds:
            result.health_during[h.http_status(stack.url("/health"), timeout=1.0)] += 1
            time.sleep(max(0.0, min(1.0, seconds - (time.monotonic() - result.t_down))))
    finally:
        hosts.link_up(CUT_HOST, silent)
    result.t_up = time.monotonic()
    for t in threads:
        t.join(timeout=max(0.0, result.t_up + STUCK_AFTER_UP_S - time.monotonic()))
    if any(t.is_alive() for t in threads):
        result.stuck_report = stuck_report(stack, sum(t.is_alive() for t in threads))
    for t in threads:
        t.join(timeout=max(1.0, result.t_up + read_timeout + 15 - time.monotonic()))
    result.health_after = h.http_status(stack.url("/health"), timeout=5.0)
    result.fresh = [Stream(16 + i) for i in range(FRESH)]
    fresh_threads = [threading.Thread(target=run_stream, args=(stack, s, 60.0), daemon=True) for s in result.fresh]
    for t in fresh_threads:
        t.start()
    for t in fresh_threads:
        t.join(timeout=90)
    result.alive_after = {g.name: g.alive() for g in (stack.frontend, *stack.engines)}
    if all(g.alive() for g in stack.engines):
        # This outage's requests only: the counters since the summary before it.
        result.books = {rank: {k: v - before.get(rank, {}).get(k, 0) for k, v in b.items()}
                        for rank, b in books(stack).items()}
    text = stack.engine_logs_since(offsets)
    result.finished_ids = collections.Counter(m.group(2) for m in RE_FINISHED.finditer(text))
    result.engine_lines = _engine_lines(text)
    result.engine_log = text
    return result


def table(rows: List[List[str]]) -> str:
    head = ["frontend", "link down, how", "client (16 streams on 4 ranks)", "frontend",
            "engines"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frontend", choices=["python", "rust"], action="append")
    parser.add_argument("--outages", default="2,10,60", help="seconds, comma-separated (default %(default)s)")
    parser.add_argument("--cuts", default="carrier,silent",
                        help="how the link is cut (netns.Hosts.link_down), comma-separated (default %(default)s)")
    args = parser.parse_args(argv)
    why = netns.unavailable()
    if why:
        print(f"cannot run: {why}", file=sys.stderr)
        return 2
    fe = h.install_frontends()
    tmp = Path(tempfile.mkdtemp(prefix="gmock-link-faults-"))
    md = h.make_model_dir(tmp / "model")
    rows, status = [], 0
    for kind in args.frontend or ["python", "rust"]:
        with netns.Hosts(3) as hosts:
            stack = multihost.MultiHostStack(topology(kind), fe, md, tmp / kind, hosts, engine_args=ENGINE_ARGS)
            try:
                stack.start()
                for cut, seconds in ((c, float(s)) for c in args.cuts.split(",") for s in args.outages.split(",")):
                    result = outage(stack, seconds, silent=cut == "silent")
                    rows.append(result.row())
                    print(table(rows[-1:]), flush=True)
                    for problem in result.problems():
                        status = 1
                        print(f"  problem: {problem}", flush=True)
            finally:
                stack.stop()
    print(table(rows))
    print(f"logs: {tmp}")
    return status


if __name__ == "__main__":
    sys.exit(main())
