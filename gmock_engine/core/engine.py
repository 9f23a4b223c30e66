"""The engine core: a thin owner of one engine's parts, pure (no sockets,
no greenlets; vLLM: `vllm/v1/engine/core.py`).

`EngineCore` applies the decoded protocol messages (`apply`) and runs the
decode step (`step`); both return the messages to send as
`(client_index, EngineCoreOutputs array)` pairs, in order. The parts, where
vLLM keeps them:

* intake.py: the ADD path (checked, planned, queued or held for its
  structured answer), a part of `EngineCore`;
* wire/checks.py: an ADD's `vllm_xargs` checked once, before anything plans;
* request.py: a request's state (`RequestStatus`) and its planned end (the
  `vllm_xargs` scenarios, stop ids, EOS lengths);
* request_queue.py: the waiting queue (FCFS on a deque, priority on a heap);
* kv_cache_manager.py: KV blocks and the prefix cache behind them;
* kv/transfer.py: P/D disaggregation (a producer's kv_transfer_params, a
  consumer's KV transfer wait);
* scheduler.py: what a step does (running first, admission, preemption,
  chunked prefill, LoRA slots, P/D waits), its plan in sched_output.py;
* output_processor.py (lanes.py its steady path): the tokens of each
  running request and their outputs, from that plan;
* outbox.py: per-client batches, the stats cadence, the ledger check;
* utilities.py: the utility table with the pause/sleep state;
* ledger.py: the books on every request, kept from the wire (one book: the
  engine's own counters are steps, tokens and preemptions only).

The greenlet wiring (runtime/runner.py) moves frames in and out; everything that
decides *what* the engine says lives in these modules and is unit-tested
without I/O. Behaviour is the Rust mock's (docs/protocol.md §9.3) plus what the
real frontends need from an engine: pause/sleep that end in-flight streams
(§3.4, §5), `finished_requests` for every end (§3.4, §6.1), SchedulerStats,
events and prefill stats (§4.5, §7).
"""

from __future__ import annotations

import dataclasses
import random
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

from loguru import logger

from gmock_engine.core import grammar_wait
from gmock_engine.kv import transfer as kv_transfer
from gmock_engine.core.intake import RequestIntake
from gmock_engine.core.kv_cache_manager import KVCacheManager
from gmock_engine.core.ledger import CHECKED_MEMORY, Ledger
from gmock_engine.content.logprobs import LogprobModel
from gmock_engine.utils.logs import Throttle, short
from gmock_engine.core.lora import AdapterRegistry
from gmock_engine.core.mm_cache import EncoderCache, ReceiverCache
from gmock_engine.core.outbox import COORDINATOR, STATS_INTERVAL_S, LedgerViolation, Outbound, Outbox, StatsCadence
from gmock_engine.core.prefix_cache import PrefixCache
from gmock_engine.core.request import Request
from gmock_engine.core.request_queue import FCFSRequestQueue
from gmock_engine.core.output_processor import MOCK_FAILURE_MESSAGE, OutputProcessor
from gmock_engine.core.request import RequestStatus
from gmock_engine.content.sampler import Sampler
from gmock_engine.core.sched_output import PauseState
from gmock_engine.core.scheduler import Scheduler
from gmock_engine.content.spec_decode import SpecDecode
from gmock_engine.content.tokens import RandomTokens, TokenSource
from gmock_engine.core.utilities import PAUSE_MODES, SUPPORTED_UTILITIES, Utilities
from gmock_engine.wire.checks import MAX_XARGS_TTFT_MS, MOCK_XARGS
from gmock_engine.wire.eras import WireLayout
from gmock_engine.wire.inputs import AbortRequests, EngineCoreRequest, InputMessage, InvalidRequest, StartDPWave, UtilityCall
from gmock_engine.wire.outputs import engine_core_output, request_error
from gmock_engine.wire.types import FinishReason
from gmock_engine.config.settings import RELOADABLE_SETTINGS, EngineSettings

__all__ = [
    "COORDINATOR",
    "MAX_XARGS_TTFT_MS",
    "MOCK_FAILURE_MESSAGE",
    "MOCK_XARGS",
    "PAUSE_MODES",
    "STATS_INTERVAL_S",
    "SUPPORTED_UTILITIES",
    "Drain",
    "EngineCore",
    "EngineSettings",
    "LedgerViolation",
    "Outbound",
    "PauseState",
    "RELOADABLE_SETTINGS",
]



