"""`./run.sh fit TRACE... -o profile.ini`: a step-time profile from recorded traces.

The candidate models are in fit_models.py, the spread in fit_spread.py; this
module fits, chooses and is the command.

Reads the steps of a real engine from traces of the record tap (steps.py),
fits candidate step-time models to them, picks the one that predicts best
on held-out steps (k-fold cross-validation over contiguous blocks of steps
dealt to the folds in turn, so that a fold is stretches of time the model has not seen), prints every
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
  the four other terms;
* `table+prefill`: that, with the prompt tokens priced by a table over
  their count (a long prefill that grows faster than its tokens);
* `fine+prefill`: that, with a point of the batch table at every batch
  size up to 32 the steps hold enough of (a step time that jumps).

A candidate further down the list is chosen only when its held-out error
is lower by PARSIMONY (and PARSIMONY_ABS) than the best one above it. The
report begins with what the steps cover and lack (fit_coverage).

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

import dataclasses
import math
import sys
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

from gmock_engine.config.loader import ENV_PREFIX, FIT_SECTION, ConfigError, ini_reader, new_parser, parse_tool_config
from gmock_engine.timing.profile import STEADY, StepProfile, format_profile
from gmock_engine.config.option import Group, Option, add_groups
from gmock_engine.config.validators import choice, int_at_least, nonempty
from gmock_engine.timing.trace import TraceFormatError, read_trace
from gmock_engine.tools.fit_coverage import coverage
from gmock_engine.tools.fit_models import (  # noqa: F401  (the candidates and numerics, also used as fit.X)
    CANDIDATES,
    MIN_STEP_MS,
    Candidate,
    Model,
    nnls,
    predict,
    quantile,
    relative_errors,
    summary,
    table_points,
    _usable,
)
from gmock_engine.tools.fit_spread import (  # noqa: F401  (the spread, also used as fit.X)
    MIN_BIN_STEPS,
    MIN_NEW_SIZE_STEPS,
    SCORE_GROUPS,
    SCORED_QUANTILES,
    SPREAD_KINDS,
    doubling_bins,
    equal_count_bins,
    fit_novelty_spreads,
    fit_spread,
    novelty_apart,
    prefill_bins,
    rank_z,
    score_steps,
    _quantiles,
)
from gmock_engine.tools.steps import Step, input_delays_ms, schedules_ahead, scheduling_lags, steps_from_trace

#: The robust fit (fit_candidate): reweightings, and the relative residual
#: (in robust standard deviations, 1.4826 x the median |residual|) beyond
#: which a step's weight falls as 1/distance. 1.5 is the usual choice.
ROBUST_ITERATIONS = 5
HUBER_K = 1.5


def huber_weights(base: Sequence[float], residuals: Sequence[float]) -> Optional[List[float]]:
    """`base` with Huber's reweighting for `residuals`: a point beyond HUBER_K
    robust standard deviations (1.4826 x the median |residual|) weighs as
    one at that distance; None when that median is 0 (an exact fit)."""
    sizes = [abs(r) for r in residuals]
    threshold = HUBER_K * 1.4826 * quantile(sorted(sizes), 0.5)
    if threshold <= 0.0:
        return None
    return [w if r <= threshold else w * threshold / r for w, r in zip(base, sizes)]


#: How much lower (relative) a candidate's held-out mean error must be than
#: the best simpler candidate's for the fit to choose it (fit).
PARSIMONY = 0.02
#: ... and by this much absolutely (a tenth of a percent): two forms that
#: both hold the engine's steps exactly differ by rounding only.
PARSIMONY_ABS = 0.001

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


#: Contiguous blocks of steps per cross-validation fold (cross_validate).
BLOCKS_PER_FOLD = 8


def cross_validate(candidate: Candidate, steps: Sequence[Step], folds: int) -> List[float]:
    """Relative errors of each step predicted by a fit on the other folds.
    The steps are cut into folds x BLOCKS_PER_FOLD contiguous blocks, dealt
    to the folds in turn: each block is a stretch of time the model did not
    see (the machine's drift), and every fold's training steps still hold
    each stretch of a recording (a calibration sweep's phases come one
    after the other: with one block a fold, the fold of the first phase
    would hold out every step of a batch of one, which no training step
    would then show)."""
    n = len(steps)
    blocks = folds * BLOCKS_PER_FOLD
    fold_of = [min(blocks - 1, i * blocks // n) % folds for i in range(n)]
    errors: List[float] = []
    for k in range(folds):
        train = [s for s, f in zip(steps, fold_of) if f != k]
        test = [s for s, f in zip(steps, fold_of) if f == k]
        if not train or not test:
            continue
        errors.extend(relative_errors(fit_candidate(candidate, train), test))
    return errors


@dataclass
class FitResult:
    """The chosen profile (with its spread) and what the fit printed."""

    profile: StepProfile
    chosen: str
    report: List[str]


def fit(steps: Sequence[Step], folds: int = 5, model: Optional[str] = None, input_delays: Sequence[float] = (),
        max_num_batched_tokens: Optional[int] = None) -> FitResult:  # fmt: skip
    """Fit every candidate (or only `model`), choose by cross-validated mean
    relative error, and add the spread of the chosen one and the quantiles
    of `input_delays` (ms). The report begins with what the steps cover and
    lack (fit_coverage; `max_num_batched_tokens`: the recorded engine's
    token budget, to tell chunked prefills)."""
    usable = _usable(steps)
    if len(usable) < max(10, folds * 2):
        raise ValueError(f"{len(usable)} usable steps: too few to fit (record a longer run)")
    max_batch = max(s.batch for s in usable)
    forms = [c for c in CANDIDATES if model is None or c.name == model]
    if not forms:
        raise ValueError(f"unknown model {model!r} (known: {', '.join(c.name for c in CANDIDATES)})")
    report = [
        f"{len(usable)} steps ({sum(1 for s in usable if s.prefill_tokens)} with prefill), batch 1..{max_batch}, "
        f"{folds}-fold cross-validation over {BLOCKS_PER_FOLD} contiguous blocks a fold, dealt in turn",
    ]
    runs = decode_runs(usable)
    report += coverage(usable, max_num_batched_tokens, len(runs))
    report.append(
        f"context held: {context_slope(usable):.4f} ms per 1000 tokens, from {len(runs)} runs of decode steps "
        f"({sum(len(r) for r in runs)} steps; within each the batch is the same and only the context grows)"
    )
    best: Optional[Tuple[float, Candidate]] = None
    for form in forms:
        cv = cross_validate(form, usable, folds)
        mean = sum(abs(e) for e in cv) / len(cv) if cv else math.inf
        report.append(f"  {form.name:17s} held-out: {summary(cv)}")
        # CANDIDATES go from fewer coefficients to more: one with more must beat the best so far
        # by PARSIMONY, else its extra points fit the folds' noise and extrapolate worse
        if best is None or mean < (1.0 - PARSIMONY) * best[0] - PARSIMONY_ABS:
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
        result = fit(steps, folds=args.folds, model=args.model, input_delays=delays, max_num_batched_tokens=args.max_num_batched_tokens)
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
