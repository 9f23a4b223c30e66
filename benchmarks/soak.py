"""Soak runner: a real frontend + gmock_engine under steady load for a long time.

    ./run.sh soak --duration 1h [--frontend python|rust] [--dp 1] [--rate 20]
                  [--abort-share 0.1] [--sample-interval 10] [--engine-arg=--itl-ms=10]

Starts the frontend and the engine with the e2e harness (tests/e2e, which
installs the frontends on first use), drives a bounded steady load of
streaming completions (random lengths; a share of them closed by the client
mid-stream, which must reach the engine as ABORTs), and every
`--sample-interval` seconds prints the engine's RSS and open file
descriptors, its request ledger (from its own metrics endpoint) and the
request outcomes. The verdict at the end:

* ledger violations: 0, no request left active once the load stopped, and
  every client disconnect seen by the engine as an abort: engine aborts ==
  client disconnects (with faults that can move that count, within a bound:
  see `abort_check`);
* failed requests (wrong token count, HTTP error, broken stream): 0;
* RSS growth after warm-up (--warmup, default the first fifth of the run):
  <= 1 % (--rss-growth-limit).

With faults injected (`--engine-arg=--fault-error-mid-stream=rate=0.01`,
docs/faults.md) the books still have to balance (0 violations);
failed requests may then number up to the request faults that fail a
request (error-mid-stream, drop-finish), read from the engine's own
`gmock_faults_injected_total`. Engine faults (crash, hang) end a soak with
FAIL: the engine never goes idle again, which is what they are for.

Exit status 0 when all hold, 1 otherwise. Traffic stays on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "e2e"))

import e2e_harness as h  # noqa: E402
import requests  # noqa: E402

from gmock_engine.utils.stats import summarize  # noqa: E402
from gmock_engine.tools import report  # noqa: E402
from gmock_engine.tools.procfs import process_tree, tree_rss_bytes  # noqa: E402


def duration(text: str) -> float:
    """90, 90s, 15m, 1h, 1h30m -> seconds."""
    match = re.fullmatch(r"(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s?)?", text.strip())
    if not match or not any(match.groups()):
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration like 90s, 15m or 1h")
    hours, minutes, seconds = (int(g or 0) for g in match.groups())
    return hours * 3600 + minutes * 60 + seconds


class Load:
    """Bounded steady load: `rate` requests/s from a pool of worker threads."""

    def __init__(self, stack: h.Stack, rate: float, abort_share: float, workers: int, seed: int) -> None:
        self.stack = stack
        self.rate = rate
        self.abort_share = abort_share
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.outcomes: Dict[str, int] = {"ok": 0, "aborted_by_client": 0, "failed": 0}
        self.failures: List[str] = []
        self.stop = threading.Event()
        self.tickets = threading.Semaphore(0)
        #: client-side latencies since the last take_latencies(), seconds: time
        #: to the first data chunk, and per completed request its mean gap
        #: between chunks (inter-token latency)
        self.ttft: List[float] = []
        self.itl: List[float] = []
        self.threads = [threading.Thread(target=self._worker, daemon=True) for _ in range(workers)]

    def start(self) -> None:
        for t in self.threads:
            t.start()
        threading.Thread(target=self._pacer, daemon=True).start()

    def _pacer(self) -> None:
        interval, due = 1.0 / self.rate, time.monotonic()
        while not self.stop.is_set():
            due += interval
            self.tickets.release()
            time.sleep(max(0.0, due - time.monotonic()))

    def _worker(self) -> None:
        while not self.stop.is_set():
            if not self.tickets.acquire(timeout=0.5):
                continue
            with self.lock:
                max_tokens = self.rng.randint(8, 128)
                abort_after = self.rng.randint(1, 4) if self.rng.random() < self.abort_share else None
            self._one(max_tokens, abort_after)

    def _one(self, max_tokens: int, abort_after) -> None:
        body = {"model": h.MODEL_NAME, "prompt": "soak", "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
                "stream_options": {"include_usage": True}}  # fmt: skip
        sent = time.monotonic()
        try:
            with requests.post(self.stack.url("/v1/completions"), json=body, timeout=(5, 60), stream=True) as r:
                if r.status_code != 200:
                    raise RuntimeError(f"HTTP {r.status_code}: {r.text[:200]}")
                if abort_after is not None:
                    for i, _ in enumerate(h.sse_data(r)):
                        if i == 0:
                            self._first_chunk(time.monotonic() - sent)
                        if i + 1 >= abort_after:
                            break
                    outcome = "aborted_by_client"  # closing the response aborts the request
                else:
                    chunks, done = _timed_read(r, sent, self)
                    usage = chunks[-1].get("usage") if chunks else None
                    if not done or not usage or usage["completion_tokens"] != max_tokens:
                        raise RuntimeError(f"stream ended badly: done={done} usage={usage}")
                    outcome = "ok"
        except Exception as exc:  # noqa: BLE001 - every failure is counted and shown
            outcome = "failed"
            with self.lock:
                if len(self.failures) < 20:
                    self.failures.append(str(exc)[:300])
        with self.lock:
            self.outcomes[outcome] += 1

    def _first_chunk(self, seconds: float) -> None:
        with self.lock:
            self.ttft.append(seconds)

    def take_latencies(self) -> Dict[str, Optional[float]]:
        """TTFT and ITL p50/p99 in ms over the requests since the last call."""
        with self.lock:
            ttft, itl, self.ttft, self.itl = self.ttft, self.itl, [], []
        out: Dict[str, Optional[float]] = {}
        for name, values in (("ttft", ttft), ("itl", itl)):
            summary = summarize(values, scale=1e3) if values else None
            out[f"{name}_p50_ms"] = round(summary["p50"], 3) if summary else None
            out[f"{name}_p99_ms"] = round(summary["p99"], 3) if summary else None
        return out

    def finish(self, timeout: float = 90) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=timeout)


def _timed_read(resp, sent: float, load: Load):
    """h.read_stream, also timing the chunks: the first one is the TTFT, the
    mean gap between token chunks the request's ITL (to load.ttft / load.itl)."""
    chunks, done, times = [], False, []
    for data in h.sse_data(resp):
        if done:
            raise AssertionError(f"data after [DONE]: {data[:200]}")
        if data == "[DONE]":
            done = True
            continue
        chunk = json.loads(data)
        chunks.append(chunk)
        if chunk.get("choices"):
            times.append(time.monotonic())
            if len(times) == 1:
                load._first_chunk(times[0] - sent)
    if len(times) > 1:
        with load.lock:
            load.itl.append((times[-1] - times[0]) / (len(times) - 1))
    return chunks, done