@dataclass
class Drain:
    """Not a wire message: the process is stopping (--on-stop). With
    `finish`, running and waiting requests go on to their end; without it,
    every one ends now with an ABORT output. Either way new ADDs are answered
    with ABORT from now on, as vLLM's engine does in shutdown."""

    finish: bool


class EngineCore(RequestIntake):
    """One mock engine: applies input and runs a step through its parts."""

    def __init__(self, settings: EngineSettings, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.rank = settings.rank
        self.clock = clock
        self.wire = settings.wire
        self.chunk = settings.output_token_chunk_size
        self.latency = settings.latency
        self.log = logger.bind(engine=self.rank)
        #: Warnings a client can cause (bad values, duplicates, unknown
        #: utilities) are rate-limited per kind.
        self.throttle = Throttle(self.log)
        #: The books on every request, checked against every message sent (ledger.py).
        # remembering checked messages pays only when the same output lists come back
        self.ledger = Ledger(checked_memory=CHECKED_MEMORY if settings.reuse_outputs else 0)
        sampler = self._sampler(settings)
        self.kv = KVCacheManager(
            settings.num_gpu_blocks, settings.block_size, settings.kv_blocks, settings.prefix_caching, settings.kv_events
        )
        #: The adapter registry; None without enable_lora (supports_lora false, §2.5).
        self.lora: Optional[AdapterRegistry] = None
        if settings.enable_lora:
            self.lora = AdapterRegistry(
                settings.max_loras,
                settings.max_cpu_loras or settings.max_loras,
                settings.max_lora_rank,
                settings.lora_check_adapter_dir,
            )
        #: P/D: this engine's producer/consumer side (None: kv_transfer_params are ignored, as vLLM without a connector)
        self.kv_transfer = kv_transfer.KVTransfer(settings.kv_transfer, settings.rank, settings.num_gpu_blocks) if settings.kv_transfer else None
        self.scheduler = Scheduler(
            self.kv,
            sampler,
            self.latency,
            random.Random(f"{settings.seed}/{settings.rank}/latency"),
            self.wire,
            self.chunk,
            settings.max_num_seqs,
            settings.max_num_batched_tokens,
            settings.scheduling_policy,
            async_scheduling=settings.async_scheduling,
            on_preempt=self._log_preempted,
            on_reject=lambda request: self._log_end(request.request_id, 0, FinishReason.ERROR),
            lora=self.lora,
            kv_transfer=self.kv_transfer,
        )
        #: multimodal (core/mm_cache.py): the items the frontend strips are served from
        #: the receiver cache; the scheduler charges the encoder for what its cache lacks
        self.mm_cache = ReceiverCache(settings.mm_processor_cache_bytes)
        self.scheduler.encoder_cache = EncoderCache(settings.encoder_cache_tokens)
        self.scheduler.encoder_budget = settings.encoder_cache_tokens
        if settings.spec_acceptance:  # speculative decoding: a verifier's outcome per step (content/spec_decode.py)
            self.scheduler.spec = SpecDecode(settings.spec_acceptance, settings.seed, settings.rank)
        #: makes each step's tokens and outputs from the scheduler's plan
        self.output_processor = OutputProcessor(self.scheduler, settings.reuse_outputs)
        self._cadence = StatsCadence()
        self.outbox = Outbox(self.rank, clock, self.ledger, self._stats_if_due, settings.has_coordinator, settings.strict_ledger, self.log)
        self.utilities = Utilities(
            self.rank, clock, self.scheduler, self.kv, self.ledger, self.throttle, self.log, settings.supported_tasks, self.abort_all
        )
        self.utilities.lora = self.lora
        self.utilities.mm_caches = (self.mm_cache, self.scheduler.encoder_cache)
        self.shutting_down = False
        #: Where a request's structured answer is made (grammar_wait.py): the
        #: runtime's runs it off the loop; this one at once.
        self.grammar_executor: grammar_wait.GrammarExecutor = grammar_wait.InlineExecutor()
        #: Only what the ledger cannot know: steps, tokens, preemptions (the
        #: scheduler's), utility calls, inputs dropped for a bad client index.
        self.counters = self.scheduler.counters

    def _sampler(self, settings: EngineSettings) -> Sampler:
        """The token source and logprob model of new requests; logprob
        alternatives come from the source's range, so they decode."""
        tokens = settings.token_source or RandomTokens(settings.vocab_size, settings.seed, settings.rank)
        low, span = (tokens.low, tokens.span) if isinstance(tokens, RandomTokens) else (0, settings.vocab_size)
        #: the distinct ids logprob alternatives can be drawn from
        self._logprob_span = span
        return Sampler(tokens, LogprobModel(settings.logprobs_top1, settings.logprobs_sampled_top1, low, span))

    def reconfigure(self, settings: EngineSettings) -> None:
        """Take the RELOADABLE_SETTINGS of `settings` (a reload, SIGHUP); the
        others stay as they were. The runtime calls this between two steps,
        so no step runs half on the old settings. The latency model and the
        scheduler's limits apply from the next step; output lengths, the
        token source and the logprob settings to the requests that arrive
        from now on (a request keeps the end it was planned and the sampler
        of its ADD). A token source that is the same object keeps the
        sampler, so running requests stay on the fast path."""
        current = self.scheduler.sampler
        new = dataclasses.replace(self.settings, **{name: getattr(settings, name) for name in RELOADABLE_SETTINGS})
        same = (
            new.token_source is self.settings.token_source
            and (new.logprobs_top1, new.logprobs_sampled_top1) == (self.settings.logprobs_top1, self.settings.logprobs_sampled_top1)
        )
        sampler = current if same else self._sampler(new)
        self.settings = new
        self.latency = new.latency
        self.scheduler.reconfigure(new.latency, sampler, new.max_num_seqs, new.max_num_batched_tokens)
        if self.scheduler.spec is not None and new.spec_acceptance:
            self.scheduler.spec.set_acceptance(new.spec_acceptance)
        self.outbox.strict_ledger = new.strict_ledger

    # -- queries ---------------------------------------------------------

    @property
    def tokens(self) -> TokenSource:
        """The token source of new requests."""
        return self.scheduler.sampler.tokens

    @property
    def active(self) -> Dict[str, Request]:
        """The running batch, in admission order."""
        return self.scheduler.running

    @property
    def waiting(self) -> "FCFSRequestQueue":
        """The waiting queue (iterates request ids in admission order)."""
        return self.scheduler.waiting

    @property
    def has_work(self) -> bool:
        """True when a step would do something."""
        return self.scheduler.has_work

    @property
    def num_running(self) -> int:
        """Requests in the running batch (those a step advances)."""
        return len(self.scheduler.running)

    @property
    def num_active(self) -> int:
        """Requests not finished yet: running and waiting."""
        return len(self.scheduler.running) + len(self.scheduler.waiting) + len(self.scheduler.waiting_for_fsm)

    @property
    def used_blocks(self) -> int:
        return self.kv.used_blocks

    @property
    def kv_tokens(self) -> int:
        return self.kv.tokens

    @property
    def prefix_cache(self) -> "Optional[PrefixCache]":
        return self.kv.prefix_cache

    @property
    def pause_state(self) -> PauseState:
        return self.scheduler.pause_state

    @property
    def step_delay(self) -> float:
        return self.scheduler.step_delay

    @property
    def stats_provider(self) -> Callable[[], Dict[str, Any]]:
        """Extra figures for the `gmock_stats` utility (set by the runtime)."""
        return self.utilities.stats_provider

    @stats_provider.setter
    def stats_provider(self, provider: Callable[[], Dict[str, Any]]) -> None:
        self.utilities.stats_provider = provider

    @property
    def kv_cache_usage(self) -> float:
        return self.kv.usage

    def next_step_time(self, step_started: float) -> Optional[float]:
        """When the next step is due, on the engine clock (None: idle)."""
        return self.scheduler.next_step_time(step_started)

    # -- input -----------------------------------------------------------

    @property
    def layout(self) -> WireLayout:
        """The wire layout outputs are built in now (`wire`)."""
        return self.wire.layout

    def apply(self, message: InputMessage) -> List[Outbound]:
        """Apply one decoded input message; return what to send at once."""
        if isinstance(message, EngineCoreRequest):
            return self.add_request(message)
        if isinstance(message, grammar_wait.GrammarReady):
            return self.grammar_ready(message)
        if isinstance(message, InvalidRequest):
            return self.reject_request(message.request_id, message.client_index, message.reason)
        if isinstance(message, AbortRequests):
            return self.abort_requests(message.request_ids)
        if isinstance(message, UtilityCall):
            return self.call_utility(message)
        if isinstance(message, Drain):
            self.shutting_down = True
            return [] if message.finish else self.abort_all()
        if isinstance(message, StartDPWave):
            # §3.6 / §6.3: waves are not emulated; no frontend blocks on them.
            self.log.debug("START_DP_WAVE wave={} exclude={!r} ignored", message.wave, message.exclude_engine_index)
            return []
        raise TypeError(f"not an input message: {message!r}")

    def _valid_client(self, client_index: int, what: str) -> bool:
        if client_index < self.settings.num_clients:
            return True
        self.counters["rejected"] += 1
        self.throttle.warning(
            "bad client_index",
            "{} names client_index {} but the frontend has {} output socket(s); dropped",
            what,
            client_index,
            self.settings.num_clients,
        )
        return False

    def reject_request(self, rid: str, client: int, reason: str, code: str = "validation_error") -> List[Outbound]:
        """An ADD the engine cannot serve (a bad value, §3.2/§3.3): one ERROR
        output for that request, naming what was wrong; nothing else changes."""
        if not self._valid_client(client, f"ADD {short(rid)}"):
            return []
        self.ledger.started(rid)
        self.throttle.warning("invalid request", "ADD {}: {}; answered with ERROR", short(rid), reason)
        return self._answer_now(client, rid, FinishReason.ERROR, request_error(code, reason))

    def abort_requests(self, request_ids: List[str]) -> List[Outbound]:
        """ABORT (§3.4): end the listed active ids; unknown ids are ignored."""
        for rid in request_ids:
            entry = self.scheduler.remove(rid)
            if entry is not None:
                self._end(entry, FinishReason.ABORT)
        return self._flush()

    def abort_all(self) -> List[Outbound]:
        """End every in-flight request with an explicit ABORT output (§3.4:
        pause/sleep in mode abort; the frontend does not end those streams)."""
        for entry in self.scheduler.remove_all():
            self._end(entry, FinishReason.ABORT)
        return self._flush()

    def call_utility(self, call: UtilityCall) -> List[Outbound]:
        """Answer a UTILITY exactly once on outputs[client_index] (§3.5),
        except pause mode "wait", answered when the engine has drained."""
        if not self._valid_client(call.client_index, f"UTILITY {short(call.method, 60)} (call id {call.call_id})"):
            return []
        self.counters["utility_calls"] += 1
        return self.utilities.call(call)

    def fail_utility(self, call: UtilityCall, failure: str) -> List[Outbound]:
        """Answer a utility call with `failure_message` without running it
        (--fault-fail-utility)."""
        if not self._valid_client(call.client_index, f"UTILITY {short(call.method, 60)} (call id {call.call_id})"):
            return []
        self.counters["utility_calls"] += 1
        return [self.utilities.reply(call, failure=failure)]

    # -- failures the runtime contains ------------------------------------------

    def answer_failure(self, message: InputMessage, exc: BaseException) -> List[Outbound]:
        """Applying `message` raised (a bug its content found): answer what
        it asked for with an error so its client is not left waiting, and
        keep the engine's state and books consistent. The runtime calls this;
        an exception from here is a failure of the engine itself."""
        reason = f"gmock_engine failed on this input ({type(exc).__name__}: {str(exc):.200})"
        if isinstance(message, (EngineCoreRequest, InvalidRequest)):
            rid, client = message.request_id, message.client_index
            if not self._valid_client(client, f"ADD {short(rid)}"):
                return []
            if self.scheduler.remove(rid, RequestStatus.FINISHED_ERROR) is None and rid not in self.ledger.open:
                self.ledger.started(rid)
            return self._answer_now(client, rid, FinishReason.ERROR, request_error("internal_error", reason))
        if isinstance(message, UtilityCall) and self._valid_client(message.client_index, f"UTILITY {short(message.method)}"):
            return [self.utilities.reply(message, failure=reason)]
        return []

    def fail_all(self, reason: str) -> List[Outbound]:
        """End every running and waiting request with ERROR (a step failed:
        no request is left waiting for tokens that will not come)."""
        error = request_error("internal_error", reason)
        self.outbox.discard()  # whatever the failed step had gathered
        for entry in self.scheduler.remove_all(RequestStatus.FINISHED_ERROR):
            output = engine_core_output(entry.request_id, [], FinishReason.ERROR, error, self.layout)
            self.outbox.end(entry.client_index, entry.request_id, output)
            self._log_end(entry.request_id, entry.num_output_tokens, FinishReason.ERROR)
        return self._flush()

    # -- the decode step -------------------------------------------------

    def step(self) -> List[Outbound]:
        """One step boundary, in vLLM's order: the output processor makes
        the tokens and outputs of the step that ends now
        (`update_from_output`), what ended leaves the batch
        (`Scheduler.retire`: its slot, token budget and KV are free), then
        the scheduler decides the next step (admissions, preemptions, the
        token budget: `Scheduler.schedule`), whose rejections and new
        requests the output processor takes (`take_plan`), and times it
        (`Scheduler.time_step`); one EngineCoreOutputs per client. With
        async scheduling vLLM decided the next step before this one's
        outputs: it is scheduled first, with what ends now still in the
        batch. A prompt computed in no time (no latency model) has its
        first output at the boundary that scheduled it. A steady step
        (lanes.py) takes the lanes' short path."""
        processor = self.output_processor
        steady = processor.steady_step()
        if steady is not None:
            # lanes only: nothing ended (nothing to log), requests still
            # running (no drained reply due: utilities.check_drained)
            return self.outbox.flush_step(*steady)
        scheduler = self.scheduler
        if not scheduler.has_work:
            return []
        now = self.clock()
        if scheduler.async_scheduling:
            scheduler_output = scheduler.schedule(now)
            processor.take_plan(scheduler_output, self.outbox)
            done = processor.update_from_output(now, self.outbox)
            scheduler.retire(done)
            scheduler.time_step(scheduler_output)
        else:
            done = processor.update_from_output(now, self.outbox)
            scheduler.retire(done)
            if scheduler.has_work:
                scheduler_output = scheduler.schedule(now)
                processor.take_plan(scheduler_output, self.outbox)
                ready = scheduler.prefilled_now
                if ready:
                    # no latency model: the step that computes these prompts
                    # ends as it begins, their first output is in this one
                    scheduler.prefilled_now = ()
                    ended = processor.prefilled_at_once(ready, now, self.outbox)
                    scheduler.retire(ended)
                    done = done + ended if done else ended
                scheduler.time_step(scheduler_output)
        if self.settings.log_requests:
            for entry in done:
                self._log_end(entry.request_id, entry.num_output_tokens, entry.finish)
        return self._flush()

    def take_kv_events(self) -> List[Tuple[Any, ...]]:
        """The KV events since the last call (prefix_cache.py tuples), in
        order: the runtime calls this after each step and each input, and
        hands them to the publisher as one batch (vLLM: one per step)."""
        return self.kv.take_events()

    # -- helpers -----------------------------------------------------------

    def _answer_now(self, client: int, rid: str, reason: FinishReason, error: Optional[Dict[str, Any]] = None) -> List[Outbound]:
        """A terminal output with no tokens for a request that never ran."""
        self.outbox.end(client, rid, engine_core_output(rid, [], reason, error, self.layout))
        self._log_end(rid, 0, reason)
        return self._flush()

    def _end(self, entry: Request, reason: FinishReason) -> None:
        """A terminal output for a request that was active (already removed)."""
        self.outbox.end(entry.client_index, entry.request_id, engine_core_output(entry.request_id, [], reason, None, self.layout))
        self._log_end(entry.request_id, entry.num_output_tokens, reason)

    def _log_end(self, rid: str, output_tokens: int, reason: FinishReason) -> None:
        if not self.settings.log_requests:
            return
        if reason is FinishReason.ABORT:
            self.log.info("mock request aborted engine={} request_id={} output_tokens={}", self.rank, short(rid), output_tokens)
        else:
            self.log.info(
                "mock request finished engine={} request_id={} output_tokens={} finish_reason={}",
                self.rank,
                short(rid),
                output_tokens,
                reason.name.lower(),
            )

    def _log_preempted(self, entry: Request) -> None:
        if self.settings.log_requests:
            self.log.info("mock request preempted engine={} request_id={}", self.rank, short(entry.request_id))

    def _flush(self) -> List[Outbound]:
        out = self.outbox.flush()
        self.utilities.check_drained(out)
        return out

    def _stats_if_due(self, now: float) -> Optional[Dict[str, Any]]:
        """SchedulerStats for the outbox when something they show moved."""
        scheduler, kv, cadence = self.scheduler, self.kv, self._cadence
        if now < cadence.quiet_until and len(scheduler.running) > len(scheduler.transferring):
            return None  # StatsCadence.due's first rule, before the counts are taken (every step)
        running, waiting = scheduler.request_counts()  # P/D: a request waiting for its KV is waiting
        spec = scheduler.spec
        if not cadence.due(now, running, waiting, kv.usage, kv.stats_pending or (spec is not None and spec.num_drafts > 0)):
            return None
        return scheduler.scheduler_stats(kv.take_prefix_cache_stats(), spec.take_stats() if spec is not None else None)

    def scheduler_stats(self, prefix_cache_stats: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
        """The engine's SchedulerStats now (§7.1)."""
        return self.scheduler.scheduler_stats(prefix_cache_stats)
