"""The sweep of `./run.sh calibrate` (tools/calibrate.py): which requests it
sends, in which phases. Pure: the plan is data, the client in calibrate.py
sends it.

A latency profile is fitted from the steps a recording holds
(docs/latency-profile.md), and it knows only what they showed. The sweep
is made so that one run covers what the fit needs:

* `batch`: closed loops at concurrency 1, 2, 3, 4, 6, 8, 12, … up to the
  largest, with short prompts and outputs of BATCH_OUTPUT: decode steps of every batch size (the
  table over the batch, the context term within runs of one batch);
* `prompt`: one request at a time, prompts from a few tokens to beyond the
  engine's token budget per step (`max_num_batched_tokens`: the longest
  are computed in chunks, chunked prefill), with short outputs: steps
  whose time is mostly their prompt tokens (the price of a prefill, its
  attention, whether it grows faster than the tokens);
* `mixed`: a closed loop at the largest concurrency, prompts of random
  lengths up to 1.5 times the token budget and outputs of random lengths
  (8 to 128): steps that compute a prompt chunk beside many decodes;
* `poisson`: arrivals at random times (a Poisson process at `rate` a
  second, by default 0.7 times what `mixed` achieved), mixed lengths: the
  wake-ups of an idle engine and the batches in between.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple


@dataclass(frozen=True)
class Request:
    """One completion: `prompt` tokens in, `output` tokens out (EOS ignored)."""

    prompt: int
    output: int


@dataclass(frozen=True)
class Phase:
    """A stretch of the sweep: `requests` sent by a closed loop of
    `concurrency` clients, or at Poisson arrivals of `rate` a second (None:
    the rate is set when the phase starts, RATE_OF_MIXED times the request
    rate `mixed` achieved)."""

    name: str
    requests: Tuple[Request, ...]
    concurrency: Optional[int] = None
    rate: Optional[float] = None

    @property
    def closed_loop(self) -> bool:
        """Whether clients send each next request when their last one ends."""
        return self.concurrency is not None


#: The Poisson phase's rate, as a fraction of the request rate `mixed` achieved:
#: below what the engine sustains, so the queue empties between bursts.
RATE_OF_MIXED = 0.7
#: Output tokens of the batch ladder's requests (decode steps of each batch).
BATCH_OUTPUT = 64
#: Prompt tokens of the batch ladder's requests.
BATCH_PROMPT = 128
#: Output tokens of the prompt ladder's requests: a few decode steps after each prefill.
PROMPT_OUTPUT = 8
#: Requests per prompt length of the prompt ladder.
PROMPT_REPEATS = 6
#: The shortest prompt of the prompt ladder and of the mixed phases.
MIN_PROMPT = 16


def ladder(top: int) -> List[int]:
    """1, 2, 3, 4, 6, 8, 12, 16, … (each power of two and the point half way
    to the next) up to `top`, and `top` itself: batch sizes between the
    powers of two too, where a step's time may jump."""
    values = [1]
    power = 2
    while power <= top:
        values += [v for v in (power, power + power // 2) if v <= top and v > values[-1]]
        power *= 2
    if values[-1] != top:
        values.append(top)
    return values


def prompt_lengths(budget: int, longest: int) -> List[int]:
    """Prompt lengths of the prompt ladder: doubling from MIN_PROMPT, then
    around the token budget (one token under it, a chunk and a half, two and
    a half: the chunked prefill's boundaries), none longer than `longest`."""
    lengths = []
    n = MIN_PROMPT
    while n < budget:
        lengths.append(n)
        n *= 4 if n < 256 else 2
    lengths += [budget - 1, budget + budget // 2, 2 * budget + budget // 2]
    return sorted({min(n, longest) for n in lengths if n >= 1})


def log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    """An integer between lo and hi, uniform in its logarithm (as many short as long)."""
    if hi <= lo:
        return lo
    return int(round(lo * (hi / lo) ** rng.random()))


def sweep(max_concurrency: int, max_num_batched_tokens: int, max_model_len: int, scale: float = 1.0,
          seed: int = 0, quick: bool = False) -> List[Phase]:  # fmt: skip
    """The sweep's phases (module docstring) for an engine that batches up to
    `max_concurrency` requests, computes `max_num_batched_tokens` a step and
    holds `max_model_len` tokens a request; `scale` multiplies the request
    counts; `quick` is a sweep of a few seconds (tests): outputs of 16 and
    a handful of requests a phase."""
    if max_concurrency < 1 or max_num_batched_tokens < 2 or max_model_len < 2 * MIN_PROMPT or scale <= 0:
        raise ValueError("sweep: max_concurrency >= 1, max_num_batched_tokens >= 2, max_model_len >= 32, scale > 0")
    rng = random.Random(seed)
    batch_prompt = min(BATCH_PROMPT, max_model_len // 2)
    batch_output = min(16 if quick else BATCH_OUTPUT, max_model_len - batch_prompt)
    count = lambda n: max(1, int(round(n * scale)))  # noqa: E731
    phases: List[Phase] = []
    for c in ladder(max_concurrency):
        n = count(c if quick else max(4, 2 * c))
        phases.append(Phase(f"batch c{c}", tuple(Request(batch_prompt, batch_output)
                                                 for _ in range(n)), concurrency=c))  # fmt: skip
    longest = max_model_len - PROMPT_OUTPUT
    repeats = 1 if quick else PROMPT_REPEATS
    prompts = [Request(p, PROMPT_OUTPUT) for p in prompt_lengths(max_num_batched_tokens, longest) for _ in range(count(repeats))]
    phases.append(Phase("prompt c1", tuple(prompts), concurrency=1))
    mixed_c = max(2, max_concurrency)
    top_prompt = min(max_num_batched_tokens + max_num_batched_tokens // 2, max_model_len // 2)
    top_output = min(32 if quick else 128, max_model_len // 2)

    def mixed(n: int) -> Tuple[Request, ...]:
        return tuple(Request(log_uniform(rng, MIN_PROMPT, top_prompt), log_uniform(rng, 8, top_output)) for _ in range(n))

    phases.append(Phase(f"mixed c{mixed_c}", mixed(count(mixed_c if quick else 4 * mixed_c)), concurrency=mixed_c))
    phases.append(Phase("poisson", mixed(count(max_concurrency if quick else 4 * max_concurrency))))
    return phases


def poisson_gaps(rng: random.Random, rate: float, n: int) -> List[float]:
    """`n` gaps (s) between arrivals of a Poisson process at `rate` a second."""
    return [rng.expovariate(rate) for _ in range(n)]


def describe(phases: Sequence[Phase]) -> List[str]:
    """A line per phase: its load, requests and their lengths."""
    lines = []
    for p in phases:
        load = f"{p.concurrency} concurrent" if p.closed_loop else ("Poisson at a rate from mixed" if p.rate is None else f"Poisson {p.rate:g}/s")
        ins = sorted(r.prompt for r in p.requests)
        outs = sorted(r.output for r in p.requests)
        lines.append(f"{p.name:12s} {load:30s} {len(p.requests):4d} requests, prompts {ins[0]}-{ins[-1]}, outputs {outs[0]}-{outs[-1]} tokens")
    return lines
