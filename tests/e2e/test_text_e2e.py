"""`--token-source text` through the real frontends, read by clients nobody
here wrote: the official `openai` package, and NVIDIA aiperf, which this
module installs into its own venv in the frontends' cache
($GMOCK_FRONTENDS_HOME/aiperf-venv: a few minutes and ~1.2 GB the first
time; $GMOCK_AIPERF names another install).

A client that counts tokens by re-tokenizing the streamed text (aiperf,
GuideLLM) must count what the engine generated: with random ids it counts
far more (junk text splits into more tokens), and its inter-token latency
comes out too short. Here the streamed text, re-tokenized with the model
dir's tokenizer (`tokenizers`), has `usage.completion_tokens` within 2 %,
and aiperf's output token count is within 2 % of the generated count and
no request's ITL is 2 % short of `--itl-ms` (a loaded machine only
stretches steps, so the upper bound is looser).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import e2e_harness as h
from gmock_engine.content import corpus
from test_frontends import DP1_TOPOLOGIES

pytestmark = pytest.mark.e2e

ITL_MS = 10.0
AIPERF_PACKAGE = "aiperf==0.13.0"


@pytest.fixture(scope="session")
def aiperf() -> Path:
    """aiperf's CLI: $GMOCK_AIPERF, else its own venv in the frontends' cache
    (installed once, a few minutes and ~1.2 GB, then reused)."""
    if os.environ.get("GMOCK_AIPERF"):
        return Path(os.environ["GMOCK_AIPERF"])
    venv = h.frontends_home() / "aiperf-venv"
    stamp = venv / ".gmock-installed"
    if not stamp.exists() or stamp.read_text() != AIPERF_PACKAGE:
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
        proc = subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "--disable-pip-version-check", AIPERF_PACKAGE],
                              capture_output=True, text=True, timeout=1200)  # fmt: skip
        if proc.returncode != 0:
            pytest.fail(f"installing {AIPERF_PACKAGE} failed (rc={proc.returncode}); retry, or remove {venv}:\n{proc.stderr[-2000:]}")
        stamp.write_text(AIPERF_PACKAGE)
    return venv / "bin" / "aiperf"


@pytest.fixture(scope="module", params=DP1_TOPOLOGIES, ids=lambda t: t.id)
def stack(request, frontends, model_dir, tmp_path_factory):
    """A stack whose engine makes text with the model dir's tokenizer, a step of ITL_MS."""
    args = ["--token-source", "text", "--tokenizer", str(model_dir), "--itl-ms", str(ITL_MS)]
    s = h.Stack(request.param, frontends, model_dir, tmp_path_factory.mktemp(request.param.id), engine_args=args)
    s.start()
    try:
        yield s
    finally:
        problems = s.stop()
        problems += [f"{g.name} exited rc={g.popen.returncode} after SIGTERM (expected 0)"
                     for g in s.engines if g.popen.returncode != 0]
        if problems:
            pytest.fail(f"{request.param.id}: teardown problems: {problems}\n{s.logs_report()}", pytrace=False)


@pytest.fixture(scope="module")
def retokenize(model_dir):
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    return lambda text: len(tok.encode(text, add_special_tokens=False).ids)


def _check_text(text: str, generated: int, retokenize) -> None:
    assert text and text.isprintable() and "\ufffd" not in text, text
    stripped = text.strip()
    assert any(stripped.startswith(s) or s.startswith(stripped) for s in corpus.SENTENCES), text[:200]
    counted = retokenize(text)
    assert abs(counted - generated) <= 0.02 * generated, (counted, generated, text[:200])


