"""`./run.sh fit TRACE... -o profile.ini`: a step-time profile from recorded traces.

Reads the steps of a real engine from traces of the record tap (steps.py),
fits candidate step-time models to them, picks the one that predicts best
on held-out steps (k-fold cross-validation over contiguous blocks of steps,
so that a fold is a stretch of time the model has not seen), prints every
candidate's error and the chosen one's residuals, and writes the chosen
one as a profile the engine reads with `--latency-profile`
(timing/profile.py; docs/latency-profile.md).

The candidates (all non-negative least squares on the step time, weighted
by 1/time² so that every step counts by its relative error, and made robust
by Huber's reweighting: fit_candidate):

* `linear`: a + b·batch + c·prefill tokens, the form of the hand-set
  flags (--itl-ms, --itl-ms-per-request, --prefill-ms-per-token);
* `linear+attention`: that, plus the prompt's attention (Σ c·(p + c/2)),
  the requests prefilling (what a prompt costs beyond its tokens) and the
  context the batch holds;
* `table`: a step time per batch size, linear between points at 1, 2, 4, 8,
  … as far as the steps reach (the non-linear growth with the batch), plus
  the four other terms.

The context term of the last two is not fitted with the others: its
coefficient is the slope of the step time within runs of back-to-back
decode steps of one batch (context_slope), where nothing but the context
changes; the other coefficients are fitted to what it leaves.

The spread around the chosen model (measured / predicted) goes into the
profile as quantiles, the engine draws each step's factor from them: for
steps that only decode one set per bin of the batch (none, or bins that
double or grow fourfold), for steps that prefill one set per bin of the
prompt tokens they compute (none, 2 or 3 of equal counts, or bins that
double or grow fourfold). Each kind's
bins are chosen by the mean pinball loss at SCORED_QUANTILES of its
held-out steps (interleaved folds: the model's prediction times the
spread of the other steps).

The steps of sizes the engine had not run before (steps.py `novelty`) are
priced with the others or apart (the chosen form refitted without them,
and a spread of their own), by the same held-out pinball loss
(novelty_apart); apart, the steps larger than any before get a spread of
their own too when a rank test says they took longer; each of those
spreads holds factors of the prediction or ms added to it, whichever the
held-out pinball loss of its steps prefers (fit_novelty_spreads).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence, Tuple

from gmock_engine.config.loader import ENV_PREFIX, FIT_SECTION, ConfigError, ini_reader, new_parser, parse_tool_config
from gmock_engine.timing.profile import NEW_MAX, NEW_SIZE, STEADY, StepProfile, format_profile, spread_time
from gmock_engine.config.option import Group, Option, add_groups
from gmock_engine.config.validators import choice, int_at_least, nonempty
from gmock_engine.timing.trace import TraceFormatError, read_trace
from gmock_engine.tools.steps import Step, input_delays_ms, schedules_ahead, scheduling_lags, steps_from_trace

#: Steps shorter than this (ms) are not steps of a model's forward pass
#: (e.g. a stats-only message right after another): left out of the fit.
MIN_STEP_MS = 0.05
#: Quantiles of the spread written to the profile (evenly spaced, 0..1):
#: 1 % apart, so that the 1 % of draws between the two top points is as
#: wide as the data's top 1 %.
SPREAD_POINTS = 101
#: The top point is the data's quantile at this probability, not its
#: maximum: one stall (a garbage collection, a page fault) in a recording
#: would otherwise stand for 1 % of the mock's steps.
SPREAD_TOP = 0.999
#: The quantiles of a held-out step's time at which a binning of a
#: spread is scored: the mock draws from the whole distribution.
SCORED_QUANTILES = (0.1, 0.25, 0.5, 0.75, 0.9, 0.99)
#: The fewest steps a bin of a spread is made of.
MIN_BIN_STEPS = 30
#: Steps of new sizes needed for a spread of their own (spread_new_size),
#: and of new largest sizes for theirs (spread_new_max).
MIN_NEW_SIZE_STEPS = 8
#: The rank test's z above which new largest sizes get a spread of their
#: own (one-sided, p < 0.01).
NEW_MAX_SPLIT_Z = 2.33
#: The robust fit (fit_candidate): reweightings, and the relative residual
#: (in robust standard deviations, 1.4826 x the median |residual|) beyond
#: which a step's weight falls as 1/distance. 1.5 is the usual choice.
ROBUST_ITERATIONS = 5
HUBER_K = 1.5


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
            batch=knots,
            step_ms=tuple(c[:n]),
            prefill_ms_per_token=c[n],
            prefill_attention_ms=c[n + 1],
            prefill_ms_per_request=c[n + 2],
            context_ms_per_ktoken=c[n + 3],
        ),
        context=n + 3,
    )


CANDIDATES = (
    Candidate("linear", lambda _: Model(lambda s: [1.0, float(s.batch), float(s.prefill_tokens)], _linear)),
    Candidate(
        "linear+attention",
        lambda _: Model(lambda s: [1.0, float(s.batch)] + _terms(s), lambda c: _linear(c, c[3], c[5], c[4]), context=5),
    ),
    Candidate("table", _table),
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


def huber_weights(base: Sequence[float], residuals: Sequence[float]) -> Optional[List[float]]:
    """`base` with Huber's reweighting for `residuals`: a point beyond HUBER_K
    robust standard deviations (1.4826 x the median |residual|) weighs as
    one at that distance; None when that median is 0 (an exact fit)."""
    sizes = [abs(r) for r in residuals]
    threshold = HUBER_K * 1.4826 * quantile(sorted(sizes), 0.5)
    if threshold <= 0.0:
        return None
    return [w if r <= threshold else w * threshold / r for w, r in zip(base, sizes)]


#: The fewest steps of a run (context_slope) that tell how the context weighs.
MIN_RUN_STEPS = 8


def decode_runs(steps: Sequence[Step]) -> List[List[Step]]:
    """Maximal runs of back-to-back steps of one engine that only decode the
    same number of requests (of sizes run before, not on an idle engine's
    wake-up), MIN_RUN_STEPS or longer: within a run the batch and the
    machine's state are the same and only the context grows."""
    runs: List[List[Step]] = []
    run: List[Step] = []
    for s in steps:
        plain = s.prefill_tokens == 0 and not s.woke and s.novelty == STEADY
        if run and plain and s.rank == run[-1].rank and s.batch == run[-1].batch and abs(s.start - run[-1].end) < 1e-4:
            run.append(s)
            continue
        if len(run) >= MIN_RUN_STEPS:
            runs.append(run)
        run = [s] if plain else []
    if len(run) >= MIN_RUN_STEPS:
        runs.append(run)
    return runs


