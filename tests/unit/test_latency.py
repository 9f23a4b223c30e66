"""LatencyModel on its own: the arithmetic of a step and a first token, its
jitter and time scale, and when it is paced (tests/unit/test_scheduler.py
covers the same figures as the engine applies them)."""

import dataclasses
import random

import pytest

from gmock_engine.timing.latency import LatencyModel
from gmock_engine.timing.profile import NEW_MAX, NEW_SIZE, STEADY, StepProfile, StepSizes
from gmock_engine.core.sched_output import SchedulerOutput


def rng(seed=0):
    return random.Random(seed)


def test_defaults_are_unpaced_and_instant():
    model = LatencyModel()
    assert model.paced is False
    assert model.step_seconds(running=50, prefill_tokens=1000, rng=rng()) == 0.0
    assert model.first_token_seconds(4096, rng()) == 0.0
    assert model.lora_load_seconds() == 0.0


@pytest.mark.parametrize(
    "kwargs, paced",
    [
        ({"itl_ms": 1}, True),
        ({"itl_ms_per_request": 0.5}, True),
        ({"ttft_ms": 3}, True),
        ({"prefill_ms_per_token": 0.01}, True),
        # neither of these times a step on its own
        ({"jitter": 0.5}, False),
        ({"time_scale": 3.0}, False),
        ({"lora_load_ms": 200}, False),
    ],
)
def test_paced_follows_the_step_and_prefill_figures(kwargs, paced):
    assert LatencyModel(**kwargs).paced is paced


def test_paced_is_not_an_init_argument_and_not_compared():
    with pytest.raises(TypeError):
        LatencyModel(paced=True)  # type: ignore[call-arg]
    assert LatencyModel(itl_ms=5) == LatencyModel(itl_ms=5)
    assert "paced" not in repr(LatencyModel(itl_ms=5))


def test_model_is_frozen():
    model = LatencyModel(itl_ms=5)
    with pytest.raises(Exception):
        model.itl_ms = 6  # type: ignore[misc]


def test_step_seconds_adds_the_fixed_per_request_and_prefill_parts():
    model = LatencyModel(itl_ms=10, itl_ms_per_request=2, prefill_ms_per_token=0.5)
    # 10 + 2*3 + 0.5*40 = 36 ms
    assert model.step_seconds(running=3, prefill_tokens=40, rng=rng()) == pytest.approx(0.036)
    # a step with nothing in it (the queue's head not in yet) takes no time, as a real engine's
    assert model.step_seconds(running=0, prefill_tokens=0, rng=rng()) == 0.0


def test_step_time_reads_the_running_batch_and_prefill_tokens_of_the_plan():
    model = LatencyModel(itl_ms=10, itl_ms_per_request=2, prefill_ms_per_token=0.5)
    plan = SchedulerOutput(num_running_reqs=3, num_decode_tokens=7, num_prefill_tokens=40)
    # decode tokens do not count: only the batch size and the prefilled prompt tokens
    assert model.step_time(plan, rng()) == pytest.approx(0.036)
    assert model.step_time(SchedulerOutput(num_running_reqs=3, num_decode_tokens=500), rng()) == pytest.approx(0.016)
    assert model.step_time(plan, rng()) == model.step_seconds(3, 40, rng())


def test_first_token_is_fixed_part_plus_prefill_per_prompt_token():
    model = LatencyModel(ttft_ms=100, prefill_ms_per_token=2, itl_ms=50, itl_ms_per_request=9)
    assert model.first_token_seconds(10, rng()) == pytest.approx(0.120)
    assert model.first_token_seconds(0, rng()) == pytest.approx(0.100)


def test_first_token_per_request_ttft_replaces_the_fixed_part_only():
    model = LatencyModel(ttft_ms=100, prefill_ms_per_token=2)
    assert model.first_token_seconds(10, rng(), ttft_ms=5) == pytest.approx(0.025)
    # 0 is a value, not "unset"
    assert model.first_token_seconds(10, rng(), ttft_ms=0) == pytest.approx(0.020)
    assert model.first_token_seconds(10, rng(), ttft_ms=None) == pytest.approx(0.120)


def test_time_scale_multiplies_every_duration():
    base = LatencyModel(itl_ms=10, itl_ms_per_request=2, ttft_ms=100, prefill_ms_per_token=1, lora_load_ms=300)
    half = LatencyModel(itl_ms=10, itl_ms_per_request=2, ttft_ms=100, prefill_ms_per_token=1, lora_load_ms=300, time_scale=0.5)
    assert half.step_seconds(4, 16, rng()) == pytest.approx(base.step_seconds(4, 16, rng()) / 2)
    assert half.first_token_seconds(16, rng()) == pytest.approx(base.first_token_seconds(16, rng()) / 2)
    assert half.first_token_seconds(16, rng(), ttft_ms=40) == pytest.approx(0.028)
    assert base.lora_load_seconds() == pytest.approx(0.3)
    assert half.lora_load_seconds() == pytest.approx(0.15)


