"""The fit on synthetic steps of a known step function outside the profile's
family (super-linear in the prompt tokens, a jump in the batch): the
candidates with a prefill table learn it, held-out error chooses them, and
the report says what a recording lacks (tools/fit_coverage.py)."""

from __future__ import annotations

import random

from gmock_engine.tools import fit as fitting
from gmock_engine.tools.fit_coverage import coverage
from gmock_engine.tools.fit_models import fine_points, predict, prefill_points
from gmock_engine.tools.steps import Step

BUDGET = 2048


def true_ms(decodes, chunks, context):
    """The reference's step: a jump of 3 ms above 8 requests, prompt tokens
    priced with a square term (no attention term in the profile's sense:
    the square is of the step's prompt tokens together)."""
    batch = decodes + len(chunks)
    tokens = sum(c for c, _ in chunks)
    return 10.0 + 0.2 * batch + (3.0 if batch > 8 else 0.0) + 0.01 * tokens + 1.2e-5 * tokens * tokens \
        + 0.6 * len(chunks) + 0.3 * context / 1000.0  # fmt: skip


def synthetic_steps(seed=0, noise=0.01, prefills=True, budget=BUDGET):
    """Steps as a calibration sweep records them: runs of decode steps at
    every batch 1..16 with a growing context, prompts alone from 16 tokens
    to beyond the budget (chunked), prompt chunks beside decodes; each
    step's time the true one times 1 +- `noise`."""
    rng = random.Random(seed)
    steps = []
    t = 0.0

    def add(decodes, chunks, context, woke=False):
        nonlocal t
        ms = true_ms(decodes, chunks, context) * (1.0 + rng.uniform(-noise, noise))
        attention = sum(c * (p + c / 2.0) for c, p in chunks)
        steps.append(Step(0, t, t + ms / 1000.0, decodes + len(chunks), decodes, sum(c for c, _ in chunks),
                          attention, context, woke))  # fmt: skip
        t += ms / 1000.0 + (0.05 if woke else 0.0)

    for _ in range(2):
        for batch in range(1, 17):
            context = batch * 200
            for _ in range(24):
                add(batch, [], context)
                context += batch
    if prefills:
        for prompt in (16, 64, 256, 512, 1024, 1536, 2047, 3072, 5120):
            for _ in range(4):
                done = 0
                while done < prompt:
                    c = min(budget, prompt - done)
                    add(0, [(c, done)], done + c, woke=done == 0)
                    done += c
        for _ in range(300):
            decodes = rng.randint(1, 15)
            c = int(16 * (budget / 16) ** rng.random())
            c = min(c, budget - decodes)
            add(decodes, [(c, 0)], decodes * 300 + c)
    return steps


def _cv_error(name, steps):
    candidate = next(c for c in fitting.CANDIDATES if c.name == name)
    errors = fitting.cross_validate(candidate, steps, 5)
    return sum(abs(e) for e in errors) / len(errors)


def test_a_prefill_table_learns_a_super_linear_prefill_and_a_jump_in_the_batch():
    steps = synthetic_steps()
    result = fitting.fit(steps, max_num_batched_tokens=BUDGET)
    assert result.chosen in ("table+prefill", "fine+prefill"), result.report
    profile = result.profile
    # the long prefills and the full batches the linear forms miss: within 3 % of the truth
    for decodes, chunks, context in (
        (0, [(2048, 0)], 2048), (0, [(512, 0)], 512), (0, [(1024, 2048)], 3072),
        (12, [(1000, 0)], 4600), (4, [(64, 0)], 1264), (9, [], 2700), (16, [], 6000), (3, [], 900),
    ):  # fmt: skip
        step = Step(0, 0.0, 0.0, decodes + len(chunks), decodes, sum(c for c, _ in chunks),
                    sum(c * (p + c / 2.0) for c, p in chunks), context, False)  # fmt: skip
        truth = true_ms(decodes, chunks, context)
        assert abs(predict(profile, step) - truth) / truth < 0.03, (decodes, chunks, predict(profile, step), truth)


def test_held_out_error_prefers_the_prefill_table_to_the_linear_forms():
    steps = [s for s in fitting._usable(synthetic_steps(seed=1))]
    new = min(_cv_error("table+prefill", steps), _cv_error("fine+prefill", steps))
    old = min(_cv_error(name, steps) for name in ("linear", "linear+attention", "table"))
    # contiguous folds: a fold may hold all of the longest prompts, which the others then extrapolate
    assert new < 0.03, new
    assert old > 2.0 * new, (old, new)


