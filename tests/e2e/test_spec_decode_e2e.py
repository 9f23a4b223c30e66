"""Speculative decoding (`--spec-tokens 3 --spec-acceptance 0.8,0.6,0.4`)
through the real frontends (DP 1).

Concurrent streaming completions end with exactly their max_tokens; each
chunk's `usage.completion_tokens` (continuous_usage_stats) tells how many
tokens the engine's output for that step held (or, where the API server fell
behind and merged outputs, several steps'); the engine's mean tokens a step
must be 1 + the expected accepted drafts (Σ_i Π_{j≤i} rate_j = 1.472). The frontend's
`vllm:spec_decode_num_drafts_total`, `..._num_draft_tokens_total`,
`..._num_accepted_tokens_total` and `..._num_accepted_tokens_per_pos_total`
must equal the engine's own counts (its --metrics-port `gmock_spec_decode*`),
which count what it emitted. The Python frontend registers these counters
only with a speculative config: it gets an n-gram one (no draft model to
load) with the same K; vllm-rs exposes them without one.

A request's vllm_xargs `mock_spec_acceptance` (1.0, 0) gives it K + 1 tokens a
step, or one.

Text tokens (`--token-source text` with the model dir's tokenizer) so that
every output decodes to text and the frontends send a chunk for each.
"""

from __future__ import annotations

import json
import math
import threading

import pytest
import requests

import e2e_harness as h
from gmock_engine.tools.procgroup import free_ports
from test_frontends import COMPLETIONS, DP1_TOPOLOGIES, check_stream, completion_body, metric_total

RATES = (0.8, 0.6, 0.4)
EXPECTED_TOKENS_PER_STEP = 1 + 0.8 + 0.8 * 0.6 + 0.8 * 0.6 * 0.4
#: 8 x 700 tokens at about 2.47 a step: over 2 000 drafts, so each position's
#: acceptance is measured to about 1 % (one standard error)
STREAMS, MAX_TOKENS = 8, 700

pytestmark = [pytest.mark.e2e]


class SpecStack(h.Stack):
    """A stack whose Python frontend is configured for speculative decoding (n-gram, K = 3)."""

    def frontend_argv(self) -> list[str]:
        argv = super().frontend_argv()
        if self.topology.frontend == "python":
            config = {"method": "ngram", "num_speculative_tokens": len(RATES), "prompt_lookup_max": 3, "prompt_lookup_min": 2}
            argv += ["--speculative-config", json.dumps(config)]
        return argv


@pytest.fixture(scope="module", params=DP1_TOPOLOGIES, ids=lambda t: t.id)
def stack(request, frontends, model_dir, tmp_path_factory):
    """One spec-decoding stack per topology, with the engine's own /metrics."""
    (metrics_port,) = free_ports(1)
    args = [
        "--spec-tokens", str(len(RATES)), "--spec-acceptance", ",".join(map(str, RATES)),
        "--token-source", "text", "--tokenizer", str(model_dir), "--itl-ms", "10",
        "--metrics-port", str(metrics_port),
    ]  # fmt: skip
    s = SpecStack(request.param, frontends, model_dir, tmp_path_factory.mktemp(request.param.id), engine_args=args)
    s.engine_metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    s.start()
    try:
        yield s
    finally:
        problems = s.stop()
        if problems:
            pytest.fail(f"{request.param.id}: teardown problems: {problems}\n{s.logs_report()}", pytrace=False)


def _engine_counts(stack) -> dict:
    text = requests.get(stack.engine_metrics_url, timeout=10).text
    counts = {labels.split('counter="')[1].split('"')[0]: value for labels, value in h.metric_samples(text, "gmock_spec_decode_total")}
    per_pos = sorted(
        (int(labels.split('position="')[1].split('"')[0]), value)
        for labels, value in h.metric_samples(text, "gmock_spec_decode_num_accepted_tokens_per_pos_total")
    )
    counts["per_pos"] = [value for _, value in per_pos]
    return counts


