"""The scheduler: what one step does, pure (vLLM: `vllm/v1/core/sched/scheduler.py`).

`schedule` decides a step, in vLLM's order: the running requests first
(their KV blocks for this step's tokens, preempting the newest when they do
not fit, and their share of the token budget), then chunked prefills go on,
then waiting requests are admitted (the batch limit, the token budget, the
LoRA slots and the KV blocks allowing, and not at all in a step that had to
preempt; a P/D consumer waits for its KV). It returns the step's plan
(sched_output.py); the output processor (output_processor.py) makes the
step's tokens and outputs, `retire` takes the requests that ended out of
the batch, before the next `schedule` as in vLLM (with async scheduling,
after it), and `time_step` times a step from its plan. The waiting
requests are what the frontends show as `num_requests_waiting`.

Each request's `status` (request.RequestStatus) is kept here in step with
the books: the waiting queue (WAITING, PREEMPTED), the running batch
(RUNNING, or WAITING_FOR_REMOTE_KVS while in `transferring`), and a finished
status once it left them.

Timing is the latency model's (timing/latency.py): the step asks its successor to
wait `step_delay`, and a request's first token comes at its `ready_at`.

A reload (SIGHUP, config/reload.py) reaches the scheduler between steps, through
`reconfigure`: the latency model and the limits apply from the next step;
a request draws its tokens and logprobs from the `Sampler` of its ADD, so a
new token source or logprob setting is for the requests that come after.
"""

from __future__ import annotations

import math
import random
import sys
from collections import Counter
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

from gmock_engine.core.kv_cache_manager import KVCacheManager
from gmock_engine.kv.transfer import KVTransfer
from gmock_engine.timing.latency import LatencyModel
from gmock_engine.timing.profile import StepSizes
from gmock_engine.core.lora import AdapterRegistry, LoRAError, LoRAScheduling
from gmock_engine.core.mm_cache import EncoderCache
from gmock_engine.core.sched_kv import KVScheduling
from gmock_engine.wire.eras import Wire
from gmock_engine.wire.outputs import engine_core_event, scheduler_stats
from gmock_engine.wire.types import EngineCoreEventType
from gmock_engine.core.request import FINISHED_STATUS, Request, RequestStatus
from gmock_engine.core.request_queue import create_request_queue
from gmock_engine.core.sched_output import BatchObserver, PauseState, SchedulerOutput
from gmock_engine.content.tokens import TokenSource
from gmock_engine.content.spec_decode import SpecDecode

if TYPE_CHECKING:
    from gmock_engine.content.logprobs import LogprobModel
    from gmock_engine.content.sampler import Sampler


# Enum members read on the per-step and per-request paths, bound once:
# `PauseState.PAUSED_ALL` is a lookup through the enum metaclass, a module
# global a plain dict lookup.
_UNPAUSED, _PAUSED_ALL = PauseState.UNPAUSED, PauseState.PAUSED_ALL
_SCHEDULED = EngineCoreEventType.SCHEDULED
_QUEUED_TYPE = int(EngineCoreEventType.QUEUED)
_WAITING, _PREEMPTED = RequestStatus.WAITING, RequestStatus.PREEMPTED
_RUNNING, _REMOTE_KVS = RequestStatus.RUNNING, RequestStatus.WAITING_FOR_REMOTE_KVS
_ABORTED = RequestStatus.FINISHED_ABORTED
_WAITING_FOR_FSM = RequestStatus.WAITING_FOR_FSM
#: nothing admitted, preempted or rejected in a step (most steps)
_NONE: Tuple[Any, ...] = ()


