"""The scheduler seen through a real frontend's /metrics (issue 5's headline).

gmock_engine runs with --max-num-seqs 64 and paced steps; 300 concurrent
streams must show, at the peak, exactly 64 running and 236 waiting in the
frontend's own gauges (from the engine's SchedulerStats), then all finish.
DP 1 only: with several engines the split over ranks is the balancer's.
"""

from __future__ import annotations

import pytest

import e2e_harness as h
from test_frontends import DP1_TOPOLOGIES, metric_total, streams_while_sampling

#: run.sh arguments for this module's stacks (see conftest.stack).
ENGINE_ARGS = ["--max-num-seqs", "64", "--itl-ms", "20"]
CONCURRENT = 300
MAX_TOKENS = 150  # 3 s per wave of 64 at 20 ms per step: all 300 arrive within the first wave

pytestmark = [pytest.mark.e2e, pytest.mark.parametrize("stack", DP1_TOPOLOGIES, indirect=True, ids=lambda t: t.id)]


def test_max_num_seqs_gives_running_and_waiting_gauges(stack):
    seen = []
    streams_while_sampling(
        stack,
        CONCURRENT,
        MAX_TOKENS,
        lambda text: seen.append(
            (metric_total(text, "vllm:num_requests_running"), metric_total(text, "vllm:num_requests_waiting"))
        ),
    )
    assert max(r for r, _ in seen) == 64, f"running never reached the limit or went past it: {sorted(set(seen))[-10:]}"
    peak = max(seen, key=lambda rw: (rw[1], rw[0]))
    assert peak == (64.0, 236.0), f"peak (running, waiting) {peak}; samples {seen[:20]}"
    h.wait_until(
        lambda: metric_total(stack.metrics(), "vllm:num_requests_running") == 0
        and metric_total(stack.metrics(), "vllm:num_requests_waiting") == 0,
        30,
        "running and waiting gauges back to 0",
        interval=0.5,
    )