def test_no_jitter_draws_nothing_from_the_rng():
    model = LatencyModel(itl_ms=10, ttft_ms=10)
    generator = rng(7)
    state = generator.getstate()
    model.step_seconds(2, 3, generator)
    model.first_token_seconds(3, generator)
    assert generator.getstate() == state


def test_jitter_stays_within_its_bounds_and_scales_only_the_fixed_parts():
    model = LatencyModel(itl_ms=10, itl_ms_per_request=5, ttft_ms=100, prefill_ms_per_token=1, jitter=0.2)
    generator = rng(3)
    steps = [model.step_seconds(2, 30, generator) for _ in range(500)]
    firsts = [model.first_token_seconds(30, generator) for _ in range(500)]
    # fixed step part 20 ms in [16, 24], plus 30 ms of prefill not jittered
    assert all(0.046 - 1e-12 <= s <= 0.054 + 1e-12 for s in steps)
    assert all(0.110 - 1e-12 <= f <= 0.150 + 1e-12 for f in firsts)
    # it does vary, across most of the range
    assert max(steps) - min(steps) > 0.006 and max(firsts) - min(firsts) > 0.03
    assert len(set(steps)) > 100


def test_jitter_is_deterministic_per_seed():
    model = LatencyModel(itl_ms=10, ttft_ms=50, jitter=0.3)

    def draws(seed):
        generator = rng(seed)
        return [model.step_seconds(1, 0, generator) for _ in range(20)] + [model.first_token_seconds(5, generator) for _ in range(20)]

    assert draws(11) == draws(11)
    assert draws(11) != draws(12)


def test_jitter_draws_one_number_per_duration():
    model = LatencyModel(itl_ms=10, ttft_ms=50, jitter=0.3)
    generator, reference = rng(5), rng(5)
    model.step_seconds(1, 0, generator)
    reference.random()
    assert generator.getstate() == reference.getstate()
    model.first_token_seconds(1, generator)
    reference.random()
    assert generator.getstate() == reference.getstate()


def test_steps_of_new_sizes_draw_their_spreads():
    profile = StepProfile(batch=(1,), step_ms=(4.0,), prefill_ms_per_token=0.01, spread_new_size=(3.0, 3.0), spread_new_max=(5.0, 5.0))
    model = LatencyModel(profile=profile)
    sizes = StepSizes()
    # a size is the step's prompt tokens plus its decoding requests
    assert model.step_seconds(2, 100, rng(), prefill_reqs=1, sizes=sizes) == pytest.approx(5 * 0.005)  # larger than any before
    assert sizes.seen == {101} and sizes.largest == 101
    assert model.step_seconds(2, 100, rng(), prefill_reqs=1, sizes=sizes) == pytest.approx(0.005)
    assert model.step_seconds(1, 0, rng(), sizes=sizes) == pytest.approx(3 * 0.004)  # size 1: new, not the largest
    assert model.step_seconds(1, 0, rng(), sizes=sizes) == pytest.approx(0.004)
    # without the engine's sizes no step is new; without a new-max spread a new largest size is a new size
    assert model.step_seconds(3, 0, rng()) == pytest.approx(0.004)
    one_set = LatencyModel(profile=dataclasses.replace(profile, spread_new_max=()))
    assert one_set.step_seconds(1, 200, rng(), prefill_reqs=1, sizes=sizes) == pytest.approx(3 * 0.006)
    plain = LatencyModel(profile=dataclasses.replace(profile, spread_new_size=(), spread_new_max=()))
    assert plain.step_seconds(5, 0, rng(), sizes=sizes) == pytest.approx(0.004) and 5 not in sizes.seen


def test_steps_of_new_sizes_add_the_ms_of_their_spread():
    profile = StepProfile(batch=(1,), step_ms=(4.0,), prefill_ms_per_token=0.01, spread_decode=((2.0, 2.0),),
                          spread_new_size_ms=(6.0, 6.0), spread_new_max=(5.0, 5.0))  # fmt: skip
    model = LatencyModel(profile=profile)
    sizes = StepSizes()
    assert model.step_seconds(2, 100, rng(), prefill_reqs=1, sizes=sizes) == pytest.approx(5 * 0.005)  # new largest: its factor
    assert model.step_seconds(1, 0, rng(), sizes=sizes) == pytest.approx(0.004 + 0.006)  # new: 6 ms added, no factor
    assert model.step_seconds(1, 0, rng(), sizes=sizes) == pytest.approx(2 * 0.004)  # run before: the decode spread
    # no new-max spread: a new largest size adds the new sizes' ms; a step never takes less than nothing
    one_set = LatencyModel(profile=dataclasses.replace(profile, spread_new_max=(), spread_new_size_ms=(-50.0, -50.0)))
    assert one_set.step_seconds(1, 200, rng(), prefill_reqs=1, sizes=sizes) == 0.0


def test_step_sizes_tell_new_and_new_largest_sizes_apart():
    sizes = StepSizes()
    assert [sizes.add(n) for n in (4, 4, 2, 9, 2, 5, 9, 10)] == [NEW_MAX, STEADY, NEW_SIZE, NEW_MAX, STEADY, NEW_SIZE, STEADY, NEW_MAX]