def engine_lateness_us(metrics_port: int) -> Dict[str, float]:
    """Step lateness p50/p99 in µs (recent steps, worst engine) from gmock's /metrics."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    out: Dict[str, float] = {}
    for line in text.splitlines():
        match = re.match(r'^gmock_step_lateness_seconds\{[^}]*quantile="([\d.]+)"[^}]*\} (\S+)$', line)
        if match:
            key = {"0.5": "late_p50_us", "0.99": "late_p99_us"}.get(match.group(1))
            if key:
                out[key] = max(out.get(key, 0.0), round(float(match.group(2)) * 1e6, 1))
    return out


def engine_books(metrics_port: int) -> Dict[str, float]:
    """Ledger totals over all ranks from gmock's own /metrics."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    books: Dict[str, float] = {}
    for line in text.splitlines():
        match = re.match(r"^(gmock_[a-z_]+?)(?:_total)?(?:\{([^}]*)\})? (\S+)$", line)
        if not match:
            continue
        name, labels, value = match.groups()
        label = re.search(r'(?:reason|kind)="([\w-]+)"', labels or "")
        if label:
            name += "_" + label.group(1).replace("-", "_")
        books[name] = books.get(name, 0.0) + float(value)
    return books


#: Request faults that can move engine aborts away from client disconnects,
#: each firing by at most one: an ERROR end half-way can beat the client's
#: close to the engine (error-mid-stream); a last output held back or never
#: sent leaves a client waiting for a request the engine has already ended
#: (late-finish, drop-finish), so its close is no abort.
REQUEST_FAULTS_MOVING_ABORTS = ("error_mid_stream", "late_finish", "drop_finish")
#: Engine faults that can move it by any number: outputs stalled while the
#: engine goes on stepping end many requests before their clients see them;
#: a stall or hang past the clients' read timeout turns waiting clients into
#: failed ones, whose requests the engine still aborts; a crashed engine never
#: goes idle. (duplicate-finish, slow-steps and fail-utility move nothing: every
#: close still reaches a request the engine is still running.)
ENGINE_FAULTS_MOVING_ABORTS = ("stall_outputs", "hang", "crash")
#: Request faults that fail a request on purpose (docs/faults.md).
FAILING_FAULTS = ("error_mid_stream", "drop_finish")


