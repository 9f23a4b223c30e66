"""benchmarks/engine_boundary.py: the engine's own figures of a workload's
window, read from a trace of the record tap (synthetic here): each
request's QUEUED to first token and its inter-token times on the engine's
clock, the requests per second, and the twin's verdict."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # a script of the checkout

import engine_boundary  # noqa: E402


def _trace(step_s=0.010, offset=1000.0):
    """Two requests of 3 tokens, the second ADDed while the first decodes;
    the engine's clock is `offset` s from the tap's; one step every `step_s`."""
    records = [
        {"kind": "add", "t": 10.000, "rank": 0, "client": 0, "request_id": "a", "arrival_time": 9.999, "prompt_len": 8, "max_tokens": 3},
        {"kind": "add", "t": 10.011, "rank": 0, "client": 0, "request_id": "b", "arrival_time": 10.010, "prompt_len": 8, "max_tokens": 3},
        {"kind": "add", "t": 99.0, "rank": 0, "client": 0, "request_id": "late", "arrival_time": 99.0, "prompt_len": 8, "max_tokens": 1},
    ]
    plan = [  # (step end on the engine's clock, [(id, tokens, finish, events)])
        (10.001 + step_s, [("a", 1, None, [[1, 1010.001], [2, 1010.001]])]),
        (10.001 + 2 * step_s, [("a", 1, None, None)]),
        (10.001 + 3 * step_s, [("a", 1, 1, None), ("b", 1, None, [[1, 1010.012], [2, 1010.0211]])]),
        (10.001 + 4 * step_s, [("b", 1, None, None)]),
        (10.001 + 5 * step_s, [("b", 1, 1, None)]),
    ]
    for end, items in plan:
        requests = [{"id": i, "tokens": n, "finish_reason": f, **({"events": e} if e else {})} for i, n, f, e in items]
        records.append({"kind": "output", "t": end + 0.0005, "rank": 0, "client": 0, "engine_index": 0,
                        "engine_timestamp": end + offset, "requests": requests,
                        "finished_requests": [i for i, _, f, _ in items if f is not None], "stats": None})
    return records


def test_the_engines_figures_of_a_window():
    f = engine_boundary.figures(_trace(), 9.9, 10.5)
    assert f["requests"] == 2 and f["finished"] == 2  # the late ADD is outside the window
    assert f["ttft"] == pytest.approx([10.0, 19.0])  # QUEUED -> first token: a in its first step, b queued 1 ms into one
    assert f["itl"] == pytest.approx([10.0] * 4)
    assert f["throughput"] == pytest.approx(2 / (10.001 + 0.050 + 0.0005 - 10.000))
    assert f["step"] and all(s == pytest.approx(10.0, abs=0.01) for s in f["step"][1:])


def test_a_twin_meets_its_goals_and_a_slower_one_does_not():
    same = engine_boundary.compare(engine_boundary.figures(_trace(), 9.9, 10.5), engine_boundary.figures(_trace(), 9.9, 10.5))
    assert all(ok for *_, ok in same)
    slower = engine_boundary.compare(engine_boundary.figures(_trace(), 9.9, 10.5),
                                     engine_boundary.figures(_trace(step_s=0.0103), 9.9, 10.5))  # fmt: skip
    misses = {figure for figure, *_, ok in slower if not ok}
    assert {"itl p50", "itl p90", "req/s"} <= misses  # 3 % slower steps
    assert "itl p99" not in misses  # inside its 10 %
