"""Per-request scenarios through the real frontends: `vllm_xargs` keys arrive
as SamplingParams.extra_args and decide how a request ends (both frontends
pass them on)."""

from __future__ import annotations

import pytest

import e2e_harness as h
from test_frontends import COMPLETIONS, completion_body

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.parametrize(
        "stack", [h.Topology("python", dp=1, api_servers=1), h.Topology("rust", dp=1)], indirect=True, ids=lambda t: t.id
    ),
]

#: Requests also end by EOS: uniform 3-6 tokens, unless ignore_eos.
ENGINE_ARGS = ["--itl-ms", "1", "--output-len-dist", "uniform:3:6"]


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
