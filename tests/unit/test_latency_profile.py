"""The step-time profile (timing/profile.py): its file, its arithmetic, and
the engine timed by it on a virtual clock."""

import random

import pytest

from gmock_engine.config.loader import ConfigError, parse_config
from gmock_engine.timing.latency import LatencyModel
from gmock_engine.timing.profile import ProfileError, StepProfile, format_profile, parse_profile
from gmock_engine.config.settings import from_config
from gmock_engine.wire.inputs import EngineCoreRequest
from engine_steps import Clock, drive, engine_with, outputs_of

PROFILE = StepProfile(
    batch=(1, 2, 4),
    step_ms=(5.0, 6.0, 9.0),
    prefill_ms_per_token=0.02,
    prefill_attention_ms=0.01,
    context_ms_per_ktoken=0.5,
)


def test_table_interpolates_and_extends_its_ends():
    assert PROFILE.batch_ms(1) == 5.0 and PROFILE.batch_ms(3) == pytest.approx(7.5)
    assert PROFILE.batch_ms(8) == pytest.approx(15.0)  # last segment: +1.5 ms per request
    assert PROFILE.batch_ms(0) == pytest.approx(4.0)  # first segment, extended down
    assert PROFILE.predict_ms(2, 100, 5000.0, 2000) == pytest.approx(6.0 + 2.0 + 0.05 + 1.0)
    per_prompt = StepProfile(PROFILE.batch, PROFILE.step_ms, prefill_ms_per_request=1.5)
    assert per_prompt.predict_ms(2, 100, 5000.0, 2000, prefill_reqs=2) == pytest.approx(6.0 + 3.0)


def test_a_prefill_table_prices_the_step_s_prompt_tokens_instead_of_a_price_per_token():
    table = StepProfile(PROFILE.batch, PROFILE.step_ms, prefill_tokens=(256, 1024, 4096), prefill_ms=(4.0, 40.0, 190.0),
                        prefill_attention_ms=0.01, context_ms_per_ktoken=0.5)  # fmt: skip
    assert table.prefill_tokens_ms(0) == 0.0
    assert table.prefill_tokens_ms(128) == pytest.approx(2.0)  # from 0 ms at 0 tokens to the first point
    assert table.prefill_tokens_ms(640) == pytest.approx(22.0)  # linear in between
    assert table.prefill_tokens_ms(8192) == pytest.approx(390.0)  # the last segment, extended
    # the other terms as before: batch, attention, context
    assert table.predict_ms(2, 640, 5000.0, 2000) == pytest.approx(6.0 + 22.0 + 0.05 + 1.0)
    assert parse_profile(format_profile(table)) == table
    # a profile without the table is written as before it existed, and priced per token
    assert "prefill_tokens" not in format_profile(PROFILE) and PROFILE.prefill_tokens_ms(100) == pytest.approx(2.0)


def test_the_file_round_trips_and_is_read_as_written():
    noisy = StepProfile(PROFILE.batch, PROFILE.step_ms, 0.02, 0.01, 0.5, 0.7, spread_decode=((0.9, 1.0, 1.2),), spread_prefill=((1.0, 1.1),))
    text = format_profile(noisy, ["a comment"])
    assert text.startswith("# a comment\n[latency-profile]")
    assert parse_profile(text) == noisy
    binned = StepProfile(PROFILE.batch, PROFILE.step_ms, spread_prefill=((1.0, 1.5), (0.9, 1.1), (1.0, 1.0)), spread_prefill_bins=(32, 192))
    assert parse_profile(format_profile(binned)) == binned
    by_batch = StepProfile(PROFILE.batch, PROFILE.step_ms, spread_decode=((0.5, 2.0), (0.9, 1.1)), spread_decode_bins=(1,))
    assert parse_profile(format_profile(by_batch)) == by_batch
    first_steps = StepProfile(PROFILE.batch, PROFILE.step_ms, spread_decode=((0.9, 1.1),), spread_new_size=(1.0, 1.5, 9.0),
                              spread_new_max=(2.0, 6.0))
    assert parse_profile(format_profile(first_steps)) == first_steps
    added = StepProfile(PROFILE.batch, PROFILE.step_ms, spread_new_size_ms=(-0.5, 3.25, 40.0), spread_new_max_ms=(9.0, 120.0))
    assert parse_profile(format_profile(added)) == added
    # a profile of one set, as written before there were bins, reads as one bin
    assert parse_profile("[latency-profile]\nbatch = 1\nstep_ms = 1\nspread_prefill = 0.9 1.2\n").spread_prefill == ((0.9, 1.2),)
    assert parse_profile("[latency-profile]\nbatch = 1\nstep_ms = 1\nspread_decode = 0.9 1.2\n").spread_decode == ((0.9, 1.2),)
    hand = "[latency-profile]\nbatch = 1, 8   # by hand\nstep_ms = 4 12\n"
    assert parse_profile(hand) == StepProfile(batch=(1, 8), step_ms=(4.0, 12.0))


