"""The scheduler seen through a real frontend's /metrics (its batch limit and queue).

gmock_engine runs with --max-num-seqs 64 and paced steps; 300 concurrent
streams must show, at the peak, exactly 64 running and 236 waiting in the
frontend's own gauges (from the engine's SchedulerStats), then all finish.
DP 1 only: with several engines the split over ranks is the balancer's.

The first 64 streams hold the batch open until the other 236 are seen
waiting, then go away (client disconnect: the frontend aborts them). So the
peak does not depend on how fast the host gets 300 requests through the
frontend: with 300 equal streams of 3 s, a slow CI host had the first wave
finish before the last ones arrived, and the peak was lower than 236.
"""

from __future__ import annotations

import http.client
import json
import threading
import time

import pytest

import e2e_harness as h
from test_frontends import COMPLETIONS, DP1_TOPOLOGIES, check_stream, completion_body, metric_total

#: run.sh arguments for this module's stacks (see conftest.stack).
ENGINE_ARGS = ["--max-num-seqs", "64", "--itl-ms", "20"]
LIMIT = 64
CONCURRENT = 300
MAX_TOKENS = 150  # the 236 waiting ones: 3 s per wave of 64 at 20 ms per step
HOLD_TOKENS = 6000  # the holders: 120 s at 20 ms per step, until they are closed
PEAK_WAIT_S = 60.0

pytestmark = [pytest.mark.e2e, pytest.mark.parametrize("stack", DP1_TOPOLOGIES, indirect=True, ids=lambda t: t.id)]


def _hold(stack: h.Stack, i: int, release: threading.Event, errors: list) -> None:
    """One stream that reads its tokens until `release`, then goes away mid-stream."""
    data = json.dumps(completion_body(HOLD_TOKENS, stream=True, prompt=f"holder {i}")).encode()
    conn = http.client.HTTPConnection("127.0.0.1", stack.http_port, timeout=30)
    try:
        conn.request("POST", COMPLETIONS, body=data, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise AssertionError(f"HTTP {resp.status}: {resp.read(300)!r}")
        while not release.is_set():
            if not resp.readline():
                raise AssertionError("the stream ended before it was released")
    except BaseException as exc:  # noqa: BLE001 - reported by the test
        errors.append(f"holder {i}: {type(exc).__name__}: {exc}")
    finally:
        h.hard_close(conn)


def _stream(stack: h.Stack, i: int, errors: list) -> None:
    try:
        check_stream(stack, COMPLETIONS, completion_body(MAX_TOKENS, stream=True, prompt=f"stream {i}"), MAX_TOKENS)
    except BaseException as exc:  # noqa: BLE001 - reported by the test
        errors.append(f"stream {i}: {exc}")


def _gauges(stack: h.Stack) -> tuple:
    text = stack.metrics()
    return metric_total(text, "vllm:num_requests_running"), metric_total(text, "vllm:num_requests_waiting")


def test_max_num_seqs_gives_running_and_waiting_gauges(stack):
    seen: list = []
    errors: list = []
    release = threading.Event()

    def sample_until(done, what: str) -> None:
        deadline = time.monotonic() + PEAK_WAIT_S
        while time.monotonic() < deadline:
            seen.append(_gauges(stack))
            if done(seen[-1]) or errors:
                return
            time.sleep(0.1)
        raise AssertionError(f"{what} not seen in {PEAK_WAIT_S:.0f} s; last samples {seen[-10:]}")

    holders = [threading.Thread(target=_hold, args=(stack, i, release, errors), daemon=True) for i in range(LIMIT)]
    streams = [threading.Thread(target=_stream, args=(stack, i, errors), daemon=True)
               for i in range(CONCURRENT - LIMIT)]
    try:
        for t in holders:
            t.start()
        sample_until(lambda rw: rw[0] == LIMIT, f"{LIMIT} running")
        for t in streams:
            t.start()
        sample_until(lambda rw: rw[1] == CONCURRENT - LIMIT, f"{CONCURRENT - LIMIT} waiting")
        assert not errors, errors[:5]
    finally:
        release.set()
    deadline = time.monotonic() + 120
    while any(t.is_alive() for t in streams) and time.monotonic() < deadline:
        seen.append(_gauges(stack))
        time.sleep(0.1)
    for t in holders + streams:
        t.join(timeout=max(0.1, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in streams), "streams still running after 120 s"
    assert not errors, errors[:5]
    assert max(r for r, _ in seen) == LIMIT, f"running went past the limit: {sorted(set(seen))[-10:]}"
    peak = max(seen, key=lambda rw: (rw[1], rw[0]))
    assert peak == (LIMIT, CONCURRENT - LIMIT), f"peak (running, waiting) {peak}; samples {seen[:20]}"
    h.wait_until(
        lambda: _gauges(stack) == (0, 0),
        30,
        "running and waiting gauges back to 0",
        interval=0.5,
    )
