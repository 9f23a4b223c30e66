"""KV blocks and preemption seen through the real frontends.

gmock_engine runs with a tiny KV cache (--num-gpu-blocks 48 of 16 tokens =
768 tokens): 16 concurrent streams of 120 tokens cannot all fit, so the
engine preempts the newest requests and recomputes them later. Every stream
must still finish with exactly its tokens, and the frontend must count the
preemptions (from the PREEMPTED events) and show the KV usage climbing.
"""

from __future__ import annotations

import pytest

import e2e_harness as h
from test_frontends import DP1_TOPOLOGIES, metric_total, streams_while_sampling

ENGINE_ARGS = ["--num-gpu-blocks", "48", "--block-size", "16", "--itl-ms", "5"]
CONCURRENT = 16
MAX_TOKENS = 120

pytestmark = [pytest.mark.e2e, pytest.mark.parametrize("stack", DP1_TOPOLOGIES, indirect=True, ids=lambda t: t.id)]


def test_preemption_when_the_kv_cache_runs_out(stack):
    before = metric_total(stack.metrics(), "vllm:num_preemptions_total")
    usage = [0.0]
    streams_while_sampling(
        stack, CONCURRENT, MAX_TOKENS, lambda text: usage.append(metric_total(text, "vllm:kv_cache_usage_perc"))
    )
    assert max(usage) > 0.8, f"KV usage peaked at {max(usage)}"
    preemptions = 0.0

    def counted() -> bool:
        nonlocal preemptions
        preemptions = metric_total(stack.metrics(), "vllm:num_preemptions_total") - before
        return preemptions > 0

    h.wait_until(counted, 15, "the frontend to count preemptions", interval=0.5)
    assert stack.engine_log_since(0).count("mock request preempted") >= preemptions > 0
