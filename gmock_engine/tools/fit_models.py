"""The candidate step-time models of the fit (tools/fit.py), and the
numerics they share with it: the model forms (`linear`,
`linear+attention`, `table`, `table+prefill`, `fine+prefill`), non-negative least squares, a profile's
prediction of a recorded step, and quantiles. Pure.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

from gmock_engine.timing.profile import StepProfile
from gmock_engine.tools.steps import Step


#: Steps shorter than this (ms) are not steps of a model's forward pass
#: (e.g. a stats-only message right after another): left out of the fit.
MIN_STEP_MS = 0.05


@dataclass(frozen=True)
class Model:
    """A model form made for a set of steps: the features of a step and
    the profile from fitted coefficients. `context` is the index of the
    feature of the context held, if the form has one: its coefficient is
    not fitted with the others but taken from within runs of steps
    (context_slope)."""

    features: Callable[[Step], List[float]]
    profile: Callable[[Sequence[float]], StepProfile]
    context: Optional[int] = None


@dataclass(frozen=True)
class Candidate:
    """A model form by name; `make` shapes it to the steps it is fitted to
    (the table's points go where those steps are)."""

    name: str
    make: Callable[[Sequence[Step]], Model]


#: A point of the table needs this many steps with a batch near it (from
#: half to twice its size); beyond the last such point the table extends
#: its last segment.
MIN_POINT_SUPPORT = 8


def table_points(steps: Sequence[Step]) -> Tuple[int, ...]:
    """Batch sizes 1, 2, 4, … that the steps support (at least two)."""
    batches = sorted(s.batch for s in steps)
    points = [1, 2]
    while True:
        nxt = points[-1] * 2
        lo, hi = bisect_left(batches, nxt // 2 + 1), bisect_right(batches, nxt * 2)
        if hi - lo < MIN_POINT_SUPPORT or bisect_left(batches, nxt) >= len(batches):
            return tuple(points)
        points.append(nxt)


#: The tail point (with_tail): the table's points from this share of its
#: largest batch up set the slope beyond it, when there are TAIL_POINTS.
TAIL_FROM = 0.5
TAIL_POINTS = 3


def with_tail(knots: Sequence[int], step_ms: Sequence[float]) -> Tuple[Tuple[int, ...], Tuple[float, ...]]:
    """The batch table `knots` -> `step_ms` with one more point, at twice its
    largest batch, on the Theil-Sen line (the median of the slopes between
    pairs of points, and the median intercept) through its points from
    TAIL_FROM of that batch up (at least TAIL_POINTS of them; else the table
    as it is). A profile extends its last segment beyond its last point
    (StepProfile.batch_ms); between two neighbouring batch sizes of a fine
    table that slope carries the noise of both into every larger batch the
    engine runs (a Poisson load beyond the calibration's concurrency). A
    median line is neither moved by one point's noise nor by a jump between
    two sizes (a GPU kernel's tile) that a least-squares line would spread
    over the whole tail. Never below the last point: a step does not get
    shorter with more requests."""
    xs = [(k, v) for k, v in zip(knots, step_ms) if k >= TAIL_FROM * knots[-1]]
    if len(xs) < TAIL_POINTS:
        return tuple(knots), tuple(step_ms)
    slope = max(0.0, quantile(sorted((b - a) / (j - i) for n, (i, a) in enumerate(xs) for j, b in xs[n + 1 :]), 0.5))
    intercept = quantile(sorted(v - slope * k for k, v in xs), 0.5)
    last = knots[-1]
    return (*knots, 2 * last), (*step_ms, max(step_ms[-1], intercept + slope * 2 * last))


def _hats(knots: Sequence[int], batch: int) -> List[float]:
    """Weights of the table's points for `batch` (linear interpolation,
    extended beyond the ends as StepProfile.batch_ms does)."""
    n = len(knots)
    row = [0.0] * n
    i = 0
    while i < n - 2 and batch >= knots[i + 1]:
        i += 1
    w = (batch - knots[i]) / (knots[i + 1] - knots[i])
    row[i] = 1.0 - w
    row[i + 1] = w
    return row


def _linear(c: Sequence[float], attention: float = 0.0, context: float = 0.0, per_request: float = 0.0) -> StepProfile:
    return StepProfile(
        batch=(1, 2),
        step_ms=(c[0] + c[1], c[0] + 2 * c[1]),
        prefill_ms_per_token=c[2],
        prefill_attention_ms=attention,
        prefill_ms_per_request=per_request,
        context_ms_per_ktoken=context,
    )


def _terms(s: Step) -> List[float]:
    """The features beside the batch's: prefill tokens, their attention,
    the requests prefilling, the context held."""
    return [float(s.prefill_tokens), s.prefill_attention / 1000.0, float(s.prefill_reqs), s.context_tokens / 1000.0]


def _table(steps: Sequence[Step]) -> Model:
    knots = table_points(steps)
    n = len(knots)
    return Model(
        lambda s: _hats(knots, s.batch) + _terms(s),
        lambda c: StepProfile(
            *with_tail(knots, c[:n]),
            prefill_ms_per_token=c[n],
            prefill_attention_ms=c[n + 1],
            prefill_ms_per_request=c[n + 2],
            context_ms_per_ktoken=c[n + 3],
        ),
        context=n + 3,
    )


#: A point of the prefill table (prefill_points) needs this many steps whose
#: prompt tokens are near it (from half to twice it).
MIN_PREFILL_SUPPORT = 8
#: The prefill table's first point, in prompt tokens (from 0 ms at 0 tokens).
FIRST_PREFILL_POINT = 32


def prefill_points(steps: Sequence[Step]) -> Tuple[int, ...]:
    """The points of a table of what a step's prompt tokens add (a long
    prompt's arithmetic grows faster than its tokens, on a GPU once it no
    longer hides behind the weights' reading): token counts 32, 64, 128, …,
    each kept when MIN_PREFILL_SUPPORT steps lie between the point kept
    before it (or 0) and it, so that every segment of the table rests on
    steps of its own; and the largest count when that many steps lie beyond
    the last point and it is well beyond it."""
    tokens = sorted(s.prefill_tokens for s in steps if s.prefill_tokens)
    points: List[int] = []
    k = FIRST_PREFILL_POINT
    while tokens and k < 2 * tokens[-1]:
        lo = bisect_right(tokens, points[-1]) if points else 0
        if bisect_right(tokens, k) - lo >= MIN_PREFILL_SUPPORT:
            points.append(k)
        k *= 2
    beyond = len(tokens) - bisect_right(tokens, points[-1]) if points else len(tokens)
    if tokens and beyond >= MIN_PREFILL_SUPPORT and (not points or tokens[-1] >= 1.25 * points[-1]):
        points.append(tokens[-1])
    return tuple(points)


def _prefill_hats(points: Sequence[int], tokens: int) -> List[float]:
    """Weights of the prefill table's points for `tokens` prompt tokens (0 ms
    at 0 tokens, linear between points, the last segment extended beyond the
    last point: StepProfile.prefill_tokens_ms)."""
    if not tokens or not points:
        return [0.0] * len(points)
    return _hats((0,) + tuple(points), tokens)[1:]


#: The fine table keeps every batch size up to this one that the steps support, doubling beyond.
FINE_UP_TO = 32


def fine_points(steps: Sequence[Step]) -> Tuple[int, ...]:
    """Every batch size up to FINE_UP_TO with MIN_POINT_SUPPORT steps of
    exactly that size (1 and 2 always), then table_points' doubling: a
    step's time may jump between two batch sizes (a GPU kernel's tile, a
    CUDA graph's size), which points 8 and 16 apart smooth over."""
    counts: dict = {}
    for s in steps:
        counts[s.batch] = counts.get(s.batch, 0) + 1
    points = [b for b in sorted(counts) if b <= FINE_UP_TO and counts[b] >= MIN_POINT_SUPPORT and b > 2]
    points = [1, 2] + points
    points += [b for b in table_points(steps) if b > points[-1]]
    return tuple(points)


def _tables(batch_points: Callable[[Sequence[Step]], Tuple[int, ...]]) -> Callable[[Sequence[Step]], Model]:
    """A form with a table over the batch at `batch_points` and a table over
    the prompt tokens (prefill_points), plus attention, prefilling requests
    and context."""

    def make(steps: Sequence[Step]) -> Model:
        knots, pknots = batch_points(steps), prefill_points(steps)
        n, m = len(knots), len(pknots)
        return Model(
            lambda s: _hats(knots, s.batch) + _prefill_hats(pknots, s.prefill_tokens) + _terms(s)[1:],
            lambda c: StepProfile(
                *with_tail(knots, c[:n]),
                prefill_tokens=pknots,
                prefill_ms=tuple(c[n : n + m]),
                prefill_attention_ms=c[n + m],
                prefill_ms_per_request=c[n + m + 1],
                context_ms_per_ktoken=c[n + m + 2],
            ),
            context=n + m + 2,
        )

    return make


CANDIDATES = (
    Candidate("linear", lambda _: Model(lambda s: [1.0, float(s.batch), float(s.prefill_tokens)], _linear)),
    Candidate(
        "linear+attention",
        lambda _: Model(lambda s: [1.0, float(s.batch)] + _terms(s), lambda c: _linear(c, c[3], c[5], c[4]), context=5),
    ),
    Candidate("table", _table),
    Candidate("table+prefill", _tables(table_points)),
    Candidate("fine+prefill", _tables(fine_points)),
)


def nnls(rows: Sequence[Sequence[float]], ys: Sequence[float], weights: Sequence[float], sweeps: int = 3000) -> List[float]:
    """Weighted least squares with every coefficient >= 0 (coordinate descent
    on the normal equations; the problems here have a handful of columns).
    A column that is zero in every row gets 0."""
    p = len(rows[0])
    g = [[0.0] * p for _ in range(p)]
    b = [0.0] * p
    for row, y, w in zip(rows, ys, weights):
        for i in range(p):
            ri = row[i] * w
            if ri:
                b[i] += ri * y
                gi = g[i]
                for j in range(p):
                    gi[j] += ri * row[j]
    x = [0.0] * p
    for _ in range(sweeps):
        change = 0.0
        for j in range(p):
            if g[j][j] <= 0.0:
                continue
            gx = sum(g[j][k] * x[k] for k in range(p))
            new = max(0.0, x[j] + (b[j] - gx) / g[j][j])
            change = max(change, abs(new - x[j]))
            x[j] = new
        if change < 1e-12:
            break
    return x


def _usable(steps: Sequence[Step]) -> List[Step]:
    return [s for s in steps if s.duration_ms >= MIN_STEP_MS and s.batch > 0]


def predict(profile: StepProfile, step: Step) -> float:
    """The profile's step time for a recorded step, ms (before its spread)."""
    return profile.predict_ms(step.batch, step.prefill_tokens, step.prefill_attention, step.context_tokens, step.prefill_reqs)


def relative_errors(profile: StepProfile, steps: Sequence[Step]) -> List[float]:
    """(predicted - measured) / measured per step."""
    return [(predict(profile, s) - s.duration_ms) / s.duration_ms for s in steps]


def quantile(sorted_values: Sequence[float], q: float) -> float:
    """Linear-interpolated quantile of an ascending list."""
    if not sorted_values:
        return math.nan
    x = q * (len(sorted_values) - 1)
    i = int(x)
    if i >= len(sorted_values) - 1:
        return sorted_values[-1]
    return sorted_values[i] + (sorted_values[i + 1] - sorted_values[i]) * (x - i)


def summary(errors: Sequence[float]) -> str:
    """Mean |error|, its median and p90, and the bias, in %."""
    if not errors:
        return "no steps"
    a = sorted(abs(e) for e in errors)
    mean = sum(a) / len(a)
    bias = sum(errors) / len(errors)
    return f"mean |err| {100 * mean:5.1f} %  median {100 * quantile(a, 0.5):5.1f} %  p90 {100 * quantile(a, 0.9):5.1f} %  bias {100 * bias:+5.1f} %"
