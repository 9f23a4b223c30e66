"""Logprobs and prompt logprobs through both real frontends (DP 1 and DP 4),
also with a client nobody here wrote: the official `openai` package.

What is checked is what an OpenAI client sees: one entry per generated token
with exactly the alternatives asked for, logprobs <= 0 and consistent with
the alternatives, prompt logprobs with None for the first prompt token, and
logprobs present exactly where a request asked for them under concurrency.
"""

from __future__ import annotations

import threading

import pytest

import e2e_harness as h
from test_frontends import CHAT, COMPLETIONS, chat_body, check_stream, completion_body

pytestmark = pytest.mark.e2e


def _check_chat_entries(content: list, max_tokens: int, top: int) -> None:
    assert len(content) == max_tokens, content
    for entry in content:
        assert entry["logprob"] <= 0
        alternatives = entry["top_logprobs"]
        assert len(alternatives) == top, entry
        values = [a["logprob"] for a in alternatives]
        # Most likely first, except that the Python frontend lists the sampled
        # token first whatever its rank (as with a real engine: it builds the
        # list from a dict that starts with the sampled token).
        rest = values[1:] if alternatives and alternatives[0]["token"] == entry["token"] else values
        assert rest == sorted(rest, reverse=True), values
        # Distinct ids, told apart by (text, logprob): two ids can decode to the
        # same text (a lone UTF-8 byte is '\ufffd' for every such id).
        assert len({(a["token"], a["logprob"]) for a in alternatives}) == len(alternatives) or top == 0
        same_text = [a["logprob"] for a in alternatives if a["token"] == entry["token"]]
        if same_text:  # the sampled token among the top-k: the same logprob
            assert any(v == pytest.approx(entry["logprob"]) for v in same_text), entry
        elif alternatives:
            assert entry["logprob"] <= values[-1] + 1e-6  # ranked below every alternative


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_with_top_logprobs(stack, stream):
    body = chat_body(6, stream=stream, logprobs=True, top_logprobs=3)
    if not stream:
        r = stack.post(CHAT, body)
        assert r.status_code == 200, r.text[:500]
        choice = r.json()["choices"][0]
        _check_chat_entries(choice["logprobs"]["content"], 6, 3)
        return
    chunks = check_stream(stack, CHAT, body, 6)
    content = [e for c in chunks for ch in c.get("choices", []) if ch.get("logprobs") for e in ch["logprobs"]["content"]]
    _check_chat_entries(content, 6, 3)


def test_chat_logprobs_without_top_logprobs_give_the_sampled_token_only(stack):
    r = stack.post(CHAT, chat_body(4, stream=False, logprobs=True))
    assert r.status_code == 200, r.text[:500]
    _check_chat_entries(r.json()["choices"][0]["logprobs"]["content"], 4, 0)


