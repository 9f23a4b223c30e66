"""benchmarks/fidelity_stats.py: histogram quantiles from /metrics scrapes and the comparison table."""

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # a script of the checkout

import fidelity_stats as fs  # noqa: E402

SCRAPE_BEFORE = """\
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_sum{engine="0",model_name="mock"} 1.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.01",model_name="mock"} 2.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.02",model_name="mock"} 4.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.04",model_name="mock"} 4.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="mock"} 4.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="mock"} 4.0
"""
# 10 more observations on engine 0 (4 in (0, 10 ms], 6 in (10, 20 ms]), 10 on engine 1 (all in (20, 40 ms])
SCRAPE_AFTER = """\
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.01",model_name="mock"} 6.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.02",model_name="mock"} 14.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.04",model_name="mock"} 14.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="mock"} 14.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="0.01",model_name="mock"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="0.02",model_name="mock"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="0.04",model_name="mock"} 10.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="+Inf",model_name="mock"} 10.0
vllm:time_to_first_token_seconds_created{engine="0",model_name="mock"} 1.7e9
"""


def test_histogram_sums_series_and_delta_counts_only_the_window():
    after = fs.histogram(SCRAPE_AFTER, "vllm:time_to_first_token_seconds")
    assert after == {0.01: 6.0, 0.02: 14.0, 0.04: 24.0, math.inf: 24.0}
    observed = fs.delta(fs.histogram(SCRAPE_BEFORE, "vllm:time_to_first_token_seconds"), after)
    assert observed == {0.01: 4.0, 0.02: 10.0, 0.04: 20.0, math.inf: 20.0}
    assert fs.histogram(SCRAPE_AFTER, "vllm:inter_token_latency_seconds") == {}


def test_quantile_interpolates_inside_the_bucket_like_histogram_quantile():
    buckets = {0.01: 4.0, 0.02: 10.0, 0.04: 20.0, math.inf: 20.0}
    assert fs.quantile(buckets, 0.2) == pytest.approx(0.01)  # rank 4: the top of the first bucket
    assert fs.quantile(buckets, 0.1) == pytest.approx(0.005)  # rank 2 of 4 in (0, 10 ms]
    assert fs.quantile(buckets, 0.5) == pytest.approx(0.02)
    assert fs.quantile(buckets, 0.75) == pytest.approx(0.03)  # rank 15: half-way through (20, 40 ms]
    assert fs.quantile({0.01: 1.0, math.inf: 3.0}, 0.9) == 0.01  # in +Inf: the highest finite bound
    assert fs.quantile({0.01: 0.0, math.inf: 0.0}, 0.5) is None
    assert fs.quantile({}, 0.5) is None


def test_histogram_figures_in_ms():
    figures = fs.histogram_figures(SCRAPE_BEFORE, SCRAPE_AFTER)
    assert figures["metrics_ttft_count"] == 20.0
    assert figures["metrics_ttft_p50_ms"] == pytest.approx(20.0)
    assert figures["metrics_ttft_p90_ms"] == pytest.approx(36.0)
    assert figures["metrics_itl_p50_ms"] is None and figures["metrics_itl_count"] == 0.0


def test_fine_buckets_are_geometric_and_cover_the_range():
    bounds = fs.fine_buckets(0.001, 1.0, 1.1)
    assert bounds[0] == 0.001 and bounds[-1] >= 1.0
    assert all(b / a == pytest.approx(1.1, rel=1e-4) for a, b in zip(bounds, bounds[1:]))


def test_goals_spread_and_verdict():
    assert fs.goal_for("p50_ttft_ms") == 0.05 and fs.goal_for("metrics_itl_p99_ms") == 0.15
    assert fs.goal_for("request_throughput") == 0.03
    assert fs.spread([10.0, 12.0]) == pytest.approx(2 / 11)
    assert fs.spread([10.0]) is None
    assert fs.verdict([10.0, 10.0], 10.4, "p50_itl_ms") == (pytest.approx(0.04), True)
    assert fs.verdict([10.0, 10.0], 10.6, "p50_itl_ms") == (pytest.approx(0.06), False)
    # outside the goal but inside the real runs' own range
    assert fs.verdict([10.0, 12.0], 11.8, "p50_itl_ms")[1] is True
    assert fs.verdict([10.0, 10.0], 11.4, "p99_itl_ms")[1] is True
    assert fs.verdict([10.0], None, "p50_itl_ms") == (None, False)