@pytest.mark.parametrize(
    "text, message",
    [
        ("batch = 1\n", "not an INI file"),
        ("[other]\nbatch = 1\n", "no \\[latency-profile\\] section"),
        ("[latency-profile]\nstep_ms = 1\n", "missing key batch"),
        ("[latency-profile]\nbatch = 1 2\nstep_ms = 1\n", "same number of values"),
        ("[latency-profile]\nbatch = 2 1\nstep_ms = 1 2\n", "increasing"),
        ("[latency-profile]\nbatch = 1\nstep_ms = x\n", "step_ms: not a list of numbers"),
        ("[latency-profile]\nbatch = 1\nstep_ms = 1\nspread_new_size = 2 1\n", "spread_new_size: at least two non-decreasing"),
        ("[latency-profile]\nbatch = 1\nstep_ms = 1\nspread_new_size = 1 2 | 1 2\n", "spread_new_size: one list of numbers"),
        ("[latency-profile]\nbatch = 1\nstep_ms = 1\nspread_new_max = 3\n", "spread_new_max: at least two non-decreasing"),
        ("[latency-profile]\nbatch = 1\nstep_ms = 1\nspread_new_size_ms = 5 -1\n", "spread_new_size_ms: at least two non-decreasing"),
        ("[latency-profile]\nbatch = 1\nstep_ms = 1\nspread_new_max_ms = 1 inf\n", "spread_new_max_ms: at least two non-decreasing"),
        ("[latency-profile]\nbatch = 1\nstep_ms = 1\nspread_new_size = 1 2\nspread_new_size_ms = 1 2\n", "one or the other"),
        ("[latency-profile]\nbatch = 1\nstep_ms = 1\nitl = 3\n", "unknown key\\(s\\) itl"),
        ("[latency-profile]\nbatch = 1\nstep_ms = 1\nprefill_ms_per_token = -1\n", "prefill_ms_per_token: must be >= 0"),
        ("[latency-profile]\nbatch = 1\nstep_ms = 1\nprefill_ms_per_request = nan\n", "prefill_ms_per_request: must be >= 0"),
        ("[latency-profile]\nbatch = 1\nstep_ms = 1\nspread_decode = 1.2 0.9\n", "spread_decode: at least two non-decreasing"),
        ("[latency-profile]\nversion = 9\nbatch = 1\nstep_ms = 1\n", "newer than this engine reads"),
        ("[latency-profile]\nbatch = 1.5\nstep_ms = 1\n", "whole numbers"),
        ("[latency-profile]\nbatch = 1\nstep_ms = 1\nspread_prefill = 1 2 | 1 3\n", "several sets need spread_prefill_bins"),
        ("[latency-profile]\nbatch = 1\nstep_ms = 1\nspread_prefill_bins = 64\nspread_prefill = 1 2\n", "2 sets \\(one per bin"),
        ("[latency-profile]\nbatch = 1\nstep_ms = 1\nspread_prefill_bins = 64 32\nspread_prefill = 1 2 | 1 2 | 1 2\n", "spread_prefill_bins: increasing"),
        ("[latency-profile]\nbatch = 1\nstep_ms = 1\nspread_prefill_bins = 64\nspread_prefill = 1 2 | 2 1\n", "spread_prefill: at least two non-decreasing"),
        ("[latency-profile]\nbatch = 1\nstep_ms = 1 | 2\n", "only separates the sets of spread_decode and spread_prefill"),
        ("[latency-profile]\nbatch = 1\nstep_ms = 1\nspread_decode = 1 2 | 1 3\n", "several sets need spread_decode_bins"),
        ("[latency-profile]\nbatch = 1\nstep_ms = 1\nspread_decode_bins = 0\nspread_decode = 1 2 | 1 3\n", "spread_decode_bins: increasing batch sizes"),
        ("[latency-profile]\nbatch = 1\nstep_ms = 1\nspread_decode_bins = 1 3\nspread_decode = 1 2 | 1 3\n", "spread_decode: 3 sets"),
        ("[latency-profile]\nbatch = 1\nstep_ms = 1\nspread_decode_bins = 2.5\n", "whole numbers"),
        ("[latency-profile]\nbatch = 1\nstep_ms = 1\ninput_delay_ms = 3\n", "input_delay_ms: at least two"),
        ("[latency-profile]\nbatch = 1\nstep_ms = 1\nprefill_tokens = 16 64\nprefill_ms = 1\n", "prefill_tokens and prefill_ms need the same"),
        ("[latency-profile]\nbatch = 1\nstep_ms = 1\nprefill_tokens = 64 16\nprefill_ms = 1 2\n", "prefill_tokens: increasing"),
        ("[latency-profile]\nbatch = 1\nstep_ms = 1\nprefill_tokens = 16.5\nprefill_ms = 1\n", "whole numbers"),
        ("[latency-profile]\nbatch = 1\nstep_ms = 1\nprefill_tokens = 16\nprefill_ms = -1\n", "prefill_ms: values must be >= 0"),
        ("[latency-profile]\nbatch = 1\nstep_ms = 1\nprefill_ms_per_token = 0.1\nprefill_tokens = 16\nprefill_ms = 1\n",
         "one or the other \\(a price per token, or a table\\)"),
    ],
)
def test_a_bad_profile_says_what_is_wrong(text, message):
    with pytest.raises(ProfileError, match=message):
        parse_profile(text, source="p.ini")


