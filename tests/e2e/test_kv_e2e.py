"""KV blocks and preemption seen through the real frontends.

gmock_engine runs with a tiny KV cache (--num-gpu-blocks 48 of 16 tokens =
768 tokens): 16 concurrent streams of 120 tokens cannot all fit, so the
engine preempts the newest requests and recomputes them later. Every stream
must still finish with exactly its tokens, and the frontend must count the
preemptions (from the PREEMPTED events) and show the KV usage climbing.
"""

from __future__ import annotations

import threading
import time

import pytest

import e2e_harness as h
from test_frontends import COMPLETIONS, check_stream, completion_body

ENGINE_ARGS = ["--num-gpu-blocks", "48", "--block-size", "16", "--itl-ms", "5"]
CONCURRENT = 16
MAX_TOKENS = 120

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.parametrize(
        "stack", [h.Topology("python", dp=1, api_servers=1), h.Topology("rust", dp=1)], indirect=True, ids=lambda t: t.id
    ),
]


def _sum(text: str, name: str) -> float:
    return sum(v for _, v in h.metric_samples(text, name))


def test_preemption_when_the_kv_cache_runs_out(stack):
    before = _sum(stack.metrics(), "vllm:num_preemptions_total")
    errors: list = []

    def one(i: int) -> None:
        try:
            check_stream(stack, COMPLETIONS, completion_body(MAX_TOKENS, stream=True, prompt=f"kv {i}"), MAX_TOKENS)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(f"request {i}: {exc}")

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(CONCURRENT)]
    for t in threads:
        t.start()
    usage_seen = 0.0
    deadline = time.monotonic() + 120
    while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
        usage_seen = max(usage_seen, _sum(stack.metrics(), "vllm:kv_cache_usage_perc"))
        time.sleep(0.1)
    for t in threads:
        t.join(timeout=max(0.1, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), "streams still running after 120 s"
    assert not errors, errors[:5]
    assert usage_seen > 0.8, f"KV usage peaked at {usage_seen}"
    preemptions = 0.0

    def counted() -> bool:
        nonlocal preemptions
        preemptions = _sum(stack.metrics(), "vllm:num_preemptions_total") - before
        return preemptions > 0

    h.wait_until(counted, 15, "the frontend to count preemptions", interval=0.5)
    engine_log = stack.engine_log_since(0)
    assert engine_log.count("mock request preempted") >= preemptions > 0