#: The least spread (ms) a run's steps are taken to have (context_slope): a
#: run of identical steps would otherwise weigh infinitely.
MIN_RUN_SPREAD_MS = 0.001


def _run_spread(run: Sequence[Step]) -> float:
    """The step-to-step spread (ms) of a run's times, robust to the trend:
    the median absolute deviation of successive differences, as a standard
    deviation of one step."""
    diffs = [b.duration_ms - a.duration_ms for a, b in zip(run, run[1:])]
    centre = quantile(sorted(diffs), 0.5)
    mad = quantile(sorted(abs(d - centre) for d in diffs), 0.5)
    return max(MIN_RUN_SPREAD_MS, 1.4826 * mad / math.sqrt(2.0))


def context_slope(steps: Sequence[Step]) -> float:
    """ms a step takes per 1000 tokens of context held, from how the steps
    of each decode run grow with it: the time and the context less their
    run's means, pooled, each run weighed by the inverse square of its
    spread (a run of one request on a noisy host says little about a slope
    that a run of sixteen says clearly), with HUBER_K reweighting; 0 when
    no run's context varies. Across runs the context goes with everything
    else that differs between them (the batch, the workload, the machine's
    drift over a recording), and a slope fitted across them took those for
    attention: several times the within-run slope on the reference engine."""
    xs: List[float] = []
    ys: List[float] = []
    scales: List[float] = []
    for run in decode_runs(steps):
        mx = sum(s.context_tokens for s in run) / (1000.0 * len(run))
        my = sum(s.duration_ms for s in run) / len(run)
        spread = _run_spread(run)
        xs.extend(s.context_tokens / 1000.0 - mx for s in run)
        ys.extend(s.duration_ms - my for s in run)
        scales.extend([spread] * len(run))
    base = [1.0 / (sc * sc) for sc in scales]
    weights: Optional[List[float]] = base
    slope = 0.0
    for _ in range(ROBUST_ITERATIONS + 1):
        sxx = sum(w * x * x for w, x in zip(weights, xs))
        if sxx <= 0.0:
            return 0.0
        slope = sum(w * x * y for w, x, y in zip(weights, xs, ys)) / sxx
        weights = huber_weights(base, [(y - slope * x) / sc for x, y, sc in zip(xs, ys, scales)])
        if weights is None:
            break
    return max(0.0, slope)


