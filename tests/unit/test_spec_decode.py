"""Speculative decoding (content/spec_decode.py): the verifier's acceptance per
position, the exact lengths and finishes of requests under it, the
SpecDecodingStats the engine sends (their counts are the tokens emitted),
the flags and the latency model's verify step."""

import math
import random

import pytest

from gmock_engine.config import settings
from gmock_engine.config.loader import ConfigError, parse_config
from gmock_engine.timing.latency import LatencyModel
from gmock_engine.core.sched_output import SchedulerOutput
from gmock_engine.content.spec_decode import SpecDecode, acceptance_rates, expected_tokens_per_step
from gmock_engine.wire.checks import BadXargs, check_xargs
from gmock_engine.wire.inputs import EngineCoreRequest
from gmock_engine.wire.types import FinishReason

import wire_rules
from engine_steps import engine_with, outputs_of, run, tokens_of

RATES = (0.8, 0.6, 0.4)


class _Req:
    def __init__(self, rid):
        self.request_id = rid
        self.spec_state = None
        self.spec_rate = None


def add(rid, max_tokens, **xargs):
    return EngineCoreRequest(rid, 3, max_tokens, True, client_index=0, prompt_token_ids=[1, 2, 3], extra_args=xargs or None)


def test_each_position_is_accepted_at_its_rate_given_the_earlier_ones_were():
    spec = SpecDecode(RATES, seed=7)
    counts = [0] * 4
    requests = [_Req(f"r{i}") for i in range(50)]
    for _ in range(60):  # 3000 drafts, many requests: the per-request sequences together
        for request in requests:
            counts[spec.next_count(request, 1000) - 1] += 1
    assert spec.num_drafts == 3000 and spec.num_draft_tokens == 9000
    reached = [spec.num_drafts] + spec.accepted_per_pos  # drafts that got to position i, then accepted there
    for i, rate in enumerate(RATES):
        tried, accepted = reached[i], reached[i + 1]
        sigma = math.sqrt(rate * (1 - rate) / tried)
        assert abs(accepted / tried - rate) < 4 * sigma, (i, accepted, tried)
    assert sum(counts[i] * i for i in range(4)) == spec.num_accepted_tokens
    # never a draft accepted after a rejected one: per-position counts only fall
    assert spec.accepted_per_pos == sorted(spec.accepted_per_pos, reverse=True)


def test_rates_of_zero_and_one():
    assert SpecDecode((1.0, 1.0)).next_count(_Req("a"), 10) == 3
    assert SpecDecode((0.0, 1.0)).next_count(_Req("a"), 10) == 1
    # within the request's end: no draft past it, one token when one remains
    spec = SpecDecode((1.0, 1.0, 1.0))
    assert spec.next_count(_Req("a"), 2) == 2 and spec.num_draft_tokens == 1
    assert spec.next_count(_Req("b"), 1) == 1 and spec.num_drafts == 1


def _run(max_tokens, seed=0, rates=RATES):
    engine = engine_with(spec_acceptance=rates, seed=seed)
    for rid, n in max_tokens.items():
        engine.apply(add(rid, n))
    return engine, run(engine)


def _stats(sent):
    return [message[2]["spec_decoding_stats"] for _, message in sent if message[2] and message[2]["spec_decoding_stats"]]