def test_spread_draws_between_its_quantiles():
    p = StepProfile((1,), (10.0,), spread_decode=((0.5, 1.0, 2.0),))
    rng = random.Random(1)
    draws = sorted(p.spread(0, rng) for _ in range(4000))
    assert draws[0] >= 0.5 and draws[-1] <= 2.0
    assert draws[2000] == pytest.approx(1.0, abs=0.05)  # the median quantile
    assert p.spread(100, rng) == 1.0  # no prefill spread given: none


def test_a_prefill_step_draws_from_the_bin_of_its_prompt_tokens():
    p = StepProfile((1,), (10.0,), spread_prefill=((2.0, 2.0), (3.0, 3.0), (4.0, 4.0)), spread_prefill_bins=(32, 192))
    rng = random.Random(1)
    assert [p.spread(t, rng) for t in (1, 32, 33, 192, 193, 5000)] == [2.0, 2.0, 3.0, 3.0, 4.0, 4.0]
    assert p.sample_ms(1, 100, 0.0, 0, rng) == pytest.approx(3.0 * p.predict_ms(1, 100))


def test_a_decode_step_draws_from_the_bin_of_its_batch():
    p = StepProfile((1,), (10.0,), spread_decode=((2.0, 2.0), (3.0, 3.0), (4.0, 4.0)), spread_decode_bins=(1, 7),
                    spread_prefill=((5.0, 5.0),))  # fmt: skip
    rng = random.Random(1)
    assert [p.spread(0, rng, batch) for batch in (1, 2, 7, 8, 64)] == [2.0, 3.0, 3.0, 4.0, 4.0]
    assert p.sample_ms(8, 0, 0.0, 0, rng) == pytest.approx(4.0 * p.predict_ms(8))
    assert p.sample_ms(8, 10, 0.0, 0, rng) == pytest.approx(5.0 * p.predict_ms(8, 10))  # prefill: its own spread


def test_first_token_ends_the_step_that_computed_the_prompt_then_steps_by_the_profile():
    clock = Clock(0.0)
    engine = engine_with(clock, latency=LatencyModel(profile=PROFILE))
    engine.apply(EngineCoreRequest("r", 100, 3, True))
    assert engine.step() == []  # admitted and prefilled: no token before the step ends
    due = engine.next_step_time(0.0)
    # batch 1, 100 prompt tokens from position 0 (attention 100 * 50), 100 held
    assert due == pytest.approx(PROFILE.predict_ms(1, 100, 5000.0, 100) / 1000.0)
    clock.now = due
    [(_, message)] = engine.step()
    assert [len(o[1]) for o in message[1]] == [1]  # the first token
    # the next step decodes one request holding 101 tokens
    assert engine.next_step_time(due) - due == pytest.approx(PROFILE.predict_ms(1, 0, 0.0, 101) / 1000.0)


def test_a_request_that_ended_does_not_time_the_next_step():
    clock = Clock(0.0)
    engine = engine_with(clock, latency=LatencyModel(profile=PROFILE))
    engine.apply(EngineCoreRequest("short", 10, 1, True))
    engine.apply(EngineCoreRequest("long", 10, 50, True))
    engine.step()
    clock.now = engine.next_step_time(0.0)
    engine.step()  # both first tokens; "short" ends
    # one request (long, 11 tokens) runs on
    assert engine.next_step_time(clock.now) - clock.now == pytest.approx(PROFILE.predict_ms(1, 0, 0.0, 11) / 1000.0)


def test_option_reads_the_file_and_a_bad_one_stops_with_flag_and_file(tmp_path):
    path = tmp_path / "gpu.ini"
    path.write_text(format_profile(PROFILE))
    settings = from_config(parse_config(["--latency-profile", str(path)], env={}))
    assert settings.latency.profile == PROFILE and settings.latency.paced
    bad = tmp_path / "bad.ini"
    bad.write_text("[latency-profile]\nbatch = 1\n")
    with pytest.raises(ConfigError, match=r"--latency-profile.*bad\.ini.*missing key step_ms"):
        parse_config(["--latency-profile", str(bad)], env={})
    with pytest.raises(ConfigError, match=r"--latency-profile.*nowhere\.ini.*cannot read"):
        parse_config(["--latency-profile", str(tmp_path / "nowhere.ini")], env={})


