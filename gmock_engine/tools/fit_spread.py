"""The spread of a fitted profile (tools/fit.py): the quantiles of
measured / predicted step time the engine draws each step's factor from,
their bins chosen by held-out pinball loss, the spreads of steps of new
sizes, and the scoring of a profile on held-out steps. Pure.
"""

from __future__ import annotations

import dataclasses
import math
from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from typing import Callable, List, Sequence, Tuple

from gmock_engine.timing.profile import NEW_MAX, NEW_SIZE, StepProfile, spread_time
from gmock_engine.tools.fit_models import _usable, predict, quantile
from gmock_engine.tools.steps import Step

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