def test_lengths_and_finishes_stay_exact_and_stats_count_the_tokens():
    lengths = {"a": 1, "b": 2, "c": 7, "d": 50, "e": 301}
    engine, sent = _run(lengths)
    drafts = accepted = 0
    for rid, n in lengths.items():
        outputs = outputs_of(sent, rid)
        sizes = [len(o[1]) for o in outputs]
        assert sum(sizes) == n
        assert all(1 <= s <= 1 + len(RATES) for s in sizes)
        finishes = [o[5] if len(o) > 5 else None for o in outputs]
        assert finishes[-1] == FinishReason.LENGTH and not any(finishes[:-1])
        done = 0
        for size in sizes:  # a draft is proposed while more than one token remains
            if n - done > 1:
                drafts += 1
                accepted += size - 1
            else:
                assert size == 1
            done += size
    stats = _stats(sent)
    assert stats and all(not wire_rules.pack_and_check(message)[1] for _, message in sent)
    assert sum(s["num_drafts"] for s in stats) == drafts
    assert sum(s["num_accepted_tokens"] for s in stats) == accepted
    assert [sum(col) for col in zip(*(s["num_accepted_tokens_per_pos"] for s in stats))][0] == sum(
        1 for rid, n in lengths.items() for o in outputs_of(sent, rid) if len(o[1]) > 1
    )
    assert all(s["num_spec_tokens"] == 3 and len(s["num_accepted_tokens_per_pos"]) == 3 for s in stats)
    assert engine.counters["tokens"] == sum(lengths.values())
    totals = engine.scheduler.spec.totals()  # the engine's own counts (--metrics-port)
    assert totals["num_drafts"] == drafts and totals["num_accepted_tokens"] == accepted
    assert totals["num_accepted_tokens_per_pos"] == [sum(col) for col in zip(*(s["num_accepted_tokens_per_pos"] for s in stats))]
    # a long request averages 1 + the expected accepted drafts per step
    sizes = [len(o[1]) for o in outputs_of(sent, "e")][:-3]
    assert abs(sum(sizes) / len(sizes) - expected_tokens_per_step(RATES)) < 0.25


def test_the_outcome_depends_on_seed_and_request_only():
    sizes = lambda sent, rid: [len(o[1]) for o in outputs_of(sent, rid)]  # noqa: E731
    _, one = _run({"x": 200})
    _, two = _run({"y": 40, "x": 200})
    _, other = _run({"x": 200}, seed=1)
    assert sizes(one, "x") == sizes(two, "x")
    assert sizes(one, "x") != sizes(other, "x")


def test_spec_off_sends_no_stats_and_one_token_per_step():
    engine = engine_with()
    engine.apply(add("a", 20))
    sent = run(engine)
    assert all(len(o[1]) == 1 for o in outputs_of(sent, "a"))
    assert not _stats(sent)


def test_flags():
    def parts(*argv):
        return settings.from_config(parse_config(list(argv), env={})).generation.spec_acceptance

    assert parts() == ()
    assert parts("--spec-tokens", "3") == (0.7, 0.7, 0.7)
    assert parts("--spec-tokens", "3", "--spec-acceptance", "0.8,0.6,0.4") == RATES
    with pytest.raises(ConfigError, match=r"--spec-acceptance: 2 rates .* give 3"):
        parse_config(["--spec-tokens", "3", "--spec-acceptance", "0.8,0.6"], env={})
    with pytest.raises(ConfigError, match=r"--spec-tokens: 2 .*--output-token-chunk-size 4"):
        parse_config(["--spec-tokens", "2", "--output-token-chunk-size", "4"], env={})
    for bad in ("1.5", "0.5,,0.2", "-0.1", "x"):
        with pytest.raises(ConfigError, match="--spec-acceptance"):
            parse_config(["--spec-tokens", "1", "--spec-acceptance", bad], env={})
    with pytest.raises(ValueError):
        acceptance_rates(3, (0.5, 0.5))


def test_a_verify_step_charges_the_drafts_as_computed_tokens():
    model = LatencyModel(itl_ms=10.0, prefill_ms_per_token=1.0, time_scale=1.0)
    rng = random.Random(0)
    plain = model.step_time(SchedulerOutput((), 4, 4, 0), rng)
    verify = model.step_time(SchedulerOutput((), 4, 4, 0, num_draft_tokens=12), rng)
    assert verify == pytest.approx(plain + 0.012)
    engine = engine_with(spec_acceptance=RATES, max_num_batched_tokens=64)
    for i in range(3):
        engine.apply(add(f"r{i}", 30))
    engine.step()
    plan = engine.scheduler.schedule(engine.clock())
    assert plan.num_draft_tokens == 3 * 3 and plan.num_decode_tokens == 3


