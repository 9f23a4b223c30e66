"""Per-request scenarios through the real frontends: `vllm_xargs` keys arrive
as SamplingParams.extra_args and decide how a request ends (both frontends
pass them on)."""

from __future__ import annotations

import pytest

import e2e_harness as h
from test_frontends import COMPLETIONS, DP1_TOPOLOGIES, completion_body, metric_total

pytestmark = [pytest.mark.e2e, pytest.mark.parametrize("stack", DP1_TOPOLOGIES, indirect=True, ids=lambda t: t.id)]

#: Requests also end by EOS: uniform 3-6 tokens, unless ignore_eos; prompts are cached.
ENGINE_ARGS = ["--itl-ms", "1", "--output-len-dist", "uniform:3:6", "--prefix-caching"]


def complete(stack, **body):
    r = stack.post(COMPLETIONS, completion_body(stream=False, **body))
    return r


def test_eos_length_model_gives_stop_and_ignore_eos_gives_length(stack):
    r = complete(stack, max_tokens=40)
    assert r.status_code == 200, r.text[:300]
    choice, usage = r.json()["choices"][0], r.json()["usage"]
    assert choice["finish_reason"] == "stop" and 3 <= usage["completion_tokens"] <= 6, r.json()
    r = complete(stack, max_tokens=40, ignore_eos=True)
    assert r.json()["choices"][0]["finish_reason"] == "length" and r.json()["usage"]["completion_tokens"] == 40


def test_xargs_output_len_and_stop_token(stack):
    r = complete(stack, max_tokens=40, ignore_eos=True, vllm_xargs={"mock_output_len": 9})
    assert r.json()["choices"][0]["finish_reason"] == "stop" and r.json()["usage"]["completion_tokens"] == 9, r.text
    r = complete(stack, max_tokens=40, vllm_xargs={"mock_output_len": 2, "mock_stop_token_id": 77})
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == 77, r.text


def test_xargs_fail_after_is_an_error_for_the_client(stack):
    r = complete(stack, max_tokens=40, vllm_xargs={"mock_fail_after": 2})
    # an ERROR finish mid-stream: both frontends answer 500
    assert r.status_code == 500, r.text[:300]
    # the engine goes on serving
    r = complete(stack, max_tokens=40, ignore_eos=True)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 40


def test_xargs_ttft_holds_the_first_token(stack):
    import time

    ttft_sum = "vllm:time_to_first_token_seconds_sum"
    before = metric_total(stack.metrics(), ttft_sum)
    started = time.monotonic()
    r = complete(stack, max_tokens=3, ignore_eos=True, vllm_xargs={"mock_ttft_ms": 400})
    elapsed = time.monotonic() - started
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text[:300]
    assert elapsed >= 0.4  # a lower bound only: the first token cannot come sooner
    # the frontend's own TTFT histogram saw it too
    h.wait_until(lambda: metric_total(stack.metrics(), ttft_sum) - before >= 0.4, 15, "TTFT >= 0.4 s in /metrics", interval=0.5)


def test_a_repeated_prompt_hits_the_prefix_cache(stack):
    def total(name):
        return metric_total(stack.metrics(), name)

    hits0, queries0 = total("vllm:prefix_cache_hits_total"), total("vllm:prefix_cache_queries_total")
    prompt = " ".join(f"word{i}" for i in range(120))
    prompt_tokens = []
    for _ in range(2):
        r = complete(stack, max_tokens=2, ignore_eos=True, prompt=prompt)
        assert r.status_code == 200, r.text[:300]
        prompt_tokens.append(r.json()["usage"]["prompt_tokens"])
    seen = {}

    def counted() -> bool:
        seen["hits"] = total("vllm:prefix_cache_hits_total") - hits0
        seen["queries"] = total("vllm:prefix_cache_queries_total") - queries0
        return seen["queries"] >= sum(prompt_tokens) and seen["hits"] > 0

    h.wait_until(counted, 15, "the frontend to count prefix-cache queries and hits", interval=0.5)
    # the second request found the full 16-token blocks of the first, short of
    # its last token (vLLM computes at least one: a 496-token prompt hits 480)
    assert seen["hits"] == ((prompt_tokens[1] - 1) // 16) * 16, seen
