"""content/lengths.py: parsing `--output-len-dist`, what each kind draws, and the
choice between it and `--eos-probability` (the ranges of every kind, the
geometric mean and a few bad specs are in test_stops.py)."""

import random

import pytest

from gmock_engine.content.lengths import KINDS, OutputLengths, from_config


@pytest.mark.parametrize(
    "spec,kind,params",
    [
        ("fixed:128", "fixed", (128.0,)),
        ("  uniform:16:256 ", "uniform", (16.0, 256.0)),
        ("uniform:5:5", "uniform", (5.0, 5.0)),
        ("normal:200:0", "normal", (200.0, 0.0)),
        ("normal:0:10", "normal", (0.0, 10.0)),
        ("exponential:1", "exponential", (1.0,)),
        ("fixed:1e2", "fixed", (100.0,)),
    ],
)
def test_parse_keeps_kind_and_numbers(spec, kind, params):
    dist = OutputLengths.parse(spec)
    assert (dist.kind, dist.params) == (kind, params)
    assert dist == OutputLengths(kind, params)  # a value: equal specs are equal


@pytest.mark.parametrize(
    "spec,words",
    [
        ("poisson:3", ["kind must be one of", ", ".join(KINDS)]),
        ("", ["kind must be one of"]),
        ("uniform:1:2:3", ["uniform takes 2 parameter(s)", "uniform:16:256"]),
        ("exponential", ["exponential takes 1 parameter(s)", "exponential:150"]),
        ("normal:a:1", ["parameters must be numbers"]),
        ("fixed:-3", ["must be positive"]),
        ("fixed:0.5", ["lengths >= 1"]),
        ("normal:10:-1", ["must be positive"]),
        ("uniform:nan:3", ["must be positive"]),
        ("uniform:0:nan", ["must be positive"]),
        ("uniform:10:2", ["MIN is larger than MAX"]),
    ],
)
def test_bad_specs_say_what_is_wrong(spec, words):
    with pytest.raises(ValueError) as info:
        OutputLengths.parse(spec)
    message = str(info.value)
    assert repr(spec) in message
    for word in words:
        assert word in message


def _draws(dist, seed, n=500):
    rng = random.Random(seed)
    return [dist.draw(rng) for _ in range(n)]


@pytest.mark.parametrize("spec", ["uniform:1:1000", "normal:100:40", "exponential:50", "eos:0.1"])
def test_draws_are_deterministic_per_seed_and_differ_between_seeds(spec):
    dist = OutputLengths.eos(0.1) if spec.startswith("eos") else OutputLengths.parse(spec)
    first = _draws(dist, 3)
    assert _draws(dist, 3) == first
    assert _draws(dist, 4) != first
    assert len(set(first)) > 20 and all(isinstance(n, int) and n >= 1 for n in first)


def test_uniform_reaches_both_bounds_and_no_further():
    draws = _draws(OutputLengths.parse("uniform:3:6"), 0, 4000)
    assert set(draws) == {3, 4, 5, 6}


def test_fixed_rounds_to_the_nearest_length():
    rng = random.Random(0)
    assert {OutputLengths.parse("fixed:2.6").draw(rng) for _ in range(20)} == {3}
    assert {OutputLengths.parse("fixed:1").draw(rng) for _ in range(20)} == {1}


def test_lengths_below_one_are_raised_to_one():
    # a normal around 0 draws mostly negative values, an exponential of mean 1 many below 0.5
    assert min(_draws(OutputLengths.parse("normal:0:10"), 1)) == 1
    assert min(_draws(OutputLengths.parse("normal:0:0"), 1)) == max(_draws(OutputLengths.parse("normal:0:0"), 1)) == 1
    assert min(_draws(OutputLengths.parse("exponential:1"), 1)) == 1


def test_normal_centres_on_its_mean():
    draws = _draws(OutputLengths.parse("normal:200:20"), 5, 4000)
    assert 198 < sum(draws) / len(draws) < 202
    assert _draws(OutputLengths.parse("normal:77:0"), 5, 50) == [77] * 50


def test_exponential_has_its_mean():
    draws = _draws(OutputLengths.parse("exponential:10"), 6, 20000)
    assert 9.7 < sum(draws) / len(draws) < 10.4  # (rounding and lengths >= 1 add a few hundredths)


def test_eos_probability_one_ends_at_the_first_token_and_small_ones_run_long():
    assert set(_draws(OutputLengths.eos(1.0), 0, 100)) == {1}
    assert set(_draws(OutputLengths.eos(1.5), 0, 10)) == {1}
    draws = _draws(OutputLengths.eos(0.5), 7, 20000)
    # geometric with p = 0.5: P(1) = 1/2, P(2) = 1/4
    assert 0.48 < draws.count(1) / len(draws) < 0.52 and 0.23 < draws.count(2) / len(draws) < 0.27
    assert max(_draws(OutputLengths.eos(0.001), 7, 200)) > 1000


def test_from_config_prefers_the_distribution_and_checks_it():
    assert from_config("fixed:9", 0.5) == OutputLengths("fixed", (9.0,))
    assert from_config("", 0.25) == OutputLengths.eos(0.25) == OutputLengths("eos", (0.25,))
    assert from_config(None, 0.0) is None and from_config("", -1.0) is None
    with pytest.raises(ValueError, match="kind must be one of"):
        from_config("zipf:2", 0.0)