def test_the_wire_rules_know_spec_decoding_stats():
    from gmock_engine.content.spec_decode import spec_decoding_stats
    from gmock_engine.wire.outputs import engine_core_outputs, scheduler_stats

    def problems(spec):
        message = engine_core_outputs(0, [], 1.0, scheduler_stats=scheduler_stats(0, 0, 0.0, 1, spec_decoding_stats=spec))
        return sorted({wire_rules.rule_of(p) for p in wire_rules.pack_and_check(message)[1]})

    good = spec_decoding_stats(3, 2, 6, 3, [2, 1, 0], [2, 2, 2])
    assert problems(good) == [] and problems(None) == []
    assert problems({k: v for k, v in good.items() if k != "num_spec_tokens"}) == ["scheduler_stats.spec"]
    assert problems({**good, "num_accepted_tokens_per_pos": [2, 1]}) == ["scheduler_stats.spec"]
    assert problems({**good, "num_accepted_tokens": 7}) == ["scheduler_stats.spec"]


def test_vllm_xargs_mock_spec_acceptance_sets_a_request_s_rate():
    engine = engine_with(spec_acceptance=RATES)
    engine.apply(add("all", 41, mock_spec_acceptance=1.0))
    engine.apply(add("none", 20, mock_spec_acceptance=0))
    sent = run(engine)
    assert [len(o[1]) for o in outputs_of(sent, "all")] == [4] * 10 + [1]
    assert [len(o[1]) for o in outputs_of(sent, "none")] == [1] * 20
    for value in (True, "0.5", float("nan"), -0.1, 1.5, [0.5]):
        with pytest.raises(BadXargs, match="mock_spec_acceptance"):
            check_xargs({"mock_spec_acceptance": value})
    assert check_xargs({"mock_spec_acceptance": 1}).spec_acceptance == 1.0


def test_a_reload_changes_the_rates_from_the_next_step_and_keeps_k(tmp_path):
    """--spec-acceptance reloads (SIGHUP): the engine's verifier takes the new
    rates between two steps; a count that fits neither K nor 1 is refused,
    since --spec-tokens cannot change while running."""
    import dataclasses

    from gmock_engine.config import reload

    path = tmp_path / "live.ini"
    path.write_text("[gmock_engine]\nspec-tokens = 2\nspec-acceptance = 1.0\n")

    def load():
        return parse_config(["--config", str(path)], env={})

    current = load()
    engine = engine_with(spec_acceptance=settings.from_config(current).generation.spec_acceptance)
    engine.apply(add("a", 40))
    sent = run_steps_counting(engine, 4)
    assert sent[1:] == [3, 3, 3]  # every draft accepted: K + 1 tokens a step (the first step prefills)
    path.write_text("[gmock_engine]\nspec-tokens = 2\nspec-acceptance = 0.0\n")
    found = reload.check(current, load)
    assert found.error is None and [c.flag for c in found.changes] == ["--spec-acceptance"]
    new = settings.from_config(found.config).generation.spec_acceptance
    assert new == (0.0, 0.0)
    engine.reconfigure(dataclasses.replace(engine.settings, spec_acceptance=new))
    assert run_steps_counting(engine, 3) == [1, 1, 1]
    assert engine.scheduler.spec.num_spec_tokens == 2
    path.write_text("[gmock_engine]\nspec-tokens = 3\nspec-acceptance = 0.5,0.5,0.5\n")
    found = reload.check(current, load)
    assert found.error is not None and "--spec-acceptance: 3 rates" in found.error and "give 2 or 1" in found.error


def run_steps_counting(engine, steps):
    """Tokens of request "a" in each of `steps` steps."""
    return [len(tokens_of(engine.step(), "a")) for _ in range(steps)]
