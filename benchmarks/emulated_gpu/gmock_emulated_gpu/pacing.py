"""What the emulated GPU's step takes, and when it ends. Pure: neither vLLM
nor torch (the model in model.py feeds it the batch from vLLM's attention
metadata), so the unit tests run it in gmock_engine's own venv.

A step's time comes from a **step function** of what is in the batch:

* a latency profile (`--latency-profile` INI, gmock_engine/timing/profile.py):
  the same file the mock reads, predicted with the same features the mock's
  scheduler computes (StepProfile.predict_ms), optionally times a factor
  drawn from its spread;
* or a Python expression of the batch's figures (`STEP_VARIABLES`), e.g.
  `6 + 0.4*decodes + 0.02*prefill_tokens + 1e-5*prefill_tokens**2`: a step
  function outside the profile's family, to judge what a fit learns.

The **cadence** is a GPU's with async scheduling: a step is timed from the
end of the previous forward when that was less than one step ago, so the
host's own work between forwards (scheduling, sampling, sending outputs)
overlaps with the step, as it does with a GPU computing the next batch; an
engine that was idle longer, or whose step neither decodes nor goes on
with a prompt chunk of the step before (its last requests had ended: it
was idle, however briefly), starts its step when its forward starts.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple

#: The names a step expression may use: the batch's figures (Batch), and
#: these functions.
STEP_VARIABLES = ("batch", "decodes", "prefill_tokens", "prefill_reqs", "prefill_attention", "context")
STEP_FUNCTIONS: Dict[str, Callable] = {"min": min, "max": max, "sqrt": math.sqrt, "log": math.log, "exp": math.exp,
                                       "ceil": math.ceil, "floor": math.floor, "abs": abs}  # fmt: skip


class StepFunctionError(ValueError):
    """A step function that cannot be used; the message says why."""


@dataclass(frozen=True)
class Batch:
    """What a step computes, in the terms of the mock's scheduler
    (core/sched_output.py, core/kv_cache_manager.py) and the fit (tools/steps.py):
    `decodes` requests computing one token, `prefill_reqs` requests computing
    `prefill_tokens` prompt tokens, `prefill_attention` Σ c·(p + c/2) over
    those chunks (c tokens from position p), `context` the tokens the
    requests hold (their sequences as far as this step computes them)."""

    decodes: int = 0
    prefill_tokens: int = 0
    prefill_reqs: int = 0
    prefill_attention: float = 0.0
    context: int = 0
    #: the positions the step's prompt chunks start at and end at (a later
    #: chunk of a long prompt starts where the one before it ended; a prompt
    #: behind prefix-cache hits starts past 0 too, after no chunk of its own)
    chunk_starts: Tuple[int, ...] = field(default=(), compare=False)
    chunk_ends: Tuple[int, ...] = field(default=(), compare=False)

    @property
    def batch(self) -> int:
        """The requests in the step."""
        return self.decodes + self.prefill_reqs


def batch_from_lengths(query_lens: Sequence[int], seq_lens: Sequence[int]) -> Batch:
    """The Batch of a step from its requests' query lengths (tokens computed
    in the step) and sequence lengths (tokens held once it is computed), as
    vLLM's attention metadata has them. A request computing one token of a
    sequence longer than one decodes (vLLM's decode threshold); the others
    compute a prompt chunk. Requests with no query (padding) are left out."""
    b = dict(decodes=0, prefill_tokens=0, prefill_reqs=0, prefill_attention=0.0, context=0)
    starts: List[int] = []
    ends: List[int] = []
    for q, s in zip(query_lens, seq_lens):
        q, s = int(q), int(s)
        if q <= 0:
            continue
        b["context"] += s
        if q == 1 and s > 1:
            b["decodes"] += 1
        else:
            b["prefill_reqs"] += 1
            b["prefill_tokens"] += q
            b["prefill_attention"] += q * ((s - q) + q / 2.0)
            starts.append(s - q)
            ends.append(s)
    return Batch(**b, chunk_starts=tuple(starts), chunk_ends=tuple(ends))


def expression_step(text: str) -> Callable[[Batch], float]:
    """The step function (Batch -> ms) of expression `text` over
    STEP_VARIABLES and STEP_FUNCTIONS; StepFunctionError when it does not
    compile, names anything else, or does not give a number >= 0 for an
    empty batch and for a decode of one."""
    try:
        code = compile(text, "<step_ms>", "eval")
    except SyntaxError as exc:
        raise StepFunctionError(f"step_ms: not a Python expression: {text!r} ({exc.msg})") from None
    unknown = sorted(set(code.co_names) - set(STEP_VARIABLES) - set(STEP_FUNCTIONS))
    if unknown:
        raise StepFunctionError(f"step_ms: unknown name(s) {', '.join(unknown)} in {text!r} "
                                f"(known: {', '.join(STEP_VARIABLES + tuple(STEP_FUNCTIONS))})")  # fmt: skip
    namespace = {"__builtins__": {}, **STEP_FUNCTIONS}

    def step(b: Batch) -> float:
        values = {"batch": b.batch, "decodes": b.decodes, "prefill_tokens": b.prefill_tokens,
                  "prefill_reqs": b.prefill_reqs, "prefill_attention": b.prefill_attention, "context": b.context}  # fmt: skip
        return float(eval(code, namespace, values))  # noqa: S307 - names checked above, no builtins

    for probe in (Batch(), Batch(decodes=1, context=100)):
        try:
            ms = step(probe)
        except Exception as exc:  # any error of the expression's own
            raise StepFunctionError(f"step_ms: {text!r} fails for {probe}: {exc}") from None
        if not ms >= 0.0 or math.isinf(ms):
            raise StepFunctionError(f"step_ms: {text!r} gives {ms} for {probe} (ms >= 0 expected)")
    return step


def profile_step(profile, spread: bool = False, seed: int = 0) -> Callable[[Batch], float]:
    """The step function (Batch -> ms) of a latency profile
    (gmock_engine.timing.profile.StepProfile): its prediction, and with
    `spread` times a factor drawn from the spread of steps of sizes run
    before (a warmed-up GPU pays nothing for a new size), from a seeded
    generator."""
    rng = random.Random(seed)

    def step(b: Batch) -> float:
        ms = profile.predict_ms(b.batch, b.prefill_tokens, b.prefill_attention, b.context, b.prefill_reqs)
        return ms * profile.spread(b.prefill_tokens, rng, b.batch) if spread else ms

    return step


class Pacer:
    """Ends each step at its time (step function), keeping the cadence of
    the module docstring; counts the steps whose real forward took longer
    than their time (`overruns`): those ran at the CPU's speed, not the
    emulated GPU's."""

    def __init__(self, step_ms: Callable[[Batch], float], clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:  # fmt: skip
        self.step_ms, self.clock, self.sleep = step_ms, clock, sleep
        self.last_end: Optional[float] = None
        #: where the last step's prompt chunks ended: a chunk starting there goes on with one
        self.last_chunk_ends: Set[int] = set()
        self.steps = 0
        self.overruns = 0
        self.overrun_ms = 0.0

    def continues(self, batch: Batch) -> bool:
        """Whether `batch` goes on with the last step's work (a decode, or a
        prompt chunk starting where one of the last step's ended), rather
        than beginning on an engine whose requests had all ended."""
        return batch.decodes > 0 or any(p > 0 and p in self.last_chunk_ends for p in batch.chunk_starts)

    def pace(self, batch: Batch, started: float) -> float:
        """Sleep until the end of the step whose forward began at `started`
        (this clock) and has just computed; the step's time in ms."""
        ms = max(0.0, self.step_ms(batch))
        target = ms / 1000.0
        base = started
        # the host's work since the last forward overlaps this step, unless nothing ran on the GPU before
        # it: a step that neither decodes nor goes on with a prompt chunk of the last step follows an idle
        # engine (its last requests had ended), and an idle GPU starts computing when the batch comes,
        # however soon after the last forward that is
        if self.last_end is not None and started - self.last_end < target and self.continues(batch):
            base = self.last_end
        self.last_chunk_ends = set(batch.chunk_ends)
        due = base + target
        now = self.clock()
        self.steps += 1
        if now < due:
            self.sleep(due - now)
            # the step's nominal end: a sleep's overshoot is not carried into the next step
            self.last_end = due
        else:
            self.overruns += 1
            self.overrun_ms += (now - due) * 1000.0
            self.last_end = now
        return ms
