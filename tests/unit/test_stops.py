"""How requests end: EOS lengths, stop ids, min_tokens, ignore_eos, vllm_xargs scenarios."""

import random

import pytest

from gmock_engine.content.lengths import OutputLengths, from_config
from gmock_engine.wire.inputs import EngineCoreRequest
from gmock_engine.wire.types import FinishReason
from engine_steps import engine_with

EOS = 31999


def req(rid="r", max_tokens=10, prompt_len=4, **kw):
    kw.setdefault("eos_token_id", EOS)
    kw.setdefault("all_stop_token_ids", (EOS,))
    return EngineCoreRequest(rid, prompt_len, max_tokens, True, **kw)


def finish(e, request):
    """Run one request to its end; return (tokens, last output, message)."""
    e.apply(request)
    outputs, last_message = [], None
    while e.has_work:
        for _, message in e.step():
            outputs += [o for o in message[1] if o[0] == request.request_id]
            last_message = message
    assert last_message is not None and request.request_id in last_message[5]
    return [t for o in outputs for t in o[1]], outputs[-1], last_message


def test_default_ends_by_length_and_random_tokens_avoid_stop_ids():
    e = engine_with(vocab_size=4)
    tokens, last, _ = finish(e, req(max_tokens=400, stop_token_ids=(2,), eos_token_id=3, all_stop_token_ids=(3,)))
    assert len(tokens) == 400 and last[5] == FinishReason.LENGTH
    assert set(tokens) == {0, 1}  # 2 and 3 would have stopped a real engine


def test_eos_length_ends_with_stop_and_the_eos_token():
    e = engine_with(output_lengths=OutputLengths.parse("fixed:5"))
    tokens, last, _ = finish(e, req(max_tokens=10))
    assert len(tokens) == 5 and tokens[-1] == EOS and EOS not in tokens[:-1]
    assert last[5] == FinishReason.STOP and len(last) == 6  # no stop_reason for EOS (nil)
    assert e.ledger.summary().get("finished_stop", 0) == 1


@pytest.mark.parametrize(
    "kw,expected_len,expected_finish",
    [
        ({"min_tokens": 8}, 8, FinishReason.STOP),  # no EOS before min_tokens
        ({"ignore_eos": True}, 10, FinishReason.LENGTH),
        ({"max_tokens": 3}, 3, FinishReason.LENGTH),  # max_tokens first
    ],
)
def test_min_tokens_ignore_eos_and_max_tokens(kw, expected_len, expected_finish):
    e = engine_with(output_lengths=OutputLengths.parse("fixed:5"))
    tokens, last, _ = finish(e, req(**kw))
    assert len(tokens) == expected_len and last[5] == expected_finish


def test_max_model_len_caps_prompt_plus_output():
    e = engine_with(max_model_len=10)
    tokens, last, _ = finish(e, req(max_tokens=50, prompt_len=8))
    assert len(tokens) == 2 and last[5] == FinishReason.LENGTH


def test_xargs_output_len_applies_even_with_ignore_eos():
    tokens, last, _ = finish(engine_with(), req(ignore_eos=True, extra_args={"mock_output_len": 3}))
    assert len(tokens) == 3 and last[5] == FinishReason.STOP and tokens[-1] == EOS


def test_xargs_fail_after_errors_mid_stream():
    e = engine_with()
    tokens, last, message = finish(e, req(extra_args={"mock_fail_after": 2}))
    assert len(tokens) == 2 and last[5] == FinishReason.ERROR
    assert last[18]["code"] == "mock_failure"
    assert e.ledger.summary().get("finished_error", 0) == 1


def test_xargs_finish_modes_and_stop_token():
    _, last, _ = finish(engine_with(), req("e", extra_args={"mock_finish": "error"}))
    assert last[5] == FinishReason.ERROR
    tokens, last, _ = finish(engine_with(), req("s", extra_args={"mock_output_len": 4, "mock_stop_token_id": 77}))
    assert len(tokens) == 4 and tokens[-1] == 77 and last[5] == FinishReason.STOP and last[6] == 77
    tokens, last, _ = finish(engine_with(), req("l", extra_args={"mock_finish": "stop"}))
    assert len(tokens) == 10 and last[5] == FinishReason.STOP and tokens[-1] == EOS


def test_bad_xargs_get_an_error_finish_not_a_crash():
    e = engine_with()
    [(_, message)] = e.apply(req(extra_args={"mock_finish": "maybe"}))
    assert message[1][0][5] == FinishReason.ERROR and "mock_finish" in message[1][0][18]["message"]
    [(_, message)] = e.apply(req("n", extra_args={"mock_output_len": "many"}))
    assert message[1][0][5] == FinishReason.ERROR
    assert e.ledger.summary() == {"started": 2, "finished_error": 2, "active": 0, "violations": 0} and e.num_active == 0


def test_length_model_is_deterministic_per_request():
    def lengths(seed):
        e = engine_with(seed=seed, output_lengths=OutputLengths.parse("uniform:2:40"))
        return [len(finish(e, req(f"r{i}", max_tokens=100))[0]) for i in range(30)]

    first = lengths(1)
    assert all(2 <= n <= 40 for n in first) and len(set(first)) > 5
    assert lengths(1) == first and lengths(2) != first


@pytest.mark.parametrize(
    "spec,low,high",
    [("fixed:7", 7, 7), ("uniform:3:9", 3, 9), ("normal:50:5", 20, 80), ("exponential:20", 1, 400)],
)
def test_distributions_draw_in_range(spec, low, high):
    dist = OutputLengths.parse(spec)
    rng = random.Random(0)
    draws = [dist.draw(rng) for _ in range(2000)]
    assert all(low <= d <= high for d in draws)


def test_eos_probability_has_the_geometric_mean():
    rng = random.Random(0)
    draws = [OutputLengths.eos(0.05).draw(rng) for _ in range(20000)]
    assert min(draws) >= 1 and 18 < sum(draws) / len(draws) < 22  # mean 1/p = 20
    assert from_config(None, 0.0) is None and from_config(None, 0.5).kind == "eos"


@pytest.mark.parametrize("spec", ["gauss:1:2", "fixed", "uniform:9:3", "normal:5", "exponential:0", "fixed:x"])
def test_bad_length_specs(spec):
    with pytest.raises(ValueError):
        OutputLengths.parse(spec)
