"""The scheduler seen through a real frontend's /metrics (issue 5's headline).

gmock_engine runs with --max-num-seqs 64 and paced steps; 300 concurrent
streams must show, at the peak, exactly 64 running and 236 waiting in the
frontend's own gauges (from the engine's SchedulerStats), then all finish.
DP 1 only: with several engines the split over ranks is the balancer's.
"""

from __future__ import annotations

import threading
import time

import pytest

import e2e_harness as h
from test_frontends import COMPLETIONS, check_stream, completion_body

#: run.sh arguments for this module's stacks (see conftest.stack).
ENGINE_ARGS = ["--max-num-seqs", "64", "--itl-ms", "20"]
CONCURRENT = 300
MAX_TOKENS = 150  # 3 s per wave of 64 at 20 ms per step: all 300 arrive within the first wave

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.parametrize(
        "stack", [h.Topology("python", dp=1, api_servers=1), h.Topology("rust", dp=1)], indirect=True, ids=lambda t: t.id
    ),
]


def _gauge(text: str, name: str) -> float:
    return sum(v for _, v in h.metric_samples(text, name))


def test_max_num_seqs_gives_running_and_waiting_gauges(stack):
    errors: list = []

    def one(i: int) -> None:
        try:
            check_stream(stack, COMPLETIONS, completion_body(MAX_TOKENS, stream=True, prompt=f"request {i}"), MAX_TOKENS)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(f"request {i}: {exc}")

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(CONCURRENT)]
    for t in threads:
        t.start()
    peak = (0.0, 0.0)
    seen = []
    deadline = time.monotonic() + 120
    while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
        text = stack.metrics()
        sample = (_gauge(text, "vllm:num_requests_running"), _gauge(text, "vllm:num_requests_waiting"))
        seen.append(sample)
        if sample[1] > peak[1] or (sample[1] == peak[1] and sample[0] > peak[0]):
            peak = sample
        time.sleep(0.2)
    for t in threads:
        t.join(timeout=max(0.1, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), "requests still running after 120 s"
    assert not errors, errors[:5]
    assert max(r for r, _ in seen) == 64, f"running never reached the limit or went past it: {sorted(set(seen))[-10:]}"
    assert peak == (64.0, 236.0), f"peak (running, waiting) {peak}; samples {seen[:20]}"
    h.wait_until(
        lambda: _gauge(stack.metrics(), "vllm:num_requests_running") == 0
        and _gauge(stack.metrics(), "vllm:num_requests_waiting") == 0,
        30,
        "running and waiting gauges back to 0",
        interval=0.5,
    )
