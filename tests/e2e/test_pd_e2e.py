"""Prefill/decode disaggregation through the real frontends and a P/D proxy.

Per frontend kind: a prefill stack (frontend + gmock_engine as KV producer,
configured by vLLM's `--kv-transfer-config` JSON) and a decode stack
(frontend + gmock_engine as KV consumer, `--kv-role consumer`, 20 ms of KV
transfer per prompt token), with pd_proxy.PDProxy in front doing vLLM's
two-step dance. Neither frontend gets any P/D flag: both pass a body's
`kv_transfer_params` into SamplingParams.extra_args and return an output's
`kv_transfer_params` in the (non-streaming) response.

The client is the `openai` package, talking to the proxy only.
"""

from __future__ import annotations

import json
import re
import threading
import time

import openai
import pytest

import e2e_harness as h
from pd_proxy import PREFILL_KV_TRANSFER_PARAMS, PDProxy

TRANSFER_MS_PER_TOKEN = 20.0
PRODUCER_ARGS = ["--prefix-caching",
                 "--kv-transfer-config", json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_producer", "engine_id": "prefill-e2e"})]
CONSUMER_ARGS = ["--kv-role", "consumer", "--kv-transfer-ms-per-token", str(TRANSFER_MS_PER_TOKEN), "--itl-ms", "2"]
MESSAGES = [{"role": "user", "content": "Tell me about disaggregated prefill and decode, in detail."}]
RE_KV_LOG = re.compile(r"mock request kv_transfer engine=\d+ request_id=(\S+) role=(\w+) kv_transfer_params=(.*)$", re.M)

pytestmark = pytest.mark.e2e


class DecodeStack(h.Stack):
    """A decode stack whose frontend reports cached prompt tokens
    (`--enable-prompt-tokens-details`, the same flag in both frontends)."""

    def frontend_argv(self) -> list:
        return [*super().frontend_argv(), "--enable-prompt-tokens-details"]


class PD:
    """A prefill stack, a decode stack and the proxy in front of them."""

    def __init__(self, kind: str, prefill: h.Stack, decode: h.Stack, proxy: PDProxy) -> None:
        self.kind, self.prefill, self.decode, self.proxy = kind, prefill, decode, proxy
        self.client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module", params=["python", "rust"])
def pd(request, frontends, model_dir, tmp_path_factory):
    kind = request.param
    topology = h.Topology(kind, dp=1)
    prefill = h.Stack(topology, frontends, model_dir, tmp_path_factory.mktemp(f"pd-{kind}-prefill"), engine_args=PRODUCER_ARGS)
    decode = DecodeStack(topology, frontends, model_dir, tmp_path_factory.mktemp(f"pd-{kind}-decode"), engine_args=CONSUMER_ARGS)
    try:
        prefill.start()
        decode.start()
        with PDProxy(prefill.base_url, decode.base_url) as proxy:
            yield PD(kind, prefill, decode, proxy)
    finally:
        problems = decode.stop() + prefill.stop()
    assert not problems, problems


def kv_log(stack: h.Stack) -> list:
    """(request id, role, kv_transfer_params) of each P/D request its engine logged."""
    text = stack.engine_log_since(0)
    return [(rid, role, json.loads(params)) for rid, role, params in RE_KV_LOG.findall(text)]


def stream_chat(client: openai.OpenAI, max_tokens: int, **extra):
    """A streaming chat through the proxy: (content chunks, finish reasons,
    usage, seconds to the first content, error or None)."""
    t0 = time.monotonic()
    first, contents, finishes, usage = None, [], [], None
    try:
        stream = client.chat.completions.create(
            model=h.MODEL_NAME, messages=MESSAGES, max_tokens=max_tokens, stream=True,
            stream_options={"include_usage": True}, **extra,
        )
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                if choice.delta.content:
                    contents.append(choice.delta.content)
                    first = first if first is not None else time.monotonic() - t0
                if choice.finish_reason:
                    finishes.append(choice.finish_reason)
    except (openai.APIError, ValueError) as exc:  # an error event in the stream, or a failed HTTP status
        return contents, finishes, usage, first, exc
    return contents, finishes, usage, first, None


def test_streaming_chat_through_the_proxy_gets_exact_counts_and_the_params_pass_unchanged(pd):
    n_before = len(pd.proxy.exchanges)
    results = [None] * 4

    def one(i):
        results[i] = stream_chat(pd.client, 12 + i)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(results))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    for i, (contents, finishes, usage, first, error) in enumerate(results):
        assert error is None, error
        assert finishes == ["length"] and usage is not None and usage.completion_tokens == 12 + i, (finishes, usage)
        assert contents
        # TTFT on the decode side is at least the transfer time (a lower bound only: the machine is shared)
        assert first >= usage.prompt_tokens * TRANSFER_MS_PER_TOKEN / 1000.0, (first, usage.prompt_tokens)
    exchanges = pd.proxy.exchanges[n_before:]
    assert len(exchanges) == 4 and all(e["prefill_status"] == 200 and e["decode_status"] == 200 for e in exchanges)
    # the prefill engine got the proxy's do_remote_decode params, and answered with what NIXL returns
    producer = [params for _, role, params in kv_log(pd.prefill) if role == "producer"]
    assert producer[-4:] == [PREFILL_KV_TRANSFER_PARAMS] * 4
    decode_side = {params["remote_request_id"]: params for _, role, params in kv_log(pd.decode) if role == "consumer"}
    for e in exchanges:
        params = e["kv_transfer_params"]
        assert params["do_remote_prefill"] is True and params["remote_engine_id"] == "prefill-e2e"
        assert params["remote_block_ids"] and params["remote_host"] and params["remote_port"]
        # ... and the decode engine got exactly the params the prefill side returned, through both frontends
        assert decode_side[params["remote_request_id"]] == params