@pytest.mark.parametrize("max_tokens", [100, 400])
def test_openai_streams_text_that_re_tokenizes_to_the_generated_count(stack, retokenize, max_tokens):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=stack.base_url + "/v1", api_key="none", max_retries=0, timeout=120)
    options = {"include_usage": True}
    for i in range(3):
        parts, usage = [], None
        for chunk in client.completions.create(model=h.MODEL_NAME, prompt=f"Tell me something, {i}", max_tokens=max_tokens,
                                               stream=True, stream_options=options):
            parts += [c.text for c in chunk.choices]
            usage = chunk.usage or usage
        assert usage is not None and usage.completion_tokens == max_tokens
        _check_text("".join(parts), usage.completion_tokens, retokenize)

        parts, usage = [], None
        for chunk in client.chat.completions.create(model=h.MODEL_NAME, messages=[{"role": "user", "content": f"hi {i}"}],
                                                    max_tokens=max_tokens, stream=True, stream_options=options):
            parts += [c.delta.content or "" for c in chunk.choices]
            usage = chunk.usage or usage
        assert usage is not None and usage.completion_tokens == max_tokens
        _check_text("".join(parts), usage.completion_tokens, retokenize)


def test_aiperf_counts_the_generated_tokens_and_the_step_time(stack, model_dir, tmp_path, aiperf):
    out = tmp_path / "aiperf"
    output_tokens = 64
    argv = [str(aiperf), "profile", "--model", h.MODEL_NAME, "--url", stack.base_url, "--endpoint-type", "chat",
            "--streaming", "--tokenizer", str(model_dir), "--prompt-input-tokens-mean", "32",
            "--prompt-input-tokens-stddev", "0", "--prompt-output-tokens-mean", str(output_tokens),
            "--prompt-output-tokens-stddev", "0", "--request-count", "16", "--concurrency", "1",
            "--random-seed", "1", "--output-artifact-dir", str(out), "--ui-type", "none",
            "--no-server-metrics", "--no-gpu-telemetry"]
    run = subprocess.run(argv, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "NO_COLOR": "1"})  # not HF_HUB_OFFLINE: aiperf then reads only the hub cache
    if run.returncode != 0:
        logs = "".join(p.read_text(errors="replace")[-4000:] for p in out.rglob("*.log"))
        pytest.fail(f"aiperf exited {run.returncode}\n{run.stdout[-2000:]}\n{run.stderr[-2000:]}\n{logs}")
    [export] = list(out.rglob("profile_export_aiperf.json"))
    metrics = json.loads(export.read_text())
    # aiperf re-tokenizes the streamed text (no --use-server-token-count)
    counted = metrics["output_sequence_length"]
    assert abs(counted["avg"] - output_tokens) <= 0.02 * output_tokens, counted
    assert counted["min"] >= 0.98 * output_tokens and counted["max"] <= 1.02 * output_tokens, counted
    # Its ITL is (latency - TTFT) / (tokens counted - 1) per request: with the
    # count right, it is the step time. Too many tokens counted make it
    # shorter than --itl-ms; another process on the machine can only make a
    # step longer. So: no request's ITL is 2 % short of the step, the least
    # delayed one is near it, and the average is the same arithmetic over
    # the server's own count.
    itl, latency, ttft = (metrics[k] for k in ("inter_token_latency", "request_latency", "time_to_first_token"))
    assert 0.98 * ITL_MS <= itl["min"] <= 1.1 * ITL_MS, itl
    implied = (latency["avg"] - ttft["avg"]) / (output_tokens - 1)
    assert abs(itl["avg"] - implied) <= 0.02 * implied, (itl, implied)


def test_stop_strings_end_the_text_where_they_occur(stack):
    """The frontend matches stop strings in the detokenized text: with real
    words they occur (a sentence ends within 200 tokens), and the answer
    ends there (finish_reason stop, fewer tokens than asked), the stop
    string kept only when asked (include_stop_str_in_output)."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=stack.base_url + "/v1", api_key="none", max_retries=0, timeout=120)
    for _ in range(3):
        cut = client.completions.create(model=h.MODEL_NAME, prompt="Tell me", max_tokens=200, stop=["."])
        choice = cut.choices[0]
        assert choice.finish_reason == "stop" and cut.usage.completion_tokens < 200, cut
        assert choice.text and "." not in choice.text and choice.text.isprintable(), cut
        kept = client.completions.create(model=h.MODEL_NAME, prompt="Tell me", max_tokens=200, stop=["."],
                                         extra_body={"include_stop_str_in_output": True}).choices[0]  # fmt: skip
        assert kept.finish_reason == "stop" and kept.text.endswith(".") and kept.text.count(".") == 1, kept