class Scheduler(KVScheduling, LoRAScheduling):
    """The running batch, the waiting queue, and the decision of each step."""

    def __init__(
        self,
        kv: KVCacheManager,
        sampler: "Sampler",
        latency: LatencyModel,
        rng: random.Random,
        wire: Wire,
        chunk: int,
        max_num_seqs: Optional[int],
        max_num_batched_tokens: Optional[int],
        policy: str,
        async_scheduling: bool = False,
        on_preempt: Callable[[Request], None] = lambda request: None,
        on_reject: Callable[[Request], None] = lambda request: None,
        lora: Optional[AdapterRegistry] = None,
        kv_transfer: Optional[KVTransfer] = None,
    ) -> None:
        self.kv = kv
        #: The adapter registry (None: LoRA not enabled); the scheduler keeps
        #: at most `lora.max_loras` distinct adapters in the running batch.
        self.lora = lora
        #: P/D disaggregation (kv/transfer.py); None: off.
        self.kv_transfer = kv_transfer
        #: Consumer requests waiting for their KV (vLLM's WAITING_FOR_REMOTE_KVS):
        #: in the running batch here, but counted as waiting, as vLLM's kv_holding_waiting.
        self.transferring: set = set()
        #: The sampler of new requests (running ones keep their own).
        self.sampler = sampler
        self.latency = latency
        #: The latency model's generator (jitter), in the order the steps draw.
        self.rng = rng
        self.wire = wire
        self.chunk = chunk
        #: speculative decoding's verifier (content/spec_decode.py, EngineCore sets it); None: off
        self.spec: Optional[SpecDecode] = None
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        #: The running batch, in admission order (the newest is preempted first).
        self.running: Dict[str, Request] = {}
        #: What makes the outputs (output_processor.py): told of every running
        #: request that leaves the batch, and of a new sampler. Set by it.
        self.output_processor: Optional[BatchObserver] = None
        self.waiting = create_request_queue(policy)
        #: `--scheduling-policy`: under "priority" the request preempted for KV
        #: is the lowest-priority, latest-arrived one, not the newest admitted
        self.priority_policy = policy == "priority"
        #: Requests whose structured answer is being made off the engine's
        #: loop (status WAITING_FOR_FSM): not in the waiting queue, so no
        #: step looks at them (vLLM skips them in its waiting queue) until
        #: `release` queues them; counted as waiting, ended by `remove`.
        self.waiting_for_fsm: Dict[str, Request] = {}
        #: Running requests whose prefill is not done: id -> ready_at (inf: chunks left).
        self.prefilling: Dict[str, float] = {}
        #: Running requests with prompt tokens still to prefill (token budget).
        self.chunking: Dict[str, Request] = {}
        #: Σ c·(p + c/2) over the prompt chunks of the step being planned (timing/profile.py)
        self._prefill_attention = 0.0
        #: requests that compute a prompt chunk in the step being planned
        self._prefill_reqs = 0
        #: multimodal: the encoder outputs cached (mm_cache.EncoderCache,
        #: EngineCore sets it), the encoder tokens one step may compute
        #: (vLLM's max_num_encoder_input_tokens) and those the step being planned computes
        self.encoder_cache: Optional[EncoderCache] = None
        self.encoder_budget = 0
        self._encoder_tokens = 0
        self.pause_state = PauseState.UNPAUSED
        #: Engine time the last step asked its successor to wait (latency model).
        self.step_delay = 0.0
        #: the step sizes (tokens computed) run so far, kept when the profile
        #: prices a new one apart (timing/latency.py); None: it does not
        self.step_sizes: Optional[StepSizes] = StepSizes() if latency.prices_new_sizes else None
        #: vLLM's async scheduling: it schedules step k+1 while step k runs,
        #: so what arrives during step k is scheduled after it, into step
        #: k+2, stamped SCHEDULED then. Here a request that comes while the
        #: batch runs may join at the second `schedule` call after it (its
        #: `first_call`), with the first one's time as its SCHEDULED event.
        self.async_scheduling = async_scheduling
        #: `schedule` calls so far, and the time of the last one
        self._calls = 0
        self._last_call_at = 0.0
        #: requests added since the last `schedule` call whose QUEUED event
        #: waits for its time (`_queue_arrivals`)
        self._arrived: List[Request] = []
        #: the time of this call's decisions: its SCHEDULED and PREEMPTED events
        self._scheduled_stamp = 0.0
        #: requests whose prompt the last `schedule` call finished computing
        #: in no time (no latency model): their first token is due at once
        #: (EngineCore.step sends it at the same boundary; with async
        #: scheduling the outputs follow the call, none is kept)
        self.prefilled_now: Any = _NONE
        #: steps, tokens, preemptions (the ledger counts requests)
        self.counters: Counter = Counter()
        #: --log-requests hooks of the engine
        self._on_preempt = on_preempt
        self._on_reject = on_reject

    @property
    def tokens(self) -> TokenSource:
        """The token source of new requests."""
        return self.sampler.tokens

    @property
    def logprob_model(self) -> "LogprobModel":
        """The logprob model of new requests."""
        return self.sampler.logprobs

    def reconfigure(
        self,
        latency: LatencyModel,
        sampler: "Sampler",
        max_num_seqs: Optional[int],
        max_num_batched_tokens: Optional[int],
    ) -> None:
        """New settings from a reload, between two steps (never within one).

        The latency model times the next step at once (the delay the last
        step asked for is recomputed with it); requests already waiting for
        their first token keep the time they were given. A lower
        --max-num-seqs admits nothing until the batch is below it (nobody is
        preempted); a lifted token budget lets the chunked prefills finish
        in the next step. A new sampler is for new requests (the output
        processor's `reconfigure`)."""
        if latency != self.latency:
            self.latency = latency
            if self.step_sizes is None and latency.prices_new_sizes:
                self.step_sizes = StepSizes()
            self.step_delay = (
                latency.step_seconds(len(self.running), 0, self.rng, 0.0, self.kv.tokens, sizes=self.step_sizes) if latency.paced else 0.0
            )
        changed = sampler is not self.sampler
        self.sampler = sampler
        if self.output_processor is not None:
            self.output_processor.reconfigure(sampler, changed)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens

    # -- queries ---------------------------------------------------------------

    @property
    def can_admit(self) -> bool:
        """Waiting requests may join the running batch now."""
        limit = self.max_num_seqs
        return self.pause_state is _UNPAUSED and (limit is None or len(self.running) < limit)

    @property
    def has_work(self) -> bool:
        """True when a step would do something."""
        if self.pause_state is _PAUSED_ALL:
            return False
        return bool(self.running) or (bool(self.waiting) and self.can_admit)

    def next_step_time(self, step_started: float) -> Optional[float]:
        """When the next step is due, on the engine clock (None: idle).

        The step after one that started at `step_started` comes `step_delay`
        later; but if nothing could emit then (every running request still
        prefilling, nothing to admit), it comes when the first prefill is done.
        """
        if self.running and not self.prefilling and self.pause_state is not _PAUSED_ALL:
            return step_started + self.step_delay  # decodes to run: the common case, after every step
        if not self.has_work:
            return None
        due = step_started + self.step_delay
        if self.chunking:
            return due  # chunked prefills progress every step
        head = self._head_admit_at()
        if self.prefilling and len(self.prefilling) == len(self.running):
            wake = min(self.prefilling.values())
            due = max(due, wake if head is None else min(wake, head))
        elif not self.running and head is not None:
            due = max(due, head)  # nothing runs: the next step is the admission
        return due

    def _next_tokens(self, request: Request) -> int:
        """Tokens the request emits in its next decode step."""
        remaining = request.max_tokens - request.num_output_tokens
        return self.chunk if self.chunk < remaining else remaining

    def _head_admit_at(self) -> Optional[float]:
        """When the next waiting request could join the batch (its admit_at),
        or None when it cannot for now (limit, pause, KV)."""
        if not (self.waiting and self.can_admit):
            return None
        head = self.waiting.peek_request()
        return head.admit_at if self.kv.fits(self.kv.blocks_to_admit(head)) else None

    # -- requests in and out ---------------------------------------------------

    def add_request(self, request: Request) -> None:
        """A new request waits for admission (with a latency profile, not
        before its input delay has passed)."""
        if self.latency.profile is not None:
            request.admit_at = request.queued_at + self.latency.input_delay_seconds(self.rng)
        if self.async_scheduling and self.running:
            request.first_call = self._calls + 2  # vLLM planned the next step while this one ran: it joins the one after
        self.waiting.add_request(request)
        if request.status is _WAITING_FOR_FSM:
            request.status = _WAITING  # released: its QUEUED event has the time it was held
        elif request.pending_events:
            self._arrived.append(request)

    def _queue_arrivals(self, now: float) -> None:
        """Stamp the QUEUED event of the requests that reached the engine
        since the last call with this call's time. vLLM's engine core takes
        its input between steps (`EngineCore._process_input_queue`, then
        `add_request` records QUEUED, then `schedule`): a request that
        arrives while a step runs is queued when that step ends, one that
        wakes an idle engine at once. With a latency profile a request is
        in the engine only after its input delay (`admit_at`)."""
        later = []
        for request in self._arrived:
            if request.admit_at > now:
                later.append(request)
                continue
            events = request.pending_events
            if events and events[0]["type"] == _QUEUED_TYPE:
                events[0]["timestamp"] = now
        self._arrived = later

    def hold(self, request: Request) -> None:
        """A new request waits for its structured answer (WAITING_FOR_FSM),
        out of the waiting queue until `release`. Its QUEUED event keeps
        the time of its ADD (`add_request` does not restamp it): vLLM
        records QUEUED before the grammar compiles, so the queue time it
        shows includes the compile."""
        request.status = _WAITING_FOR_FSM
        self.waiting_for_fsm[request.request_id] = request

    def release(self, request: Request) -> bool:
        """Its structured answer is ready: the held `request` leaves
        WAITING_FOR_FSM, to be queued with `add_request` (or ended); False
        when it is no longer held (aborted meanwhile, or another request's id)."""
        if self.waiting_for_fsm.get(request.request_id) is not request:
            return False
        del self.waiting_for_fsm[request.request_id]
        return True

    def remove(self, request_id: str, status: RequestStatus = _ABORTED) -> Optional[Request]:
        """Take a running, waiting or held request out (ABORT; `status`:
        how it ended); its KV is freed."""
        request = self.running.pop(request_id, None)
        if request is not None:
            self._release(request)
        else:
            request = self.waiting.remove_request(request_id)
            if request is None:
                request = self.waiting_for_fsm.pop(request_id, None)
            if request is None:
                return None
        request.status = status
        return request

    def remove_all(self, status: RequestStatus = _ABORTED) -> List[Request]:
        """Every running and waiting request, taken out (running first)."""
        out = [*self.running.values(), *self.waiting.requests(), *self.waiting_for_fsm.values()]
        self.waiting_for_fsm.clear()
        self.kv.free_all(list(self.running.values()))
        if self.output_processor is not None:
            self.output_processor.clear(self.running.values())
        self.running.clear()
        self.waiting.clear()
        self.prefilling.clear()
        self.chunking.clear()
        self.transferring.clear()
        for request in out:
            request.status = status
        return out

    def _release(self, request: Request) -> None:
        """Account for a running request that left `running` (its KV is freed)."""
        if self.output_processor is not None:
            self.output_processor.drop(request)
        self.kv.free(request)
        self.prefilling.pop(request.request_id, None)
        self.chunking.pop(request.request_id, None)
        self.transferring.discard(request.request_id)

    # -- the step ----------------------------------------------------------------

    def schedule(self, now: float) -> SchedulerOutput:
        """Decide one step (§9.3): the running requests' KV blocks (preempting
        the newest when they do not fit), the token budget (a chunk for each
        running request past its prefill, then chunked prefills), then
        admissions unless something was preempted; return the plan.

        Each running request past its prefill is scheduled for
        min(chunk, remaining) tokens; the output processor makes them."""
        budget = self.max_num_batched_tokens
        running = self.running
        self._calls += 1
        # async: what this call decides (admissions, preemptions) vLLM decided
        # at the last call, while the step that ends now ran; an idle engine
        # schedules what woke it at once
        self._scheduled_stamp = self._last_call_at if self.async_scheduling and running else now
        self._last_call_at = now
        if self._arrived:
            self._queue_arrivals(now)
        prefill_tokens = 0
        self._prefill_attention = 0.0
        self._prefill_reqs = 0
        self._encoder_tokens = 0
        preempted = self._reserve_decode_blocks(self._scheduled_stamp) if self.kv.enforced and running else _NONE
        prefilling = self.prefilling
        # a request whose prefill ended in the last step has its first token
        # now: it decodes in this step, as in vLLM, and takes its budget
        busy = sum(1 for ready_at in prefilling.values() if ready_at > now) if prefilling else 0
        decode_tokens = (len(running) - busy) * self.chunk
        # speculative decoding: each decoding request verifies its drafts too
        spec = self.spec
        draft_tokens = 0 if spec is None else (len(running) - busy) * spec.num_spec_tokens
        if budget is not None:
            budget -= decode_tokens + draft_tokens
            if self.chunking:
                prefill_tokens, budget = self._continue_prefills(now, budget)
        elif self.chunking:  # a reload lifted the budget: what was chunked is prefilled now
            prefill_tokens, _ = self._continue_prefills(now, sys.maxsize)
        new: Any = _NONE
        rejected: Any = _NONE
        if not preempted and self.waiting:
            new, rejected = [], []
            prefill_tokens += self._admit(now, budget, new, rejected)
        return SchedulerOutput(
            new, len(running), decode_tokens, prefill_tokens, preempted, rejected, self.chunk, self._prefill_attention, draft_tokens,
            self._prefill_reqs,
        )  # fmt: skip

    def retire(self, finished: List[Request]) -> None:
        """The requests whose last output the step that ends now made leave
        the batch: their KV is freed, and their slot and token budget are
        the next step's (vLLM's `update_from_output` frees them before the
        next `schedule`)."""
        running = self.running
        for request in finished:
            del running[request.request_id]
            self._release(request)
            request.status = FINISHED_STATUS[request.finish]

    def time_step(self, scheduler_output: SchedulerOutput) -> None:
        """Time the step `scheduler_output` planned (timing/latency.py), from its
        prefill and what runs in it: the requests that will have tokens
        when it ends, with what they hold then (their last output counted;
        the ones that just ended are not in it, as in a real engine, whose
        next step no longer holds them)."""
        if self.latency.paced:
            scheduler_output.num_running_reqs = len(self.running)
            self.step_delay = self.latency.step_time(scheduler_output, self.rng, self.kv.tokens, self.step_sizes)
            if self._encoder_tokens:
                self.step_delay += self.latency.encoder_seconds(self._encoder_tokens)

    def _admit(self, now: float, budget: Optional[int], new: List[Request], rejected: List[Any]) -> int:
        """Move waiting requests into the running batch (into `new`) while the
        batch limit, the token budget (`budget` left, None: unlimited) and the
        KV blocks allow; those that can never run go to `rejected`; return
        the prompt tokens they prefill in this step."""
        prefill_tokens = 0
        latency, kv, waiting, lora = self.latency, self.kv, self.waiting, self.lora
        # max_loras: a request whose adapter would be one too many in the batch
        # is skipped and keeps its place (vllm/v1/core/sched/scheduler.py,
        # scheduled_loras / skipped_waiting_requests)
        running_loras = self._running_lora_ids() if lora is not None else set()
        skipped: List[Request] = []
        while waiting and self.can_admit and (budget is None or budget > 0):
            request = waiting.peek_request()
            if request.admit_at > now:
                break  # not yet in the engine (the profile's input delay), and first in line
            if request.first_call > self._calls:
                break  # async scheduling: came while this step was planned, and first in line
            adapter = request.lora_request
            if adapter is not None and lora is not None:
                if adapter.lora_int_id not in running_loras and len(running_loras) >= lora.max_loras:
                    skipped.append(waiting.pop_request())
                    continue
            encoder_cache = self.encoder_cache
            if request.mm_features and encoder_cache is not None and self._encoder_tokens:
                # the step's encoder budget: a request whose images it cannot
                # encode now waits for the next step (vLLM cuts the prefill
                # before the image instead; the mock's prefill is whole)
                if self._encoder_tokens + encoder_cache.cost(request.mm_features) > self.encoder_budget:
                    break
            need = 0
            if kv.enforced:
                need = kv.blocks_to_admit(request)
                if need > kv.num_blocks:
                    # the whole cache cannot hold what it has: vLLM checks at
                    # startup that its KV holds max_model_len tokens, the
                    # mock's blocks are whatever was configured
                    self._reject_too_long(waiting.pop_request(), rejected)
                    continue
                if not kv.fits(need):
                    break  # waits for blocks to free up, as vLLM
            loaded = False
            if adapter is not None and lora is not None:
                loads = lora.loads
                try:
                    lora.add(adapter)  # what vLLM's model runner does for each adapter it schedules
                except LoRAError as exc:
                    self._reject_lora(waiting.pop_request(), str(exc), rejected)
                    continue
                loaded = lora.loads != loads
                running_loras.add(adapter.lora_int_id)
            if kv.enforced:
                kv.allocate(request, need)
            waiting.pop_request()
            request.scheduled_at = now
            resumed = request.status is _PREEMPTED
            events = request.pending_events or []
            events.append(engine_core_event(_SCHEDULED, self._scheduled_stamp))
            request.pending_events = events
            self.running[request.request_id] = request
            request.status = _RUNNING
            new.append(request)  # the output processor's full path: its next output carries events
            target = request.num_tokens  # recompute after a preemption
            # cached prompt blocks are not computed again (KV is still held)
            request.cached_tokens = kv.admit(request, resumed)
            target -= request.cached_tokens
            if request.kv is not None and request.kv.consume and not request.num_output_tokens:
                # P/D consumer: its KV comes over the transfer, not from the token budget; its
                # blocks are cached when its first token comes (kv.on_output), i.e. after the
                # load, as vLLM caches them once the remote KV has arrived
                self._kv_admit(request, now, target, latency.lora_load_seconds() if loaded else 0.0)
                continue
            take = target if budget is None else min(target, budget)
            prefill_tokens += take
            self._prefill_attention += take * (request.cached_tokens + take / 2)
            if take:
                self._prefill_reqs += 1
            if budget is not None:
                budget -= take
            request.prefill_left = target - take
            if kv.caching:  # the prompt blocks prefilled in this step are cached now, as vLLM's
                kv.computed(request, request.num_tokens - request.prefill_left)
            if request.prefill_left:
                self.chunking[request.request_id] = request
            if request.ttft_ms is not None:
                request.ready_at = now + latency.first_token_seconds(request.prompt_len, self.rng, request.ttft_ms)
            elif latency.paced:
                request.ready_at = now + latency.first_token_seconds(request.prompt_len, self.rng)
            else:
                request.ready_at = now
            if loaded:
                request.ready_at += latency.lora_load_seconds()
            if request.mm_features and encoder_cache is not None:
                encoded = encoder_cache.encode(request.mm_features)
                self._encoder_tokens += encoded
                request.ready_at += latency.encoder_seconds(encoded)
            if latency.profile is not None and request.ready_at <= now:
                request.ready_at = math.nextafter(now, math.inf)  # at the end of this step, which computes the prompt
            if request.prefill_left or request.ready_at > now:
                self.prefilling[request.request_id] = float("inf") if request.prefill_left else request.ready_at
            else:
                self._prefilled_now(request)
        for request in reversed(skipped):
            waiting.prepend_request(request)
        return prefill_tokens

    def _continue_prefills(self, now: float, budget: int) -> "tuple[int, int]":
        """Chunked prefill of running requests (admission order) within
        `budget`; return (tokens prefilled, budget left)."""
        prefilled = 0
        for request in list(self.chunking.values()):
            if budget <= 0:
                break
            take = min(request.prefill_left, budget)
            self._prefill_attention += take * (request.num_tokens - request.prefill_left + take / 2)
            if take:
                self._prefill_reqs += 1
            request.prefill_left -= take
            budget -= take
            prefilled += take
            if self.kv.caching:
                self.kv.computed(request, request.num_tokens - request.prefill_left)
            if not request.prefill_left:
                del self.chunking[request.request_id]
                if self.latency.profile is not None and request.ready_at <= now:
                    request.ready_at = math.nextafter(now, math.inf)  # at the end of this step
                if request.ready_at > now:
                    self.prefilling[request.request_id] = request.ready_at
                else:
                    del self.prefilling[request.request_id]
                    self._prefilled_now(request)
        return prefilled, budget

    def _prefilled_now(self, request: Request) -> None:
        if self.async_scheduling:
            return  # the outputs follow this schedule call: they carry its first token
        if not self.prefilled_now:
            self.prefilled_now = [request]
        else:
            self.prefilled_now.append(request)

    def request_counts(self) -> "tuple[int, int]":
        """(running, waiting) as SchedulerStats show them (vLLM's
        get_request_counts): a consumer waiting for its KV is waiting."""
        transferring = len(self.transferring)
        return len(self.running) - transferring, len(self.waiting) + transferring + len(self.waiting_for_fsm)

    def scheduler_stats(
        self, prefix_cache_stats: Optional[Dict[str, Any]] = None, spec_decoding_stats: Optional[Dict[str, Any]] = None
    ) -> Dict[str, Any]:
        """The engine's SchedulerStats now (§7.1); the interval's counters given."""
        waiting_loras, running_loras = self.lora_adapters()
        return scheduler_stats(
            waiting_lora_adapters=waiting_loras,
            running_lora_adapters=running_loras,
            prefix_cache_stats=prefix_cache_stats,
            num_running_reqs=len(self.running) - len(self.transferring),
            num_waiting_reqs=len(self.waiting) + len(self.transferring),
            kv_cache_usage=self.kv.usage,
            step_counter=self.counters["steps"],
            spec_decoding_stats=spec_decoding_stats,
        )