def _frontend_counts(stack) -> dict:
    text = stack.metrics()
    counts = {
        name: metric_total(text, f"vllm:spec_decode_{name}_total")
        for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
    }
    per_pos = sorted(
        (int(labels.split('position="')[1].split('"')[0]), value)
        for labels, value in h.metric_samples(text, "vllm:spec_decode_num_accepted_tokens_per_pos_total")
    )
    counts["per_pos"] = [value for _, value in per_pos]
    return counts


def test_streams_and_spec_decode_metrics(stack):
    steps: list = []
    errors: list = []

    def stream(i: int) -> None:
        body = completion_body(MAX_TOKENS, stream=True, prompt=f"speculative decoding {i}")
        body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
        try:
            chunks = check_stream(stack, COMPLETIONS, body, MAX_TOKENS)
            seen = [c["usage"]["completion_tokens"] for c in chunks if c.get("choices") and c.get("usage")]
            steps.extend(b - a for a, b in zip([0] + seen, seen) if b > a)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(repr(exc))

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(STREAMS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert sum(steps) == STREAMS * MAX_TOKENS, "continuous usage stats do not add up to the tokens"
    # A chunk holds one step's tokens, 1 + the accepted drafts, unless the API
    # server fell behind: vLLM's RequestOutputCollector then merges a
    # request's outputs into one (vllm/v1/engine/output_processor.py), rare
    # unless the machine is loaded. The per-step figures are the engine's.
    merged = sum(1 for s in steps if s > 1 + len(RATES))
    assert merged <= 0.05 * len(steps), f"{merged} of {len(steps)} chunks hold more than {1 + len(RATES)} tokens"

    engine = _engine_counts(stack)
    assert 0 < engine["num_drafts"] < engine["num_draft_tokens"] <= len(RATES) * engine["num_drafts"]
    # every token beyond the first of each step is an accepted draft
    engine_steps = STREAMS * MAX_TOKENS - engine["num_accepted_tokens"]
    mean = STREAMS * MAX_TOKENS / engine_steps
    assert abs(mean - EXPECTED_TOKENS_PER_STEP) < 0.2, f"mean tokens per step {mean:.3f} (expected {EXPECTED_TOKENS_PER_STEP:.3f})"
    # each chunk holds one step or (merged) several
    assert len(steps) <= engine_steps <= 1.05 * len(steps), (len(steps), engine_steps)
    if engine_steps == len(steps):  # nothing merged: each chunk is one step, its drafts accepted ones
        assert engine["per_pos"][0] == sum(1 for s in steps if s > 1)
    frontend: dict = {}

    def caught_up() -> bool:
        frontend.update(_frontend_counts(stack))
        return all(frontend[k] == engine[k] for k in engine)

    try:
        h.wait_until(caught_up, 15, "the frontend's spec-decode counters to reach the engine's")
    except Exception:  # noqa: BLE001 - the comparison below says what differs
        pass
    assert frontend == engine
    # each position accepted at its rate, given the earlier ones were (within 4 standard errors)
    assert engine["num_drafts"] >= 2000
    proposed = engine["num_drafts"]
    for position, rate in enumerate(RATES):
        accepted = engine["per_pos"][position]
        error = 4 * math.sqrt(rate * (1 - rate) / proposed)
        assert abs(accepted / proposed - rate) < error, (position, accepted, proposed, rate)
        proposed = accepted  # a draft reaches the next position only if this one was accepted


def test_vllm_xargs_set_a_request_s_acceptance(stack):
    """mock_spec_acceptance 1.0: every draft accepted, K + 1 tokens a step; 0: one."""
    for rate, sizes in ((1.0, [4] * 10 + [1]), (0, [1] * 12)):
        body = completion_body(sum(sizes), stream=True, prompt=f"acceptance {rate}", vllm_xargs={"mock_spec_acceptance": rate})
        body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
        chunks = check_stream(stack, COMPLETIONS, body, sum(sizes))
        seen = [c["usage"]["completion_tokens"] for c in chunks if c.get("choices") and c.get("usage")]
        assert [b - a for a, b in zip([0] + seen, seen) if b > a] == sizes