def test_profile_and_linear_figures_together_are_refused(tmp_path):
    path = tmp_path / "gpu.ini"
    path.write_text(format_profile(PROFILE))
    with pytest.raises(ConfigError, match=r"--latency-profile.*--itl-ms \(from command line\).*one or the other"):
        parse_config(["--latency-profile", str(path), "--itl-ms", "5"], env={})
    # the fixed TTFT part and the time scale still apply with a profile
    c = parse_config(["--latency-profile", str(path), "--ttft-ms", "3", "--time-scale", "0.5"], env={})
    assert from_config(c).latency.ttft_ms == 3


def test_a_reload_reads_the_profile_again_and_applies_an_edit(tmp_path):
    from gmock_engine.config import reload

    path = tmp_path / "gpu.ini"
    path.write_text(format_profile(PROFILE))
    argv = ["--latency-profile", str(path)]
    current = parse_config(argv, env={})
    assert reload.check(current, lambda: parse_config(argv, env={})).changes == []
    edited = StepProfile(PROFILE.batch, (4.0, 5.0, 8.0))
    path.write_text(format_profile(edited))
    result = reload.check(current, lambda: parse_config(argv, env={}))
    [change] = result.changes
    assert change.flag == "--latency-profile" and str(path) in str(change) and "sha256" in str(change)
    assert from_config(result.config).latency.profile == edited
    path.write_text("[latency-profile]\nbatch = 1\n")  # broken: refused, nothing changes
    refused = reload.check(current, lambda: parse_config(argv, env={}))
    assert refused.error and "missing key step_ms" in refused.error


def _one_request_with_a_7_ms_input_delay():
    """(time, message) of every message an engine with 2 ms steps and a 7 ms
    input delay sends for one request of 2 tokens that came at 0."""
    slow_input = StepProfile(batch=(1, 2), step_ms=(2.0, 2.0), input_delay_ms=(7.0, 7.0))
    clock = Clock(0.0)
    engine = engine_with(clock, latency=LatencyModel(profile=slow_input))
    engine.apply(EngineCoreRequest("r", 10, 2, True))
    return drive(engine, clock)


def test_the_input_delay_holds_the_first_token_not_the_batch():
    times = sorted({t for t, _ in _one_request_with_a_7_ms_input_delay()})
    # admitted 7 ms after its ADD (it reaches the engine then), prefilled in a 2 ms step,
    # then steps every 2 ms
    assert times[0] == pytest.approx(9.0 / 1000) and times[1] - times[0] == pytest.approx(2.0 / 1000)


def test_queued_is_when_the_request_reaches_the_engine_after_its_input_delay():
    """vLLM records QUEUED when its engine core takes the ADD in: the input
    delay is before it, and a step boundary (the engine takes its input
    between steps) is at or after it."""
    events = [o[7] for o in outputs_of(_one_request_with_a_7_ms_input_delay(), "r") if len(o) > 7 and o[7]]
    [(queued, scheduled)] = [(e[0], e[1]) for e in events]
    assert queued["type"] == 1 and queued["timestamp"] == pytest.approx(7.0 / 1000)
    assert scheduled["type"] == 2 and scheduled["timestamp"] == pytest.approx(7.0 / 1000)


def test_a_request_in_input_delay_joins_the_running_batch_at_a_step_boundary():
    slow_input = StepProfile(batch=(1, 2), step_ms=(4.0, 4.0), input_delay_ms=(5.0, 5.0))
    clock = Clock(0.0)
    engine = engine_with(clock, latency=LatencyModel(profile=slow_input))
    engine.scheduler.latency = LatencyModel(profile=StepProfile(batch=(1, 2), step_ms=(4.0, 4.0)))  # "a" has no delay
    engine.apply(EngineCoreRequest("a", 10, 20, True))
    engine.scheduler.latency = LatencyModel(profile=slow_input)
    engine.apply(EngineCoreRequest("b", 10, 2, True))  # queued at 0, in the engine at 5 ms
    firsts = {}
    for _ in range(20):
        for _, message in engine.step():
            for output in message[1]:
                firsts.setdefault(output[0], clock.now)
        clock.now = engine.next_step_time(clock.now)
    # steps at 0, 4, 8, 12 ms: "b" is admitted in the step at 8 ms, its token at 12 ms
    assert firsts == {"a": pytest.approx(0.004), "b": pytest.approx(0.012)}
