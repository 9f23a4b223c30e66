"""What a recording covers, and what it lacks, for the fit (tools/fit.py).

A fitted profile knows only the steps it saw: beyond the largest batch
the table extends straight, beyond the longest prefill the prefill price
does, and a recording with few prefills prices every prompt from those
few. `coverage` counts the kinds of steps the fit needs and says, for
each it lacks, what was missing and that `./run.sh calibrate` (whose sweep
covers each) would record it. Pure.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

from gmock_engine.tools.steps import Step

#: Below these a kind of step is reported as lacking.
MIN_PREFILL_SHARE = 0.05  # of the steps, those that compute a prompt chunk
MIN_PREFILL_STEPS = 50
MIN_KIND_STEPS = 5  # long prefills, chunked steps, mixed steps with many decodes, wake-ups
MIN_DECODE_RUNS = 3
#: A prefill is long from this many tokens (or half the token budget, when known, if that is less).
LONG_PREFILL = 1024
#: A mixed step has many decodes from this many (or half the largest batch, if that is less).
MANY_DECODES = 8


def _n(count: int) -> str:
    return f"{count:,}".replace(",", " ")


def coverage(steps: Sequence[Step], max_num_batched_tokens: Optional[int] = None, decode_runs: int = 0) -> List[str]:
    """The report's coverage section: what the steps hold, then a line per
    kind of step the fit needs that they hold too few of (none: nothing lacks)."""
    n = len(steps)
    if not n:
        return ["coverage: no steps"]
    prefill = [s for s in steps if s.prefill_tokens]
    mixed = [s for s in prefill if s.decode]
    max_batch = max(s.batch for s in steps)
    max_prefill = max((s.prefill_tokens for s in prefill), default=0)
    long_at = min(LONG_PREFILL, max_num_batched_tokens // 2) if max_num_batched_tokens else LONG_PREFILL
    many = max(2, min(MANY_DECODES, max_batch // 2))
    long_steps = [s for s in prefill if s.prefill_tokens >= long_at]
    many_mixed = [s for s in mixed if s.decode >= many]
    woke = [s for s in steps if s.woke]
    decode_batches = sorted({s.batch for s in steps if not s.prefill_tokens})
    lines = [
        f"coverage: {_n(n)} steps; {_n(len(prefill))} with a prefill (longest {_n(max_prefill)} tokens), "
        f"{_n(len(mixed))} of them beside decodes (most decodes {max((s.decode for s in mixed), default=0)}); "
        f"decode-only steps at {len(decode_batches)} batch sizes up to {max(decode_batches, default=0)}; "
        f"{_n(len(woke))} on an idle engine; {decode_runs} runs of decode steps for the context's price",
    ]
    lacks: List[str] = []
    if len(prefill) < max(MIN_PREFILL_STEPS, MIN_PREFILL_SHARE * n):
        lacks.append(f"only {_n(len(prefill))} of {_n(n)} steps held a prefill (the prompt's price rests on them)")
    if len(long_steps) < MIN_KIND_STEPS:
        lacks.append(f"{len(long_steps)} steps with {_n(long_at)} prefill tokens or more (the longest: {_n(max_prefill)}): "
                     "whether a long prefill costs more than its tokens' price is not seen")  # fmt: skip
    if max_num_batched_tokens:
        chunked = [s for s in prefill if s.prefill_tokens + s.decode >= max_num_batched_tokens]
        if len(chunked) < MIN_KIND_STEPS:
            lacks.append(f"{len(chunked)} steps at the token budget ({_n(max_num_batched_tokens)}): no chunked prefill "
                         "(prompts longer than the budget) seen")  # fmt: skip
    if len(many_mixed) < MIN_KIND_STEPS:
        lacks.append(f"{len(many_mixed)} steps with a prefill beside {many} decodes or more: a prompt chunk's cost "
                     "in a full batch is not seen")  # fmt: skip
    if len(woke) < MIN_KIND_STEPS:
        lacks.append(f"{len(woke)} steps on an idle engine: the input delay is not seen")
    if decode_runs < MIN_DECODE_RUNS:
        lacks.append(f"{decode_runs} runs of back-to-back decode steps of one batch: the context's price is not seen")
    if max_batch < 2:
        lacks.append("no step held more than one request: the batch's price is not seen")
    if lacks:
        lines.append("coverage: the trace lacks (record it with ./run.sh calibrate, whose sweep covers each):")
        lines += [f"  - {line}" for line in lacks]
    else:
        lines.append("coverage: every kind of step the fit needs is in the trace")
    return lines
