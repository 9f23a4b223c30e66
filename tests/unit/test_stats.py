"""utils/stats.py: nearest-rank percentiles, summaries, and the Samples ring
(its window restart is in test_engine.py)."""

import pytest

from gmock_engine.utils.stats import Samples, percentile, summarize

HUNDRED = [float(v) for v in range(1, 101)]


@pytest.mark.parametrize("q,value", [(0, 1.0), (0.5, 1.0), (50, 50.0), (90, 90.0), (98.5, 99.0), (99.5, 100.0), (100, 100.0)])
def test_percentile_is_the_nearest_rank(q, value):
    assert percentile(HUNDRED, q) == value


# an exact rank k is the k-th value, for odd k too (rounding k + 0.5 half to even would give k + 1)
@pytest.mark.parametrize("values,q,value", [(HUNDRED, 99, 99.0), (HUNDRED, 1, 1.0), (HUNDRED, 7, 7.0), ([1.0, 2.0, 3.0, 4.0], 75, 3.0)])
def test_percentile_at_an_exact_odd_rank(values, q, value):
    assert percentile(values, q) == value


def test_percentile_of_few_values_never_leaves_the_list():
    assert percentile([], 50) == 0.0
    assert [percentile([7.0], q) for q in (0, 50, 100)] == [7.0, 7.0, 7.0]
    # nearest rank: p50 of 4 values is the 2nd, p51 already the 3rd, p99 the last
    four = [1.0, 2.0, 3.0, 4.0]
    assert (percentile(four, 50), percentile(four, 51), percentile(four, 99)) == (2.0, 3.0, 4.0)
    assert percentile(four, -10) == 1.0 and percentile(four, 250) == 4.0  # clamped to the ends


def test_summarize_sorts_and_scales():
    summary = summarize(reversed(HUNDRED), scale=1000.0)  # any iterable, any order
    assert summary == {"count": 100, "p50": 50_000.0, "p99": percentile(HUNDRED, 99) * 1000.0, "max": 100_000.0}
    assert summarize([]) == {"count": 0, "p50": 0.0, "p99": 0.0, "max": 0.0}
    assert summarize([0.003, 0.001, 0.002], 1000.0) == {"count": 3, "p50": 2.0, "p99": 3.0, "max": 3.0}


def test_samples_summarise_what_was_added_with_total():
    samples = Samples(size=8)
    assert samples.summary() == {"count": 0, "p50": 0.0, "p99": 0.0, "max": 0.0, "total": 0}
    for value in (3.0, 1.0, 2.0):
        samples.add(value)
    assert samples.summary(scale=10.0) == {"count": 3, "p50": 20.0, "p99": 30.0, "max": 30.0, "total": 3}


def test_samples_keep_the_most_recent_size_values_in_constant_memory():
    samples = Samples(size=3)
    ring_bytes = samples._ring.buffer_info()[1] * samples._ring.itemsize
    for value in range(10):  # 0..9: the ring ends holding 7, 8, 9
        samples.add(float(value))
    summary = samples.summary()
    assert (summary["count"], summary["p50"], summary["max"], summary["total"]) == (3, 8.0, 9.0, 10)
    assert samples._ring.buffer_info()[1] * samples._ring.itemsize == ring_bytes == 3 * 8
    samples.restart()
    samples.add(0.5)
    summary = samples.summary()
    assert (summary["max"], summary["count"], summary["total"]) == (0.5, 1, 11)  # the old 9.0 is out of the window