def abort_check(disconnects: int, aborts: float, failed: int, faults: Mapping[str, float]) -> Optional[str]:
    """Whether the engine saw the clients' disconnects as aborts: None if so,
    else what is wrong. `faults`: firings per kind (gmock_faults_injected_total,
    kinds with underscores).

    No fault that can move the count: aborts == disconnects, exactly. Request
    faults: they differ by at most the number of those firings. Engine faults:
    only bounds: some aborts when clients disconnected, and no more aborts than
    clients that closed a stream (disconnects + failed).
    """
    if any(faults.get(kind, 0) > 0 for kind in ENGINE_FAULTS_MOVING_ABORTS):
        if disconnects > 0 and aborts <= 0:
            return f"{disconnects} client disconnects but no engine aborts"
        if aborts > disconnects + failed:
            return f"{aborts:g} engine aborts > {disconnects} client disconnects + {failed} failed requests"
        return None
    slack = sum(faults.get(kind, 0) for kind in REQUEST_FAULTS_MOVING_ABORTS)
    if abs(aborts - disconnects) > slack:
        allowed = f" (± {slack:g} for the request faults injected)" if slack else ""
        return f"{aborts:g} engine aborts != {disconnects} client disconnects{allowed}"
    return None


def judge(
    outcomes: Mapping[str, int],
    books: Mapping[str, float],
    samples: Sequence[Mapping[str, float]],
    warmup: float,
    rss_growth_limit: float,
    failures: Sequence[str] = (),
) -> Dict[str, object]:
    """The verdict, pure: the load's outcomes, the engine's books (engine_books)
    once idle, and the samples (t, rss_mb). "verdict" is PASS or FAIL, and
    "problems" says what failed."""
    after = [x for x in samples if x["t"] >= warmup] or list(samples)
    warm = after[0]["rss_mb"] if after else 0
    last = samples[-1]["rss_mb"] if samples else 0
    growth = 100.0 * (last - warm) / warm if warm else 0.0
    faults = {k[len("gmock_faults_injected_"):]: v for k, v in books.items() if k.startswith("gmock_faults_injected_")}
    failing_faults = int(sum(faults.get(kind, 0) for kind in FAILING_FAULTS))
    verdict: Dict[str, object] = {
        "requests": dict(outcomes),
        "ledger_started": books.get("gmock_requests_started", 0),
        "ledger_violations": books.get("gmock_ledger_violations", 0),
        "ledger_aborted": books.get("gmock_requests_finished_abort", 0),
        "rss_warm_mb": warm,
        "rss_end_mb": last,
        "rss_growth_pct": round(growth, 2),
        "faults_injected": faults,
        "failures": list(failures),
    }
    problems = []
    if verdict["ledger_violations"] != 0:
        problems.append(f"{verdict['ledger_violations']:g} ledger violations")
    if outcomes.get("failed", 0) > failing_faults:
        problems.append(f"{outcomes.get('failed', 0)} failed requests > {failing_faults} injected faults that fail one")
    if growth > rss_growth_limit:
        problems.append(f"RSS grew {growth:.2f} % after warm-up > {rss_growth_limit:g} %")
    if outcomes.get("ok", 0) <= 0:
        problems.append("no request completed")
    # the clients' disconnects reached the engine as ABORTs
    aborts = abort_check(outcomes.get("aborted_by_client", 0), verdict["ledger_aborted"], outcomes.get("failed", 0), faults)
    if aborts is not None:
        problems.append(aborts)
    verdict["problems"] = problems
    verdict["verdict"] = "FAIL" if problems else "PASS"
    return verdict