def fit_candidate(candidate: Candidate, steps: Sequence[Step]) -> StepProfile:
    """The candidate's profile fitted to `steps` (no spread yet): least
    squares on the relative error, then ROBUST_ITERATIONS reweightings that
    give a step whose relative residual is beyond HUBER_K robust standard
    deviations the weight of one at that distance (Huber's). The model is
    the typical step; the tail goes into the spread, not into the
    coefficients (a few prefills that took several times their usual time
    would otherwise price every prompt token higher). The context's
    coefficient is context_slope's, the others are fitted to what is left."""
    model = candidate.make(steps)
    rows = [model.features(s) for s in steps]
    ys = [s.duration_ms for s in steps]
    weights = [1.0 / (y * y) for y in ys]
    fixed = 0.0
    targets = ys
    if model.context is not None:
        fixed = context_slope(steps)
        targets = [y - fixed * row[model.context] for row, y in zip(rows, ys)]
        rows = [row[: model.context] + [0.0] + row[model.context + 1 :] for row in rows]
    c = nnls(rows, targets, weights)
    for _ in range(ROBUST_ITERATIONS):
        robust = huber_weights(weights, [(sum(a * b for a, b in zip(row, c)) - t) / y for row, t, y in zip(rows, targets, ys)])
        if robust is None:
            break  # an exact fit: nothing to reweight
        c = nnls(rows, targets, robust)
    if model.context is not None:
        c = list(c)
        c[model.context] = fixed
    return model.profile(c)


def predict(profile: StepProfile, step: Step) -> float:
    """The profile's step time for a recorded step, ms (before its spread)."""
    return profile.predict_ms(step.batch, step.prefill_tokens, step.prefill_attention, step.context_tokens, step.prefill_reqs)


def relative_errors(profile: StepProfile, steps: Sequence[Step]) -> List[float]:
    """(predicted - measured) / measured per step."""
    return [(predict(profile, s) - s.duration_ms) / s.duration_ms for s in steps]


def cross_validate(candidate: Candidate, steps: Sequence[Step], folds: int) -> List[float]:
    """Relative errors of each step predicted by a fit on the other folds
    (contiguous blocks of steps)."""
    n = len(steps)
    errors: List[float] = []
    for k in range(folds):
        lo, hi = n * k // folds, n * (k + 1) // folds
        train = list(steps[:lo]) + list(steps[hi:])
        if not train or lo == hi:
            continue
        errors.extend(relative_errors(fit_candidate(candidate, train), steps[lo:hi]))
    return errors


def quantile(sorted_values: Sequence[float], q: float) -> float:
    """Linear-interpolated quantile of an ascending list."""
    if not sorted_values:
        return math.nan
    x = q * (len(sorted_values) - 1)
    i = int(x)
    if i >= len(sorted_values) - 1:
        return sorted_values[-1]
    return sorted_values[i] + (sorted_values[i + 1] - sorted_values[i]) * (x - i)


def _pinball(y: float, predicted: float, q: float) -> float:
    return max(q * (y - predicted), (q - 1.0) * (y - predicted))


@dataclass(frozen=True)
class SpreadKind:
    """The steps one spread of the profile is drawn for (decode-only or
    prefilling), and what its bins are over."""

    name: str
    unit: str
    selects: Callable[[Step], bool]
    key: Callable[[Step], int]
    choices: Callable[[Sequence[int]], List[Tuple[int, ...]]]


def _fits(edges: Tuple[int, ...], keys: Sequence[int]) -> bool:
    """Whether every bin of `edges` holds MIN_BIN_STEPS of the sorted `keys`."""
    bounds = (0,) + edges + (math.inf,)
    return all(bisect_right(keys, hi) - bisect_right(keys, lo) >= MIN_BIN_STEPS for lo, hi in zip(bounds, bounds[1:]))


