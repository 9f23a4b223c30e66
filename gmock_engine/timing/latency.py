"""The latency model: how long a step and a prefill take, on the engine's clock.

Pure arithmetic; the engine asks it, the runtime sleeps accordingly. All
figures are off by default (steps back to back, instant prefill).

* A **step** (every running request advances once; `step_time` reads
  the scheduler's plan of it, core/sched_output.py) takes
  `itl_ms + itl_ms_per_request × running + prefill_ms_per_token × tokens
  prefilled in that step`: the batch slows down as it grows and while it
  prefills new prompts, as a real engine does.
* A newly scheduled request produces its first token once `ttft_ms +
  prefill_ms_per_token × prompt_len` have passed since it was scheduled
  (in the first step at or after that time). The fixed part does not hold
  the batch back; the per-token part does (see the step time).
* `jitter` scales each step and each fixed TTFT by a factor drawn uniformly
  from [1 - jitter, 1 + jitter] (seeded: the same seed gives the same run).
* `lora_load_ms` delays the first token of a request whose scheduling
  loaded its LoRA adapter (not registered before, or evicted since; core/lora.py).
* `time_scale` multiplies every duration (0.5 = twice as fast).

With a step-time **profile** (`--latency-profile`, profile.py: fitted
from a real engine's trace) the profile times each step from the plan's
composition (running batch, prompt tokens prefilled and their attention, the
tokens the batch holds) instead of the three linear figures above, and
the first token of a request comes when the step that computed the last of
its prompt ends, as in a real engine (then `ttft_ms`, if any, is added to that; the per-token
prefill figure does not apply). A request is admitted no earlier than the
profile's input delay after its ADD, as a real engine queues it only once
it has received and prepared it. The first step of each size (tokens
computed) the engine runs draws the profile's new-size spread, and a step
larger than any before its new-largest one: the scheduler keeps the sizes
its engine has run (`sizes`, latency_profile.StepSizes).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Optional, Protocol

from gmock_engine.timing.profile import StepProfile, StepSizes


class StepPlan(Protocol):
    """What the latency model reads of a step's plan (core's SchedulerOutput)."""

    num_running_reqs: int
    num_prefill_tokens: int
    num_draft_tokens: int
    prefill_attention: float
    num_prefill_reqs: int


@dataclass(frozen=True)
class LatencyModel:
    """Durations in milliseconds as configured; methods return seconds."""

    itl_ms: float = 0.0
    itl_ms_per_request: float = 0.0
    ttft_ms: float = 0.0
    prefill_ms_per_token: float = 0.0
    #: The vision encoder's cost per image token it computes (mm_cache.EncoderCache.encode).
    encoder_ms_per_token: float = 0.0
    jitter: float = 0.0
    time_scale: float = 1.0
    lora_load_ms: float = 0.0
    #: The fitted step-time model, when one is given (replaces the step's
    #: linear figures; see the module docstring).
    profile: Optional[StepProfile] = None
    #: False when every step and prefill is instant (the Rust mock's mode).
    #: Derived once: the scheduler reads it every step.
    paced: bool = field(init=False, repr=False, compare=False)
    #: Whether the profile times a step of a new size apart, so that the
    #: scheduler keeps the sizes its engine has run (StepSizes). Derived once.
    prices_new_sizes: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "paced", bool(self.itl_ms or self.itl_ms_per_request or self.ttft_ms or self.prefill_ms_per_token
                                              or self.encoder_ms_per_token or self.profile))
        object.__setattr__(self, "prices_new_sizes", self.profile is not None and self.profile.prices_new_sizes)

    def _jitter(self, rng: random.Random) -> float:
        return 1.0 + self.jitter * (2.0 * rng.random() - 1.0) if self.jitter else 1.0

    def step_seconds(
        self,
        running: int,
        prefill_tokens: int,
        rng: random.Random,
        prefill_attention: float = 0.0,
        context_tokens: int = 0,
        prefill_reqs: int = 0,
        sizes: Optional[StepSizes] = None,
    ) -> float:
        """Duration of a step with `running` requests that prefills
        `prefill_tokens` (with a profile: also their attention, Σ c·(p + c/2)
        over the prompt chunks, the `context_tokens` the batch holds and the
        `prefill_reqs` requests that compute a prompt chunk; the step's size,
        its prompt tokens and decoding requests, is added to `sizes`, and
        a new size or a new largest one draws the profile's spread of those)."""
        if not running:
            # nothing ran (the head of the queue is not in yet; with async
            # scheduling, what ended still held the slots): a real engine's
            # step of no tokens takes next to no time
            return 0.0
        profile = self.profile
        if profile is not None:
            novelty = 0
            if sizes is not None and self.prices_new_sizes:
                novelty = sizes.add(running - prefill_reqs + prefill_tokens)
            ms = profile.sample_ms(running, prefill_tokens, prefill_attention, context_tokens, rng, prefill_reqs, novelty)
            ms *= self._jitter(rng)
        else:
            ms = (self.itl_ms + self.itl_ms_per_request * running) * self._jitter(rng)
            ms += self.prefill_ms_per_token * prefill_tokens
        return ms * self.time_scale / 1000.0

    def step_time(
        self, scheduler_output: StepPlan, rng: random.Random, context_tokens: int = 0, sizes: Optional[StepSizes] = None
    ) -> float:
        """Duration of the step `scheduler_output` planned (core/sched_output.py):
        its running batch and the prompt tokens it prefills; `context_tokens`:
        what the running requests hold (kv_cache_manager's `tokens`); `sizes`:
        the step sizes the engine has run (step_seconds). The
        draft tokens of speculative decoding are charged as prompt tokens
        (the linear term; their attention is not modelled)."""
        return self.step_seconds(
            scheduler_output.num_running_reqs,
            # a verify step computes each decoding request's drafts beside its token
            scheduler_output.num_prefill_tokens + scheduler_output.num_draft_tokens,
            rng,
            scheduler_output.prefill_attention,
            context_tokens,
            scheduler_output.num_prefill_reqs,
            sizes,
        )

    def first_token_seconds(self, prompt_len: int, rng: random.Random, ttft_ms: Optional[float] = None) -> float:
        """Time from scheduling to the earliest first token of a request
        (`ttft_ms` replaces the configured fixed part for one request). With
        a profile the prefill's time is its step's, not counted here."""
        fixed = self.ttft_ms if ttft_ms is None else ttft_ms
        ms = fixed * self._jitter(rng)
        if self.profile is None:
            ms += self.prefill_ms_per_token * prompt_len
        return ms * self.time_scale / 1000.0

    def encoder_seconds(self, encoder_tokens: int) -> float:
        """The encoder's time for `encoder_tokens` image tokens: it delays
        their request's first token and lengthens the step that runs it."""
        return self.encoder_ms_per_token * encoder_tokens * self.time_scale / 1000.0

    def input_delay_seconds(self, rng: random.Random) -> float:
        """With a profile, a request's input delay: the time a real engine
        takes to receive and queue it, before which it cannot be admitted."""
        if self.profile is None or not self.profile.input_delay_ms:
            return 0.0
        return self.profile.input_delay(rng) * self.time_scale / 1000.0

    def lora_load_seconds(self) -> float:
        """Extra time to the first token of a request that loaded its adapter."""
        return self.lora_load_ms * self.time_scale / 1000.0