def test_completion_logprobs(stack):
    r = stack.post(COMPLETIONS, completion_body(5, stream=False, logprobs=2))
    assert r.status_code == 200, r.text[:500]
    logprobs = r.json()["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == len(logprobs["top_logprobs"]) == 5
    for token, value, top in zip(logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"]):
        assert value <= 0
        # the top 2 plus the sampled token when it is not among them (decoded texts may coincide)
        assert 1 <= len(top) <= 3 and all(v <= 0 for v in top.values())
        if token in top:
            assert top[token] == pytest.approx(value) or len(set(top)) < 3


def test_completion_echo_with_logprobs_scores_the_prompt(stack):
    r = stack.post(COMPLETIONS, completion_body(2, stream=False, logprobs=1, echo=True))
    assert r.status_code == 200, r.text[:500]
    body = r.json()
    logprobs = body["choices"][0]["logprobs"]
    prompt_tokens = body["usage"]["prompt_tokens"]
    assert len(logprobs["token_logprobs"]) == prompt_tokens + 2
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None  # nothing before the first token
    assert all(v is not None and v <= 0 for v in logprobs["token_logprobs"][1:])


def test_prompt_logprobs_parameter(stack):
    r = stack.post(COMPLETIONS, completion_body(1, stream=False, prompt_logprobs=2))
    assert r.status_code == 200, r.text[:500]
    body = r.json()
    prompt_logprobs = body["choices"][0]["prompt_logprobs"]
    assert len(prompt_logprobs) == body["usage"]["prompt_tokens"] and prompt_logprobs[0] is None
    for position in prompt_logprobs[1:]:
        # the prompt's own token plus the top 2 (fewer when it is among them)
        assert 2 <= len(position) <= 3
        ranks = sorted(v["rank"] for v in position.values())
        assert ranks[:2] == [1, 2] or ranks[0] >= 1
        assert all(v["logprob"] <= 0 for v in position.values())


def test_a_mix_with_and_without_logprobs_at_64_concurrent_streams(stack):
    errors: list = []

    def one(i: int) -> None:
        asked = i % 2 == 0
        extra = {"logprobs": True, "top_logprobs": 2} if asked else {}
        try:
            chunks = check_stream(stack, CHAT, chat_body(8, stream=True, messages=[{"role": "user", "content": f"mix {i}"}], **extra), 8)
            entries = [e for c in chunks for ch in c.get("choices", []) if ch.get("logprobs") for e in ch["logprobs"]["content"]]
            if asked:
                _check_chat_entries(entries, 8, 2)
            elif entries:
                errors.append(f"request {i} got logprobs it did not ask for")
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(f"request {i}: {exc}")

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "streams still running after 120 s"
    assert not errors, errors[:5]


def test_the_openai_client(stack):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=stack.base_url + "/v1", api_key="none", max_retries=0, timeout=60)
    chat = client.chat.completions.create(
        model=h.MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=5, logprobs=True, top_logprobs=2
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 5 and all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in content)
    stream = client.chat.completions.create(
        model=h.MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=4, logprobs=True, top_logprobs=1, stream=True
    )
    streamed = [e for chunk in stream for choice in chunk.choices if choice.logprobs for e in choice.logprobs.content]
    assert len(streamed) == 4 and all(len(e.top_logprobs) == 1 for e in streamed)
    completion = client.completions.create(model=h.MODEL_NAME, prompt="hello there", max_tokens=3, logprobs=2)
    lp = completion.choices[0].logprobs
    assert len(lp.tokens) == 3 and all(v <= 0 for v in lp.token_logprobs) and all(1 <= len(t) <= 3 for t in lp.top_logprobs)


def _token_ids(logprobs: dict) -> list[int]:
    """Token ids from completions logprobs with return_tokens_as_token_ids."""
    return [int(t.split(":", 1)[1]) for t in logprobs["tokens"]]


def test_allowed_token_ids_and_logit_bias_shape_the_tokens(stack):
    r = stack.post(
        COMPLETIONS,
        completion_body(30, stream=False, allowed_token_ids=[100, 101, 102], logprobs=2, return_tokens_as_token_ids=True),
    )
    assert r.status_code == 200, r.text[:500]
    logprobs = r.json()["choices"][0]["logprobs"]
    assert set(_token_ids(logprobs)) <= {100, 101, 102} and len(logprobs["tokens"]) == 30
    alternatives = {int(k.split(":", 1)[1]) for top in logprobs["top_logprobs"] for k in top}
    assert alternatives <= {100, 101, 102}  # consistent with what may be drawn
    r = stack.post(COMPLETIONS, completion_body(8, stream=False, logit_bias={"500": 100}, logprobs=0, return_tokens_as_token_ids=True))
    assert r.status_code == 200, r.text[:500]
    logprobs = r.json()["choices"][0]["logprobs"]
    assert _token_ids(logprobs) == [500] * 8 and all(v > -1e-3 for v in logprobs["token_logprobs"])  # forced: almost certain
    banned = {str(i): -100 for i in range(100, 31000)}  # everything but 31000..31998 and EOS
    r = stack.post(COMPLETIONS, completion_body(40, stream=False, logit_bias=banned, logprobs=0, return_tokens_as_token_ids=True))
    assert r.status_code == 200, r.text[:500]
    ids = _token_ids(r.json()["choices"][0]["logprobs"])
    assert len(ids) == 40 and not any(100 <= i < 31000 for i in ids)