def main() -> int:
    parser = argparse.ArgumentParser(prog="run.sh soak", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=duration, default=duration("5m"), help="how long the load runs (90s, 15m, 1h)")
    parser.add_argument("--frontend", choices=("python", "rust"), default="python")
    parser.add_argument("--dp", type=int, default=1, help="engines (DP size)")
    parser.add_argument("--api-servers", type=int, default=1, help="Python frontend API servers")
    parser.add_argument("--rate", type=float, default=20.0, help="requests per second")
    parser.add_argument("--workers", type=int, default=32, help="concurrent client threads (bounds the load)")
    parser.add_argument("--abort-share", type=float, default=0.1, help="share of requests the client closes mid-stream")
    parser.add_argument("--sample-interval", type=float, default=10.0, help="seconds between samples")
    parser.add_argument("--rss-growth-limit", type=float, default=1.0, help="max RSS growth after warm-up, %%")
    parser.add_argument("--warmup", type=duration, default=None, help="warm-up before RSS growth counts (default: a fifth of the run)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--engine-arg", action="append", default=[], help="extra gmock_engine flag (repeatable)")
    parser.add_argument("--json", help="write the samples and the verdict to this file")
    parser.add_argument("--report", metavar="FILE.html", help="also write a self-contained HTML report with charts (needs the `report` extra: matplotlib)")
    options = parser.parse_args()
    if options.report and report.missing():
        parser.error(report.missing())

    frontends = h.install_frontends()
    work = Path(tempfile.mkdtemp(prefix="gmock-soak-"))
    model_dir = h.make_model_dir(work / "model")
    metrics_port = h.free_ports(1)[0]
    engine_args = ["--itl-ms", "5", "--metrics-port", str(metrics_port), "--no-log-requests", "--summary-interval", "0"]
    stack = h.Stack(h.Topology(options.frontend, options.dp, options.api_servers), frontends, model_dir, work,
                    engine_args=engine_args + options.engine_arg)  # fmt: skip
    stack.start()
    print(f"soak: {options.frontend} frontend, DP {options.dp}, {options.rate:g} req/s, {options.abort_share:.0%} aborted, "
          f"{options.duration:.0f} s; logs in {work}", flush=True)  # fmt: skip
    load = Load(stack, options.rate, options.abort_share, options.workers, options.seed)
    samples: List[Dict[str, float]] = []
    verdict: Dict[str, object] = {}
    try:
        pids = process_tree(stack.engine.popen.pid)
        started = time.monotonic()
        load.start()
        while time.monotonic() - started < options.duration:
            time.sleep(min(options.sample_interval, max(0.0, options.duration - (time.monotonic() - started))))
            books = engine_books(metrics_port)
            sample = {
                "t": round(time.monotonic() - started, 1),
                "rss_mb": round(tree_rss_bytes(pids) / 2**20, 2),
                "fds": sum(len(os.listdir(f"/proc/{p}/fd")) for p in pids if os.path.exists(f"/proc/{p}/fd")),
                "started": books.get("gmock_requests_started", 0),
                "running": books.get("gmock_requests_running", 0),
                "violations": books.get("gmock_ledger_violations", 0),
                **{k: v for k, v in load.outcomes.items()},
                **{k[len("gmock_faults_injected_"):]: v for k, v in books.items() if k.startswith("gmock_faults_injected_")},
                # for --report (and --json): engine tokens and finish reasons, latencies
                "output_tokens": books.get("gmock_output_tokens", 0),
                **{k[len("gmock_requests_"):]: v for k, v in books.items() if k.startswith("gmock_requests_finished_")},
                **engine_lateness_us(metrics_port),
                **load.take_latencies(),
            }
            samples.append(sample)
            print("soak: " + " ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in sample.items() if v is not None), flush=True)
        load.finish()
        h.wait_until(lambda: engine_books(metrics_port).get("gmock_requests_running", 1) == 0
                     and engine_books(metrics_port).get("gmock_requests_waiting", 1) == 0, 60, "the engine to go idle")  # fmt: skip
        books = engine_books(metrics_port)
        warmup = options.warmup if options.warmup is not None else options.duration / 5
        verdict = judge(load.outcomes, books, samples, warmup, options.rss_growth_limit, load.failures)
    finally:
        load.stop.set()
        problems = stack.stop()
        if problems:
            print(f"soak: teardown: {problems}", file=sys.stderr)
    print("soak verdict: " + json.dumps(verdict), flush=True)
    if options.json:
        Path(options.json).write_text(json.dumps({"samples": samples, "verdict": verdict}, indent=1))
    if options.report:
        meta = {k: v for k, v in vars(options).items() if k not in ("report", "json")}
        warmup = options.warmup if options.warmup is not None else options.duration / 5
        report.soak_report(options.report, samples, verdict, meta, warmup)
        print(f"soak report: {options.report}", flush=True)
    return 0 if verdict.get("verdict") == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
