"""The engine core: a thin owner of one engine's parts, pure (no sockets,
no greenlets; vLLM: `vllm/v1/engine/core.py`).

`EngineCore` applies the decoded protocol messages (`apply`) and runs the
decode step (`step`); both return the messages to send as
`(client_index, EngineCoreOutputs array)` pairs, in order. The parts, where
vLLM keeps them:

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

from gmock_engine.content import answer as content, pooling
from gmock_engine.core import grammar_wait
from gmock_engine.kv import transfer as kv_transfer
from gmock_engine.core.kv_cache_manager import KVCacheManager
from gmock_engine.core.ledger import CHECKED_MEMORY, Ledger
from gmock_engine.content.logprobs import LogprobModel
from gmock_engine.utils.logs import Throttle, short
from gmock_engine.core.lora import AdapterRegistry, decode_lora_request
from gmock_engine.core.mm_cache import EncoderCache, ReceiverCache
from gmock_engine.core.outbox import COORDINATOR, STATS_INTERVAL_S, LedgerViolation, Outbound, Outbox, StatsCadence
from gmock_engine.core.prefix_cache import PrefixCache
from gmock_engine.timing.replay import follow
from gmock_engine.core.request import Request, plan
from gmock_engine.core.request_queue import FCFSRequestQueue
from gmock_engine.core.output_processor import MOCK_FAILURE_MESSAGE, OutputProcessor
from gmock_engine.core.request import RequestStatus
from gmock_engine.content.sampler import Sampler
from gmock_engine.core.sched_output import PauseState
from gmock_engine.core.scheduler import Scheduler
from gmock_engine.content.spec_decode import SpecDecode
from gmock_engine.content.tokens import RandomTokens, TokenSource, request_seed
from gmock_engine.core.utilities import PAUSE_MODES, SUPPORTED_UTILITIES, Utilities
from gmock_engine.wire.checks import MAX_XARGS_TTFT_MS, MOCK_XARGS, NO_XARGS, BadXargs, Xargs, check_xargs
from gmock_engine.wire.eras import WireLayout
from gmock_engine.wire.inputs import AbortRequests, EngineCoreRequest, InputMessage, InvalidRequest, StartDPWave, UtilityCall
from gmock_engine.wire.outputs import engine_core_event, engine_core_output, mm_cache_miss_output, request_error
from gmock_engine.wire.types import BadValue, EngineCoreEventType, FinishReason
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

#: read once per ADD: a module constant, not an enum member lookup (a metaclass attribute lookup per use)
_QUEUED = EngineCoreEventType.QUEUED


@dataclass
class Drain:
    """Not a wire message: the process is stopping (--on-stop). With
    `finish`, running and waiting requests go on to their end; without it,
    every one ends now with an ABORT output. Either way new ADDs are answered
    with ABORT from now on, as vLLM's engine does in shutdown."""

    finish: bool