def test_compare_table_rows_and_misses():
    real = [{"w": {"p50_ttft_ms": 10.0, "request_throughput": 4.0}}, {"w": {"p50_ttft_ms": 11.0, "request_throughput": 4.0}}]
    mock = {"w": {"p50_ttft_ms": 10.2, "request_throughput": 3.0}}
    table, misses = fs.compare_table(real, [mock], ["w"])
    lines = table.splitlines()
    assert lines[0].startswith("| workload | metric | real 1 | real 2 | spread | mock | error | ok |")
    ttft = next(line for line in lines if "| TTFT p50 |" in line)
    assert "| 10 | 11 |" in ttft and "| 9.5 % |" in ttft and "| yes |" in ttft
    rps = next(line for line in lines if "| req/s |" in line)
    assert "| -25.0 % | **no** |" in rps
    assert misses == ["w req/s: -25.0 % (goal ±3 %)"]
    # metrics nobody measured leave no row; without a mock there is no verdict
    assert not any("ITL" in line for line in lines)
    table, misses = fs.compare_table(real, None, ["w"])
    assert misses == [] and "| yes |" not in table


def test_compare_table_takes_the_mean_of_several_mock_runs_and_shows_their_spread():
    real = [{"w": {"p50_ttft_ms": 10.0}}, {"w": {"p50_ttft_ms": 10.0}}]
    mocks = [{"w": {"p50_ttft_ms": 9.0}}, {"w": {"p50_ttft_ms": 11.4}}]
    table, misses = fs.compare_table(real, mocks, ["w"])
    lines = table.splitlines()
    assert lines[0].startswith("| workload | metric | real 1 | real 2 | spread | mock | mock spread | error | ok |")
    ttft = next(line for line in lines if "| TTFT p50 |" in line)
    assert "| 10.2 | 23.5 % | +2.0 % | yes |" in ttft, ttft  # (9.0 + 11.4) / 2 against 10
    assert misses == []


def test_ttft_parts_splits_frontend_and_engine_time():
    """Medians over the window's requests; a request outside the window or
    without a token is left out; QUEUED comes from the first events."""
    records = [
        {"kind": "add", "t": 10.010, "request_id": "a", "arrival_time": 10.000},
        {"kind": "add", "t": 10.030, "request_id": "b", "arrival_time": 10.026},
        {"kind": "add", "t": 10.040, "request_id": "c", "arrival_time": 10.039},  # never gets a token
        {"kind": "add", "t": 99.0, "request_id": "late", "arrival_time": 98.0},  # outside the window
        {"kind": "output", "t": 10.050, "engine_timestamp": 5.040,
         "requests": [{"id": "a", "events": [[1, 5.015], [2, 5.016]]}]},
        {"kind": "output", "t": 10.070, "engine_timestamp": 5.060,
         "requests": [{"id": "a", "events": []}, {"id": "b", "events": [[1, 5.040]]}]},
        {"kind": "output", "t": 99.5, "engine_timestamp": 94.0, "requests": [{"id": "late", "events": [[1, 93.0]]}]},
    ]
    parts = fs.ttft_parts(records, 10.0, 11.0)
    assert parts["requests"] == 2
    assert parts["frontend"] == pytest.approx((10 + 4) / 2)  # a: 10 ms, b: 4 ms
    assert parts["engine"] == pytest.approx((40 + 40) / 2)  # a: 10.050 - 10.010, b: 10.070 - 10.030
    assert parts["queued_to_first"] == pytest.approx((25 + 20) / 2)
    assert fs.ttft_parts(records, 50.0, 60.0)["frontend"] is None