def test_completions_and_the_prefill_side_cache_hits_reported_by_the_decode_side(pd):
    """/v1/completions, not streamed; the second time the prompt's first block
    is in the prefill engine's prefix cache: its `remote_prefill_cached_tokens`
    reach the decode side, whose frontend reports them as the request's cached
    tokens (vLLM: scheduler.py sets them on P, output_processor.py reads them on D)."""
    prompt = "A prompt long enough for one full KV block of sixteen tokens, and then some more words."
    first = pd.client.completions.create(model=h.MODEL_NAME, prompt=prompt, max_tokens=7)
    again = pd.client.completions.create(model=h.MODEL_NAME, prompt=prompt, max_tokens=7)
    for response in (first, again):
        assert response.usage.completion_tokens == 7 and response.choices[0].finish_reason == "length"
    cached = pd.proxy.exchanges[-1]["kv_transfer_params"]["remote_prefill_cached_tokens"]
    assert pd.proxy.exchanges[-2]["kv_transfer_params"]["remote_prefill_cached_tokens"] == 0
    assert cached >= 16, cached
    details = again.usage.prompt_tokens_details
    assert details is not None and details.cached_tokens == cached, again.usage


def test_the_decode_frontend_counts_the_transfer_in_its_ttft(pd):
    def ttft():
        text = pd.decode.metrics()
        return (sum(v for _, v in h.metric_samples(text, "vllm:time_to_first_token_seconds_sum")),
                sum(v for _, v in h.metric_samples(text, "vllm:time_to_first_token_seconds_count")))

    (sum0, n0) = ttft()
    contents, finishes, usage, first, error = stream_chat(pd.client, 3)
    assert error is None and usage.completion_tokens == 3
    floor = usage.prompt_tokens * TRANSFER_MS_PER_TOKEN / 1000.0
    seen = {}

    def counted():
        seen["v"] = ttft()
        return seen["v"][1] > n0

    h.wait_until(counted, 10, "the decode frontend to count the request's TTFT", interval=0.5)
    (sum1, n1) = seen["v"]
    assert n1 - n0 == 1 and sum1 - sum0 >= floor, (sum1 - sum0, floor)