def test_the_fine_table_has_a_point_at_every_supported_batch_and_catches_a_jump():
    steps = synthetic_steps(prefills=False)
    assert fine_points(steps) == tuple(range(1, 17))
    result = fitting.fit(steps, model="fine+prefill")
    below, above = (Step(0, 0.0, 0.0, b, b, 0, 0.0, 2000, False) for b in (8, 9))
    jump = predict(result.profile, above) - predict(result.profile, below)
    assert 2.9 < jump < 3.5, jump  # 3 ms and 0.2 for the request, not smoothed over 8..16


def test_prefill_points_double_where_supported_and_reach_the_longest():
    steps = synthetic_steps()
    points = prefill_points(steps)
    assert points[0] == 32 and all(b == 2 * a for a, b in zip(points, points[1:-1])), points
    assert points[-1] == max(s.prefill_tokens for s in steps) == BUDGET
    assert prefill_points([s for s in steps if not s.prefill_tokens]) == ()


def test_the_report_says_what_a_decode_only_recording_lacks():
    steps = synthetic_steps(prefills=False)
    lines = coverage(steps, BUDGET, decode_runs=32)
    text = "\n".join(lines)
    assert f"only 0 of {len(steps)} steps held a prefill" in text
    assert "0 steps with 1 024 prefill tokens or more" in text
    assert "0 steps at the token budget (2 048)" in text
    assert "0 steps with a prefill beside 8 decodes or more" in text
    assert "0 steps on an idle engine" in text
    assert "runs of back-to-back decode steps" not in text  # 32 runs: the context is covered


def test_the_report_says_a_calibration_sweep_lacks_nothing():
    steps = synthetic_steps()
    lines = coverage(steps, BUDGET, decode_runs=32)
    assert lines[-1] == "coverage: every kind of step the fit needs is in the trace", lines
    assert "longest 2 048 tokens" in lines[0] and "most decodes 15" in lines[0], lines[0]
    # without the budget no chunked-prefill line; a few runs: the context line
    lines = coverage(steps, None, decode_runs=1)
    assert any("1 runs of back-to-back decode steps" in line for line in lines), lines
    assert not any("token budget" in line for line in lines), lines


def test_the_fit_report_holds_the_coverage_section():
    result = fitting.fit(synthetic_steps(prefills=False), max_num_batched_tokens=BUDGET)
    assert any(line.startswith("coverage: the trace lacks") for line in result.report), result.report


def _sweep_top_sparse(seed, noise=0.01):
    """Decode steps as a closed-loop sweep up to 16 concurrent records them:
    few steps at 13-15 requests (the loop passes through them as it drains)."""
    rng = random.Random(seed)
    steps, t = [], 0.0
    for _ in range(2):
        for batch in range(1, 17):
            context = batch * 200
            for _ in range(8 if batch in (13, 14, 15) else 24):
                ms = true_ms(batch, [], context) * (1.0 + rng.uniform(-noise, noise))
                steps.append(Step(0, t, t + ms / 1000.0, batch, batch, 0, 0.0, context, False))
                t += ms / 1000.0
                context += batch
    return steps


def test_a_fine_table_extends_beyond_its_largest_batch_on_the_slope_of_its_upper_half():
    """A load beyond the calibration's concurrency (Poisson arrivals that
    queue up) runs batches larger than any the fit saw: the fine table's
    last segment, between two neighbouring sizes, would carry their noise
    into all of them (6 % off at 32 requests for one of these seeds), and
    the jump above 8 requests must not steepen the tail either
    (fit_models.with_tail)."""
    profiles = [fitting.fit(_sweep_top_sparse(seed), model="fine+prefill").profile for seed in range(12)]
    for seed, profile in enumerate(profiles):
        for batch in (24, 32):
            step = Step(0, 0.0, 0.0, batch, batch, 0, 0.0, 300 * batch, False)
            truth = true_ms(batch, [], 300 * batch)
            assert abs(predict(profile, step) - truth) / truth < 0.04, (seed, batch, predict(profile, step), truth)
    assert all(profile.batch[-2:] == (16, 32) for profile in profiles)