def equal_count_bins(keys: Sequence[int]) -> List[Tuple[int, ...]]:
    """None, and 2 or 3 bins of equal counts of the sorted `keys` (their
    upper edges), each of MIN_BIN_STEPS."""
    choices: List[Tuple[int, ...]] = [()]
    for bins in (2, 3):
        edges = tuple(dict.fromkeys(keys[len(keys) * i // bins - 1] for i in range(1, bins))) if keys else ()
        if len(edges) == bins - 1 and _fits(edges, keys):
            choices.append(edges)
    return choices


def doubling_bins(keys: Sequence[int]) -> List[Tuple[int, ...]]:
    """None, and bins that double over the sorted `keys` (1 | 2-3 | 4-7 | …,
    the upper edges), and coarser ones that grow fourfold (1 | 2-7 | 8-31 |
    …): a bin of fewer than MIN_BIN_STEPS joins the next one up, a top bin
    that small the one below."""
    choices: List[Tuple[int, ...]] = [()]
    if not keys:
        return choices
    for factor in (2, 4):
        edges: List[int] = []
        edge = 1
        while edge < keys[-1]:
            if bisect_right(keys, edge) - bisect_right(keys, edges[-1] if edges else 0) >= MIN_BIN_STEPS:
                edges.append(edge)
            edge = edge * factor + factor - 1
        while edges and len(keys) - bisect_right(keys, edges[-1]) < MIN_BIN_STEPS:
            edges.pop()  # too few above the last edge: the top bin joins the one below
        if edges and tuple(edges) not in choices:
            choices.append(tuple(edges))
    return choices


def prefill_bins(keys: Sequence[int]) -> List[Tuple[int, ...]]:
    """The binnings of equal counts and those that double or grow fourfold."""
    return list(dict.fromkeys(equal_count_bins(keys) + doubling_bins(keys)))


SPREAD_KINDS = (
    SpreadKind("decode", "batch", lambda s: not s.prefill_tokens, lambda s: s.batch, doubling_bins),
    SpreadKind("prefill", "tokens", lambda s: bool(s.prefill_tokens), lambda s: s.prefill_tokens, prefill_bins),
)


def _measured(profile: StepProfile, steps: Sequence[Step], kind: SpreadKind) -> List[Tuple[int, float, float]]:
    """(bin key, measured ms, predicted ms) of the steps of `kind` that `profile` predicts a time for."""
    return [(kind.key(s), s.duration_ms, p) for s in steps if kind.selects(s) and (p := predict(profile, s)) > 0]


def _ratio_bins(measured: Sequence[Tuple[int, float, float]], edges: Tuple[int, ...]) -> List[List[float]]:
    """Measured / predicted of `measured` (as `_measured` gives), sorted, per bin of `edges`."""
    bins: List[List[float]] = [[] for _ in range(len(edges) + 1)]
    for key, ms, p in measured:
        bins[bisect_left(edges, key)].append(ms / p)
    return [sorted(b) for b in bins]


def bin_scores(measured: Sequence[Tuple[int, float, float]], choices: Sequence[Tuple[int, ...]], folds: int) -> List[float]:
    """Per choice of bins: the mean pinball loss (ms) at SCORED_QUANTILES of
    the held-out steps of `measured` (as `_measured` gives), predicted times
    the spread of the other folds in those bins. The folds interleave (every
    `folds`-th step): a spread is a distribution over the whole recording,
    and a contiguous block would hold out a whole workload's batches."""
    totals = [0.0] * len(choices)
    count = 0
    for k in range(folds):
        test = measured[k::folds]
        train = [x for i, x in enumerate(measured) if i % folds != k]
        if not test or not train:
            continue
        for i, edges in enumerate(choices):
            bins = [[quantile(r, q) for q in SCORED_QUANTILES] if r else [1.0] * len(SCORED_QUANTILES) for r in _ratio_bins(train, edges)]
            for key, ms, p in test:
                factors = bins[bisect_left(edges, key)]
                totals[i] += sum(_pinball(ms, p * f, q) for q, f in zip(SCORED_QUANTILES, factors))
        count += len(test) * len(SCORED_QUANTILES)
    return [t / count if count else math.nan for t in totals]


def fit_spread(profile: StepProfile, steps: Sequence[Step], folds: int, kind: SpreadKind, report: List[str]) -> StepProfile:
    """`profile` with its spread of `kind` from `steps`, in the bins whose
    held-out pinball loss is lowest (ties: fewer bins); the scores reported."""
    chosen = [s for s in steps if kind.selects(s)]
    if len(chosen) < 2:
        return dataclasses.replace(profile, **{f"spread_{kind.name}": (), f"spread_{kind.name}_bins": ()})
    measured = _measured(profile, chosen, kind)
    choices = kind.choices(sorted(kind.key(s) for s in chosen))
    edges: Tuple[int, ...] = ()
    if len(choices) > 1:
        scores = bin_scores(measured, choices, folds)
        edges = choices[min(range(len(choices)), key=lambda i: (scores[i], len(choices[i])))]
        scored = ", ".join(f"{_bins_text(c, kind.unit)} {score:.3f}" for c, score in zip(choices, scores))
        report.append(f"{kind.name} spread bins by held-out pinball loss (ms): {scored}; chosen: {_bins_text(edges, kind.unit)}")
    sets = tuple(_quantiles(b) if len(b) >= 2 else (1.0, 1.0) for b in _ratio_bins(measured, edges))
    return dataclasses.replace(profile, **{f"spread_{kind.name}": sets, f"spread_{kind.name}_bins": edges})


def group_score(measured: Sequence[Tuple[str, float, float]], folds: int, added: bool = False) -> float:
    """The mean pinball loss (ms) at SCORED_QUANTILES of the held-out steps
    of `measured` (group, measured ms, predicted ms), each predicted times
    the spread of its group in the other folds (interleaved, as bin_scores),
    or, `added`, plus the spread of its group's ms beyond their prediction."""
    total, count = 0.0, 0
    none = [0.0 if added else 1.0] * len(SCORED_QUANTILES)
    for k in range(folds):
        test = measured[k::folds]
        spreads: dict = {}
        for i, (group, ms, p) in enumerate(measured):
            if i % folds != k:
                spreads.setdefault(group, []).append(ms - p if added else ms / p)
        values = {g: [quantile(sorted(r), q) for q in SCORED_QUANTILES] for g, r in spreads.items()}
        for group, ms, p in test:
            drawn = values.get(group, none)
            total += sum(_pinball(ms, spread_time(p, v, added), q) for q, v in zip(SCORED_QUANTILES, drawn))
        count += len(test) * len(SCORED_QUANTILES)
    return total / count if count else math.nan


def _kind(s: Step) -> str:
    return "prefill" if s.prefill_tokens else "decode"


def novelty_apart(together: StepProfile, apart: StepProfile, steps: Sequence[Step], folds: int, report: List[str]) -> bool:
    """Whether the steps of new sizes (StepSizes) are better priced apart
    (held-out pinball loss): `apart` (fitted without them) and a spread of
    their own, against `together` (fitted with them) and them in the decode
    and prefill spreads. A real engine may pay for a new size once (vLLM's
    CPU backend builds its matmul kernels per token count and grows its
    buffers): priced with the others, such steps would raise the price of
    the batch sizes and prompts they are many of, and give every step their
    tail."""
    score_together = group_score([(_kind(s), s.duration_ms, p) for s in steps if (p := predict(together, s)) > 0], folds)
    score_apart = group_score(
        [("new size" if s.novelty else _kind(s), s.duration_ms, p) for s in steps if (p := predict(apart, s)) > 0], folds
    )
    chosen = score_apart < score_together
    report.append(
        f"steps of new sizes ({sum(1 for s in steps if s.novelty)}) by held-out pinball loss (ms): priced with the others "
        f"{score_together:.4f}, apart {score_apart:.4f}; chosen: {'apart' if chosen else 'with the others'}"
    )
    return chosen


def rank_z(larger: Sequence[float], smaller: Sequence[float]) -> float:
    """Mann-Whitney's U of `larger` against `smaller` as a z-score (normal
    approximation, ties counted half): large when `larger` tends to exceed."""
    n, m = len(larger), len(smaller)
    if not n or not m:
        return 0.0
    ordered = sorted(smaller)
    u = sum(bisect_left(ordered, x) + 0.5 * (bisect_right(ordered, x) - bisect_left(ordered, x)) for x in larger)
    return (u - n * m / 2.0) / math.sqrt(n * m * (n + m + 1) / 12.0)


def added_scores(pairs: Sequence[Tuple[float, float]], folds: int) -> Tuple[float, float]:
    """The held-out pinball loss (group_score) of the steps `pairs`
    (measured ms, predicted ms) drawn as factors of their prediction, and
    drawn as ms added to it."""
    measured = [("", m, p) for m, p in pairs]
    return group_score(measured, folds), group_score(measured, folds, added=True)


def fit_novelty_spreads(profile: StepProfile, steps: Sequence[Step], report: List[str], folds: int = 5) -> StepProfile:
    """`profile` with the spreads of the steps of new sizes: one set, or,
    when the steps larger than any before took longer than the other new
    sizes (their measured / predicted ranks above, NEW_MAX_SPLIT_Z; at least
    MIN_NEW_SIZE_STEPS each), a set for each. A rank test, not held-out
    loss: a calibration holds only a few new largest sizes (each workload's
    first), too few to score quantiles on held-out folds. A set is of
    factors of the prediction or, when that scores better on its held-out
    steps (added_scores; only for a set of MIN_BIN_STEPS steps or more, so
    never for the few new largest sizes), of ms added to it: a cost of
    about the same ms whatever the step's size, such as building a kernel
    for a new token count, is a large factor of a short step and a small
    one of a long step."""
    novel = [(s.novelty, s.duration_ms, p) for s in steps if s.novelty and (p := predict(profile, s)) > 0]
    pairs = {novelty: [(m, p) for n, m, p in novel if n == novelty] for novelty in (NEW_SIZE, NEW_MAX)}
    ratios = {novelty: sorted(m / p for m, p in group) for novelty, group in pairs.items()}
    z = rank_z(ratios[NEW_MAX], ratios[NEW_SIZE])
    split = min(len(r) for r in ratios.values()) >= MIN_NEW_SIZE_STEPS and z > NEW_MAX_SPLIT_Z
    report.append(
        f"new largest sizes against the other new sizes: rank z {z:.2f} ({len(ratios[NEW_MAX])} and {len(ratios[NEW_SIZE])} steps; "
        f"a spread each when z > {NEW_MAX_SPLIT_Z}): {'a spread each' if split else 'one spread'}"
    )
    groups = {"spread_new_size": pairs[NEW_SIZE], "spread_new_max": pairs[NEW_MAX]} if split else \
        {"spread_new_size": [(m, p) for _, m, p in novel], "spread_new_max": []}  # fmt: skip
    for key, group in groups.items():
        profile = dataclasses.replace(profile, **{key: (), key + "_ms": ()})
        if len(group) < 2:
            continue
        r = sorted(m / p for m, p in group)
        added = False
        if len(group) >= MIN_BIN_STEPS:
            as_factors, as_ms = added_scores(group, folds)
            added = as_ms < as_factors
            report.append(
                f"{key}: held-out pinball loss (ms) as factors of the prediction {as_factors:.3f}, as ms added to it {as_ms:.3f}; "
                f"chosen: {'ms added' if added else 'factors'}"
            )
        if added:
            extra = sorted(m - p for m, p in group)
            profile = dataclasses.replace(profile, **{key + "_ms": _quantiles(extra)})
            report.append(
                f"{key}_ms ({len(extra)} steps): measured - predicted p50 {quantile(extra, 0.5):.2f} ms, "
                f"p90 {quantile(extra, 0.9):.2f}, p99 {quantile(extra, 0.99):.2f}, max {extra[-1]:.2f}"
            )
        else:
            profile = dataclasses.replace(profile, **{key: _quantiles(r)})
            report.append(
                f"{key} ({len(r)} steps): measured / predicted p50 {quantile(r, 0.5):.2f}, "
                f"p90 {quantile(r, 0.9):.2f}, p99 {quantile(r, 0.99):.2f}, max {r[-1]:.2f}"
            )
    return profile


#: The groups `score_steps` reports, and which steps are in each.
SCORE_GROUPS = (
    ("all", lambda s: True),
    ("decode", lambda s: not s.novelty and not s.prefill_tokens),
    ("prefill", lambda s: not s.novelty and bool(s.prefill_tokens)),
    ("new size", lambda s: s.novelty == NEW_SIZE),
    ("new largest size", lambda s: s.novelty == NEW_MAX),
)


def score_steps(profile: StepProfile, steps: Sequence[Step]) -> List[Tuple[str, int, float]]:
    """How well `profile` predicts recorded steps it was not fitted to, per
    SCORE_GROUPS: (group, steps, mean pinball loss in ms at SCORED_QUANTILES
    of the step's predicted time times its spread, as the mock draws it).
    Lower is better; it compares profiles on the same steps, without the
    noise a frontend and a client add to a latency."""
    rows = []
    for name, selects in SCORE_GROUPS:
        total, count = 0.0, 0
        for s in _usable(steps):
            if not selects(s) or (p := predict(profile, s)) <= 0:
                continue
            spread, added = profile.spread_of(s.prefill_tokens, s.batch, s.novelty)
            if not spread:
                spread, added = (1.0, 1.0), False
            total += sum(_pinball(s.duration_ms, spread_time(p, quantile(spread, q), added), q) for q in SCORED_QUANTILES) / len(SCORED_QUANTILES)
            count += 1
        rows.append((name, count, total / count if count else math.nan))
    return rows


def _quantiles(sorted_values: Sequence[float], points: int = SPREAD_POINTS) -> Tuple[float, ...]:
    last = points - 1
    return tuple(quantile(sorted_values, i / last if i < last else SPREAD_TOP) for i in range(points))


def _bins_text(edges: Tuple[int, ...], unit: str) -> str:
    return "one set" if not edges else f"{unit} " + " | ".join(f"<= {e}" for e in edges) + f" | > {edges[-1]}"


def summary(errors: Sequence[float]) -> str:
    """Mean |error|, its median and p90, and the bias, in %."""
    if not errors:
        return "no steps"
    a = sorted(abs(e) for e in errors)
    mean = sum(a) / len(a)
    bias = sum(errors) / len(errors)
    return f"mean |err| {100 * mean:5.1f} %  median {100 * quantile(a, 0.5):5.1f} %  p90 {100 * quantile(a, 0.9):5.1f} %  bias {100 * bias:+5.1f} %"


@dataclass
class FitResult:
    """The chosen profile (with its spread) and what the fit printed."""

    profile: StepProfile
    chosen: str
    report: List[str]


def fit(steps: Sequence[Step], folds: int = 5, model: Optional[str] = None, input_delays: Sequence[float] = ()) -> FitResult:
    """Fit every candidate (or only `model`), choose by cross-validated mean
    relative error, and add the spread of the chosen one and the quantiles
    of `input_delays` (ms)."""
    usable = _usable(steps)
    if len(usable) < max(10, folds * 2):
        raise ValueError(f"{len(usable)} usable steps: too few to fit (record a longer run)")
    max_batch = max(s.batch for s in usable)
    forms = [c for c in CANDIDATES if model is None or c.name == model]
    if not forms:
        raise ValueError(f"unknown model {model!r} (known: {', '.join(c.name for c in CANDIDATES)})")
    report = [
        f"{len(usable)} steps ({sum(1 for s in usable if s.prefill_tokens)} with prefill), batch 1..{max_batch}, "
        f"{folds}-fold cross-validation over contiguous blocks",
    ]
    runs = decode_runs(usable)
    report.append(
        f"context held: {context_slope(usable):.4f} ms per 1000 tokens, from {len(runs)} runs of decode steps "
        f"({sum(len(r) for r in runs)} steps; within each the batch is the same and only the context grows)"
    )
    best: Optional[Tuple[float, Candidate]] = None
    for form in forms:
        cv = cross_validate(form, usable, folds)
        mean = sum(abs(e) for e in cv) / len(cv) if cv else math.inf
        report.append(f"  {form.name:17s} held-out: {summary(cv)}")
        if best is None or mean < best[0]:
            best = (mean, form)
    assert best is not None
    chosen = best[1]
    profile = fit_candidate(chosen, usable)
    decode = [s for s in usable if not s.prefill_tokens]
    prefill = [s for s in usable if s.prefill_tokens]
    steady = [s for s in usable if not s.novelty]
    novel = False
    if len(usable) - len(steady) >= MIN_NEW_SIZE_STEPS and len(steady) >= max(10, folds * 2):
        apart = fit_candidate(chosen, steady)
        novel = novelty_apart(profile, apart, usable, folds, report)
        if novel:
            profile = apart
    for kind in SPREAD_KINDS:
        profile = fit_spread(profile, steady if novel else usable, folds, kind, report)
    if novel:
        profile = fit_novelty_spreads(profile, usable, report, folds)
    profile = dataclasses.replace(profile, input_delay_ms=_quantiles(sorted(input_delays)) if len(input_delays) >= 2 else ())
    if profile.input_delay_ms:
        d = sorted(input_delays)
        report.append(
            f"input delay (ADD relayed -> engine queued), {len(d)} requests that found the engine idle: p50 {quantile(d, 0.5):.2f} ms, "
            f"p90 {quantile(d, 0.9):.2f} ms, p99 {quantile(d, 0.99):.2f} ms"
        )
    report.append(f"chosen: {chosen.name}; its residuals on the steps it was fitted to:")
    for name, group in (("decode-only steps", decode), ("steps with prefill", prefill)):
        report.append(f"  {name:18s} ({len(group):5d}): {summary(relative_errors(profile, group))}")
    by_batch: dict = {}
    for s in decode:
        by_batch.setdefault(s.batch, []).append(s)
    report.append("  decode steps by batch: measured median / predicted (ms)")
    for b in sorted(by_batch):
        group = by_batch[b]
        if len(group) >= 5:
            measured = quantile(sorted(s.duration_ms for s in group), 0.5)
            predicted = quantile(sorted(predict(profile, s) for s in group), 0.5)
            report.append(f"    batch {b:4d} ({len(group):5d} steps): {measured:8.3f} / {predicted:8.3f}")
    return FitResult(profile, chosen.name, report)


#: `./run.sh fit`'s options, also as GMOCK_FIT_<FLAG> or in [fit] of --config.
FIT_ENV_PREFIX = ENV_PREFIX + "FIT_"
GROUPS = (
    Group(
        None,
        (
            Option("--output", "the profile to write", default="profile.ini", type=nonempty, aliases=("-o",)),
            Option(
                "--max-num-batched-tokens",
                "the recorded engine's token budget per step (its log says it), to place chunked prefills; "
                "none: no chunking assumed",
                type=int_at_least(1),
            ),
            Option(
                "--async-scheduling",
                "whether the recorded engine scheduled a step ahead (vLLM's async scheduling, its default on GPUs), "
                "to place each prompt in its step: auto (what its first tokens show), on or off",
                default="auto",
                type=choice(("auto", "on", "off")),
            ),
            Option("--folds", "cross-validation folds", default=5, type=int_at_least(2, 100)),
            Option("--model", "fit only this candidate (default: every one, the best kept)",
                   type=choice([c.name for c in CANDIDATES])),  # fmt: skip
        ),
    ),
)


def build_fit_parser() -> Any:
    """The parser of `./run.sh fit`'s options."""
    parser = new_parser(
        "gmock-engine fit",
        __doc__.split("\n\n")[0],
        "Each option can also be set as environment variable GMOCK_FIT_<FLAG> or as key <flag> in section "
        f"[{FIT_SECTION}] of the --config file. Precedence: command line > environment > config file > default.",
        ini_reader(FIT_SECTION),
        FIT_ENV_PREFIX,
        f"INI config file with a [{FIT_SECTION}] section (keys = long flag names)",
    )
    parser.add_argument("traces", nargs="+", metavar="TRACE", help="trace files of the record tap (docs/record.md)")
    add_groups(parser, GROUPS)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`gmock-engine fit`: exit status 0, or 2 with a message naming the trace."""
    try:
        args = parse_tool_config(build_fit_parser(), FIT_SECTION, sys.argv[1:] if argv is None else argv)
    except ConfigError as exc:
        print(f"gmock-engine fit: {exc}", file=sys.stderr)
        return 2
    steps: List[Step] = []
    delays: List[float] = []
    ahead_seen = False
    for path in args.traces:
        try:
            _, records = read_trace(path)
        except (OSError, TraceFormatError) as exc:
            print(f"gmock-engine fit: {path}: {exc}", file=sys.stderr)
            return 2
        lags = scheduling_lags(records, args.max_num_batched_tokens)
        ahead = schedules_ahead(lags) is True if args.async_scheduling == "auto" else args.async_scheduling == "on"
        ahead_seen = ahead_seen or ahead
        found = steps_from_trace(records, args.max_num_batched_tokens, ahead)
        shown = ", ".join(f"{lag} {count}" for lag, count in sorted(lags.items())) or "no SCHEDULED events"
        print(f"{path}: {len(found)} steps; first tokens by steps after scheduling (requests): {shown}; "
              f"read as {'async' if ahead else 'sync'} scheduling")  # fmt: skip
        steps.extend(found)
        delays.extend(input_delays_ms(records))
    try:
        result = fit(steps, folds=args.folds, model=args.model, input_delays=delays)
    except ValueError as exc:
        print(f"gmock-engine fit: {exc}", file=sys.stderr)
        return 2
    print("\n".join(result.report))
    comment = [
        "gmock_engine latency profile: ./run.sh --latency-profile THIS_FILE (docs/latency-profile.md)",
        f"fitted by ./run.sh fit from {', '.join(args.traces)}; model {result.chosen}",
    ]
    if ahead_seen:
        comment.append("the recorded engine scheduled a step ahead (async scheduling): serve with --async-scheduling")
    with open(args.output, "w", encoding="utf-8") as f:
        f.write(format_profile(result.profile, comment))
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