def test_a_failed_kv_load_ends_the_request_with_an_error_and_the_decode_side_serves_on(pd):
    # vllm_xargs mock_kv_load: the scenario --fault-kv-transfer-fail sets (the fault spec itself: below)
    contents, finishes, usage, first, error = stream_chat(pd.client, 10, extra_body={"vllm_xargs": {"mock_kv_load": "fail"}})
    assert "length" not in finishes and not contents, (finishes, contents)
    assert error is not None or finishes == ["error"], (finishes, usage)
    log = pd.decode.engine_log_since(0)
    assert "finish_reason=error" in log
    contents, finishes, usage, first, error = stream_chat(pd.client, 4)
    assert error is None and finishes == ["length"] and usage.completion_tokens == 4


def test_fault_specs_slow_and_failing_transfers(pd, frontends, model_dir, tmp_path_factory):
    """--fault-kv-transfer-slow (every transfer 1 s longer) and
    --fault-kv-transfer-fail every=2 on a second decode stack (Rust only:
    it starts in a second; the Python frontend sees the same engine outputs)."""
    if pd.kind != "rust":
        pytest.skip("one frontend is enough for the fault specs (the engine side is the same)")
    args = [*CONSUMER_ARGS, "--fault-kv-transfer-slow", "every=1 delay=1s", "--fault-kv-transfer-fail", "every=2"]
    decode = h.Stack(h.Topology("rust", dp=1), frontends, model_dir, tmp_path_factory.mktemp("pd-rust-faults"), engine_args=args)
    try:
        decode.start()
        with PDProxy(pd.prefill.base_url, decode.base_url) as proxy:
            client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="none", max_retries=0, timeout=120)
            contents, finishes, usage, first, error = stream_chat(client, 5)  # occasion 1: slow only
            assert error is None and finishes == ["length"] and usage.completion_tokens == 5
            assert first >= 1.0 + usage.prompt_tokens * TRANSFER_MS_PER_TOKEN / 1000.0, first
            contents, finishes, usage, first, error = stream_chat(client, 5)  # occasion 2: slow and failed
            assert not contents and "length" not in finishes and (error is not None or finishes == ["error"])
        log = decode.engine_log_since(0)
        assert log.count("injected fault kv-transfer-slow") == 2 and log.count("injected fault kv-transfer-fail") == 1
        assert "finish_reason=error" in log
    finally:
        problems = decode.stop()
    assert not problems, problems


def test_dp2_pairs_name_each_prefill_rank(pd, frontends, model_dir, tmp_path_factory):
    """DP 2 on both sides (Rust only, for its start-up time): each prefill
    rank answers with its own engine id (`<engine_id>_dp<rank>`, as vLLM
    names them) and side-channel port (+ rank); every stream is exact. The
    prefill engines take 300 ms per request so that concurrent ones are in
    flight together and the frontend spreads them over both ranks."""
    if pd.kind != "rust":
        pytest.skip("one frontend is enough for DP 2 (the engine side is the same)")
    topology = h.Topology("rust", dp=2)
    prefill = h.Stack(topology, frontends, model_dir, tmp_path_factory.mktemp("pd-rust-dp2-p"),
                      engine_args=[*PRODUCER_ARGS, "--ttft-ms", "300"])
    decode = h.Stack(topology, frontends, model_dir, tmp_path_factory.mktemp("pd-rust-dp2-d"), engine_args=CONSUMER_ARGS)
    try:
        prefill.start()
        decode.start()
        with PDProxy(prefill.base_url, decode.base_url) as proxy:
            client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="none", max_retries=0, timeout=120)
            results = [None] * 6

            def one(i):
                results[i] = stream_chat(client, 4 + i)

            threads = [threading.Thread(target=one, args=(i,)) for i in range(len(results))]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            for i, (contents, finishes, usage, first, error) in enumerate(results):
                assert error is None and finishes == ["length"] and usage.completion_tokens == 4 + i, (error, finishes, usage)
            seen = {(e["kv_transfer_params"]["remote_engine_id"], e["kv_transfer_params"]["remote_port"]) for e in proxy.exchanges}
        assert seen == {("prefill-e2e_dp0", 5600), ("prefill-e2e_dp1", 5601)}, seen
        consumed = [params for _, role, params in kv_log(decode) if role == "consumer"]
        assert len(consumed) == 6
    finally:
        problems = decode.stop() + prefill.stop()
    assert not problems, problems