class EngineCore:
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

    def add_request(self, request: EngineCoreRequest) -> List[Outbound]:
        """ADD (§3.2, §9.3): checked, planned, queued."""
        rid, client = request.request_id, request.client_index
        if not self._valid_client(client, f"ADD {short(rid)}"):
            return []
        self.ledger.started(rid)
        # --replay: every ADD takes its turn, as each was recorded (timing/replay.py)
        recorded = self.settings.replay.take(self.rank, rid) if self.settings.replay is not None else None
        # A duplicate first: even an abort_immediately ADD must not end the original.
        if rid in self.scheduler.running or rid in self.scheduler.waiting or rid in self.scheduler.waiting_for_fsm:
            self.throttle.warning("duplicate request id", "ADD {}: duplicate of an active request id; answered with ERROR", short(rid))
            error = request_error("duplicate_request_id", f"request id {short(rid)} is already active")
            return self._answer_now(client, rid, FinishReason.ERROR, error)
        if request.abort_immediately:
            # §3.2 idx 19: no output, only the id in finished_requests.
            self.outbox.finish(client, rid)
            return self._flush()
        if self.shutting_down:
            # vLLM's _reject_add_in_shutdown: an ABORT output for the newcomer
            return self._answer_now(client, rid, FinishReason.ABORT)
        if not request.has_sampling_params and request.pooling_params is None:
            self.throttle.warning("pooling request", "ADD {}: sampling_params is nil (pooling request); answered with ERROR", short(rid))
            return self._answer_now(client, rid, FinishReason.ERROR, request_error("unsupported", "the mock engine only generates"))
        if self.utilities.reject_new_requests:
            error = request_error("engine_paused", "Generation is paused. Please retry after it resumes.", retryable=True)
            return self._answer_now(client, rid, FinishReason.ERROR, error)
        if request.prompt_len > self.settings.max_model_len:
            reason = f"the prompt has {request.prompt_len} tokens, more than max_model_len {self.settings.max_model_len}"
            self.throttle.warning("invalid request", "ADD {}: {}; answered with ERROR", short(rid), reason)
            return self._answer_now(client, rid, FinishReason.ERROR, request_error("validation_error", reason))
        if request.mm_features:
            missing = self.mm_cache.receive(request.mm_features)
            if missing:
                # the frontend stripped items this engine does not hold: vLLM's
                # _handle_mm_cache_miss, a retryable ERROR naming them
                self.throttle.warning("mm cache miss", "ADD {}: {} multimodal item(s) not in the engine's cache; answered with ERROR",
                                      short(rid), len(missing))  # fmt: skip
                error = request_error("multimodal_cache_miss", "Multi-modal processor cache miss.", retryable=True)
                self.outbox.end(client, rid, mm_cache_miss_output(rid, missing, error, self.layout))
                self._log_end(rid, 0, FinishReason.ERROR)
                return self._flush()
        if not request.has_sampling_params:
            return self._add_pooling(request)
        lora_request = None
        if request.lora_request is not None:
            # a bad LoRARequest ends this request only (vLLM's would fail in
            # msgspec or LoRARequest.__post_init__); without --enable-lora the
            # error is vLLM's input processor's (_validate_lora)
            try:
                lora_request = decode_lora_request(request.lora_request)
            except BadValue as exc:
                return self._invalid(client, rid, exc)
            if self.lora is None:
                reason = f"Got lora_request {lora_request.lora_name!r} but LoRA is not enabled!"
                self.throttle.warning("invalid request", "ADD {}: {}; answered with ERROR", short(rid), reason)
                return self._answer_now(client, rid, FinishReason.ERROR, request_error("validation_error", reason))
        max_tokens = request.max_tokens or 0
        sampler = self.scheduler.sampler
        entry = Request(rid, client, max_tokens, sampler.tokens.initial_state(rid, request.prompt_token_ids), request.prompt_len, self.clock())
        entry.sampler = sampler
        entry.lora_request = lora_request
        entry.mm_features = request.mm_features
        entry.pending_events = [engine_core_event(_QUEUED, entry.queued_at)]
        settings = self.settings
        try:
            # every vllm_xargs key the engine reads, checked in one place (most requests carry none)
            xargs = check_xargs(request.extra_args) if request.extra_args else NO_XARGS
        except BadXargs as exc:
            reason = f"{str(exc):.200}"
            self.throttle.warning("invalid request", "ADD {}: bad vllm_xargs ({}); answered with ERROR", short(rid), reason)
            return self._answer_now(client, rid, FinishReason.ERROR, request_error("validation_error", f"bad vllm_xargs: {reason}"))
        except BadValue as exc:
            return self._invalid(client, rid, exc)
        plan(entry, request, xargs, sampler.tokens, settings.max_model_len, settings.output_lengths, settings.seed, self.rank)
        if recorded is not None:
            follow(entry, recorded, request.eos_token_id, min(max_tokens, max(0, settings.max_model_len - request.prompt_len)))
        if recorded is None and settings.tokenizer is not None and grammar_wait.needs_grammar(request, xargs, settings):
            # a grammar to compile and walk: off the loop, the request held until it is done
            self.scheduler.hold(entry)
            held = grammar_wait.GrammarReady(rid, entry, request, xargs, self.clock())
            cap = min(max_tokens, max(0, settings.max_model_len - request.prompt_len))
            job = grammar_wait.shaping_job(held, settings, self.rank, cap)
            ready = self.grammar_executor.submit(job, dataclasses.replace(held, timed_out=True), settings.grammar_timeout_s or None)
            return self.grammar_ready(ready) if ready is not None else []
        try:
            # tool calls without tools in the prompt, reasoning spans (content/answer.py): most requests ask for none
            if recorded is None and (request.structured_outputs is not None or xargs is not NO_XARGS
                                     or (settings.content.active and settings.tokenizer is not None)):
                why = content.shape(entry, request, xargs, settings, self.rank, min(max_tokens, max(0, settings.max_model_len - request.prompt_len)))
                if why is not None:
                    self.throttle.warning("content", "ADD {}: {}", short(rid), why)
        except BadValue as exc:
            return self._invalid(client, rid, exc)
        return self._queue(entry, request, xargs)

    def grammar_ready(self, ready: grammar_wait.GrammarReady) -> List[Outbound]:
        """A held request's structured answer is made (or failed, or its
        time limit passed): queued for scheduling as vLLM's WAITING_FOR_FSM
        request whose grammar is ready, or ended with ERROR. An outcome for
        a request no longer held (aborted meanwhile) is dropped."""
        entry = ready.request
        if not self.scheduler.release(entry):
            return []
        request, xargs = ready.core_request, ready.xargs
        client, rid = entry.client_index, entry.request_id
        timeout = self.settings.grammar_timeout_s
        if ready.timed_out or (timeout and self.clock() - ready.since > timeout):
            reason = grammar_wait.timeout_message(timeout)
            self.throttle.warning("grammar timeout", "ADD {}: {}; answered with ERROR", short(rid), reason)
            return self._answer_now(client, rid, FinishReason.ERROR, request_error("validation_error", reason))
        if ready.error is not None:
            if not isinstance(ready.error, BadValue):
                # a bug the request's content found: that request ends, as one in add_request would
                self.throttle.warning("contained failure", "ADD {}: shaping failed ({!r}); answered with ERROR", short(rid), ready.error)
                return self.answer_failure(request, ready.error)
            return self._invalid(client, rid, ready.error)
        if ready.why is not None:
            self.throttle.warning("content", "ADD {}: {}", short(rid), ready.why)
        return self._queue(entry, request, xargs)

    def _invalid(self, client: int, rid: str, exc: BaseException) -> List[Outbound]:
        """A value the request cannot be served with: ERROR naming it."""
        reason = f"{str(exc):.200}"
        self.throttle.warning("invalid request", "ADD {}: {}; answered with ERROR", short(rid), reason)
        return self._answer_now(client, rid, FinishReason.ERROR, request_error("validation_error", reason))

    def _queue(self, entry: Request, request: EngineCoreRequest, xargs: Xargs) -> List[Outbound]:
        """The last of an ADD, once its content is shaped: its P/D plan,
        the log line, its KV and logprobs, and the waiting queue."""
        rid, client, settings = entry.request_id, entry.client_index, self.settings
        max_tokens = request.max_tokens or 0
        lora_request = entry.lora_request
        if request.extra_args:  # P/D params ride in extra_args: most requests carry none
            try:
                entry.kv = self._plan_kv_transfer(entry, request, xargs)
            except BadValue as exc:
                return self._invalid(client, rid, exc)
        else:
            entry.kv = None
        if settings.log_requests:
            self.log.info(
                "mock request started engine={} request_id={} prompt_len={} max_tokens={} chunk={}{}",
                self.rank,
                short(rid),
                request.prompt_len,
                max_tokens,
                self.chunk,
                # the adapter it names, for per-adapter counts from the log (docs/lora.md)
                ("" if lora_request is None else f" lora={short(lora_request.lora_name, 60)}")
                # its multimodal items, and how many came without data (served from the receiver cache)
                + ("" if not request.mm_features else
                   f" mm_items={len(request.mm_features)} mm_stripped={sum(f.data_bytes is None for f in request.mm_features)}"),
            )
        if max_tokens == 0:
            return self._answer_now(client, rid, FinishReason.LENGTH)
        entry.priority = request.priority
        self.kv.track(entry, request.prompt_token_ids)
        if request.logprobs is not None or request.prompt_logprobs is not None:
            asked = max(request.logprobs or 0, request.prompt_logprobs or 0)
            if asked + 1 > self._logprob_span:
                reason = f"{asked} logprobs asked, but the engine makes only {self._logprob_span} distinct token ids"
                self.throttle.warning("invalid request", "ADD {}: {}; answered with ERROR", short(rid), reason)
                return self._answer_now(client, rid, FinishReason.ERROR, request_error("validation_error", reason))
            entry.num_logprobs = request.logprobs
            entry.num_prompt_logprobs = request.prompt_logprobs
            entry.shaped = True
            entry.logprob_state = request_seed(settings.seed, self.rank, rid) ^ 0x5DEECE66D
            if request.prompt_logprobs is not None:
                entry.prompt_token_ids = request.prompt_token_ids
        self.scheduler.add_request(entry)
        return []

    def _add_pooling(self, request: EngineCoreRequest) -> List[Outbound]:
        """A pooling request (§3.7): its tensor made now, then one prefill; a bad one gets an ERROR."""
        try:
            pooled = pooling.request_tensor(request, self.settings)
        except BadValue as exc:
            return self._invalid(request.client_index, request.request_id, exc)
        # one "token" to go (its prefill), no token source
        entry = Request(request.request_id, request.client_index, 1, None, request.prompt_len, self.clock())
        entry.pooling, entry.priority = pooled, request.priority
        entry.pending_events = [engine_core_event(_QUEUED, entry.queued_at)]
        self.kv.track(entry, request.prompt_token_ids)
        self.scheduler.add_request(entry)
        return []

    def _plan_kv_transfer(self, entry: Request, request: EngineCoreRequest, xargs: Xargs) -> Optional[kv_transfer.KVPlan]:
        """P/D (kv/transfer.py): a producer request ends after its first token
        (LENGTH, as vLLM's with the proxy's max_tokens=1); BadValue for bad params."""
        kv = kv_transfer.plan(self.kv_transfer, request.extra_args, xargs)
        if kv is None and self.kv_transfer is None and request.extra_args.get("kv_transfer_params") is not None:
            self.throttle.warning("kv_transfer_params ignored", "ADD {}: kv_transfer_params but no --kv-role; ignored, as vLLM without a KV connector", short(entry.request_id))
        if kv is not None and self.settings.log_requests:
            # the params as this engine got them: the e2e tests check a proxy passed them on unchanged
            self.log.info(
                "mock request kv_transfer engine={} request_id={} role={} kv_transfer_params={}",
                self.rank,
                short(entry.request_id),
                "producer" if kv.produce else "consumer",
                kv_transfer.describe(request.extra_args.get("kv_transfer_params")),
            )
        if kv is not None and kv.produce and entry.max_tokens > 1:
            entry.max_tokens = 1
            if entry.finish is FinishReason.STOP:  # its EOS would have come later
                entry.finish, entry.last_token, entry.stop_reason = FinishReason.LENGTH, None, None
        return kv

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
