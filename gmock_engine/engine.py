"""Engine state and step: pure, no sockets, no greenlets.

`EngineCore` owns one engine's requests. Its inputs are the decoded protocol
messages (`apply`) and the decode step (`step`); both return the messages to
send as `(client_index, EngineCoreOutputs array)` pairs, in order. The
greenlet wiring (`runtime.py`) moves frames in and out; everything that
decides *what* the engine says lives here and is unit-tested without I/O.

Behaviour is the Rust mock's (PROTOCOL.md §9.3) plus what the real frontends
need from an engine: pause/sleep that end in-flight streams (§3.4, §5),
`finished_requests` for every end (§3.4, §6.1), SchedulerStats, events and
prefill stats (§4.5, §7).

Scheduling: an ADD goes to the waiting queue (FCFS, or by `priority` with
the priority policy); each step first admits waiting requests while the
running batch is below `max_num_seqs` (no limit unless configured) and the
engine is not paused, then advances every running request whose prefill is
done (latency.py). Waiting requests are what the frontends show as
`num_requests_waiting`.
"""

from __future__ import annotations

import enum
import heapq
import itertools
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

from loguru import logger

from . import protocol
from .logs import Throttle, short
from .protocol import (
    TOKEN_ID_LIMIT,
    AbortRequests,
    BadValue,
    EngineCoreEventType,
    EngineCoreRequest,
    FinishReason,
    InputMessage,
    InvalidRequest,
    StartDPWave,
    UtilityCall,
    WireLayout,
)
from .latency import LatencyModel
from .ledger import Ledger
from .lengths import OutputLengths
from .prefix_cache import PrefixCache, block_hashes
from .tokens import RandomTokens, TokenSource, request_seed

#: One message to send: (client index = output socket, EngineCoreOutputs array).
Outbound = Tuple[int, List[Any]]

PAUSE_MODES = ("abort", "wait", "keep")
#: Client index of the coordinator_output socket in Outbound pairs (vLLM uses -1 too).
COORDINATOR = -1
#: SchedulerStats go out when running/waiting changed, at most this often
#: (at once when the engine becomes idle, so gauges drop to 0 promptly).
STATS_INTERVAL_S = 0.05
#: The error of a request ended by mock_fail_after (vllm_xargs, or --fault-error-mid-stream).
MOCK_FAILURE_MESSAGE = "mock failure on request (vllm_xargs mock_fail_after or --fault-error-mid-stream)"
#: Upper bound of vllm_xargs mock_ttft_ms (one hour): a timer needs a finite time.
MAX_XARGS_TTFT_MS = 3_600_000
#: The vllm_xargs keys the engine reads (README, "Per-request scenarios"); any
#: other `mock_` key is refused, so a typo is an error and not a silent no-op.
MOCK_XARGS = ("mock_output_len", "mock_stop_token_id", "mock_finish", "mock_fail_after", "mock_ttft_ms")
_INT64_MAX = (1 << 63) - 1


class PauseState(enum.Enum):
    """As in vLLM's scheduler: PAUSED_NEW holds new requests but keeps
    stepping the running ones; PAUSED_ALL steps nothing."""

    UNPAUSED = "unpaused"
    PAUSED_NEW = "paused_new"
    PAUSED_ALL = "paused_all"


@dataclass
class EngineSettings:
    """What one engine needs to know; built by the entry point from the config."""

    rank: int
    num_clients: int
    output_token_chunk_size: int = 1
    vocab_size: int = 32000
    seed: int = 0
    log_requests: bool = False
    supported_tasks: Tuple[str, ...] = ("generate",)
    num_gpu_blocks: int = 65536
    block_size: int = 16
    #: INIT named a DP coordinator: stats also go to it (client index -1, §6.2).
    has_coordinator: bool = False
    #: Running-batch limit; None: unlimited (the default unless configured).
    max_num_seqs: Optional[int] = None
    #: "fcfs", or "priority": lower `priority` first, then arrival (as vLLM).
    scheduling_policy: str = "fcfs"
    latency: LatencyModel = field(default_factory=LatencyModel)
    #: Tokens until EOS (lengths.py); None: requests end by max_tokens only.
    output_lengths: Optional[OutputLengths] = None
    #: prompt + output never beyond this (then LENGTH), as a real engine.
    max_model_len: int = 1 << 20
    #: tokens.py source; None: random ids from [0, vocab_size).
    token_source: Optional[TokenSource] = None
    #: KV blocks enforced (None: only reported): a running request holds
    #: ceil(tokens / block_size); when they run out the newest is preempted.
    kv_blocks: Optional[int] = None
    #: Per-step token budget enforced (None: unlimited): decodes first, then
    #: prefill in chunks of what is left.
    max_num_batched_tokens: Optional[int] = None
    #: Prefix caching: prompt blocks seen before are not prefilled again.
    prefix_caching: bool = False
    #: A ledger violation raises LedgerViolation (the process stops) instead of only being logged.
    strict_ledger: bool = False
    layout: WireLayout = field(default_factory=lambda: protocol.WIRE_LAYOUTS[protocol.DEFAULT_PROTOCOL_VERSION])


class ActiveRequest:
    """A request, waiting or running."""

    __slots__ = (
        "request_id",
        "client_index",
        "max_tokens",
        "num_output_tokens",
        "rng_state",
        "prompt_len",
        "queued_at",
        "scheduled_at",
        "ready_at",
        "finish",
        "stop_reason",
        "last_token",
        "stop_ids",
        "priority",
        "prefill_left",
        "blocks",
        "pending_events",
        "ttft_ms",
        "block_hashes",
        "cached_tokens",
    )

    def __init__(
        self, request_id: str, client_index: int, max_tokens: int, rng_state: int, prompt_len: int, queued_at: float
    ) -> None:
        self.request_id = request_id
        self.client_index = client_index
        self.max_tokens = max_tokens
        self.num_output_tokens = 0
        self.rng_state = rng_state
        self.prompt_len = prompt_len
        #: Engine clock at ADD / at admission: the QUEUED and SCHEDULED events (§4.5).
        self.queued_at = queued_at
        self.scheduled_at = queued_at
        #: Engine clock from which its first token may come (prefill done).
        self.ready_at = queued_at
        #: How it ends after `max_tokens` tokens (the plan, see EngineCore._plan_end).
        self.finish = FinishReason.LENGTH
        self.stop_reason: Optional[int] = None
        self.last_token: Optional[int] = None
        #: Ids random tokens must avoid (a real engine would have stopped on them).
        self.stop_ids: Optional[frozenset] = None
        self.priority = 0
        #: Tokens still to prefill in chunks (token budget enforced) and KV blocks held.
        self.prefill_left = 0
        self.blocks = 0
        #: EngineCoreEvents for its next output (QUEUED/PREEMPTED, SCHEDULED).
        self.pending_events: Optional[List[Dict[str, Any]]] = None
        #: vllm_xargs mock_ttft_ms: this request's fixed time to first token.
        self.ttft_ms: Optional[float] = None
        #: Prefix caching: the prompt's chained block hashes, and its cached tokens.
        self.block_hashes: Tuple[int, ...] = ()
        self.cached_tokens = 0


class _Batch:
    """Outputs for one client, gathered during one call (§4.1: one message per client)."""

    __slots__ = ("outputs", "finished")

    def __init__(self) -> None:
        self.outputs: List[List[Any]] = []
        self.finished: List[str] = []


@dataclass
class Drain:
    """Not a wire message: the process is stopping (--on-stop). With
    `finish`, running and waiting requests go on to their end; without it,
    every one ends now with an ABORT output. Either way new ADDs are answered
    with ABORT from now on, as vLLM's engine does in shutdown."""

    finish: bool


class EngineCore:
    """One mock engine: its active requests, pause/sleep state and counters."""

    def __init__(self, settings: EngineSettings, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.rank = settings.rank
        self.clock = clock
        self.tokens: TokenSource = settings.token_source or RandomTokens(settings.vocab_size, settings.seed, settings.rank)
        self.chunk = settings.output_token_chunk_size
        self.layout = settings.layout
        #: The running batch, in admission order.
        self.active: Dict[str, ActiveRequest] = {}
        #: Requests not admitted yet (queue order for FCFS).
        self.waiting: Dict[str, ActiveRequest] = {}
        #: Priority policy: (priority, arrival seq, id); aborted ids are skipped lazily.
        self._priority_queue: List[Tuple[int, int, str]] = []
        self._arrivals = itertools.count()
        #: Running requests whose prefill is not done: id -> ready_at.
        self.prefilling: Dict[str, float] = {}
        #: Running requests with prompt tokens still to prefill (token budget).
        self.chunking: Dict[str, ActiveRequest] = {}
        self.used_blocks = 0
        self.prefix_cache: Optional[PrefixCache] = (
            PrefixCache(settings.kv_blocks or settings.num_gpu_blocks, settings.block_size) if settings.prefix_caching else None
        )
        self.latency = settings.latency
        self._rng = random.Random(f"{settings.seed}/{settings.rank}/latency")
        #: Engine time the last step asked its successor to wait (latency model).
        self.step_delay = 0.0
        self.pause_state = PauseState.UNPAUSED
        #: pause_generation in modes abort/wait rejects new ADDs (0.33, §5).
        self.reject_new_requests = False
        self.sleep_level = 0
        self.shutting_down = False
        self.weight_version: Optional[str] = None
        #: Utility calls answered when the engine has drained (pause mode "wait").
        self._replies_when_drained: List[Tuple[int, int]] = []
        self.counters: Counter = Counter()
        #: The books on every request, checked against every message sent (ledger.py).
        self.ledger = Ledger()
        #: Σ (prompt + output tokens) of the running requests, for kv_cache_usage.
        self.kv_tokens = 0
        self._kv_capacity = max(1, settings.num_gpu_blocks * settings.block_size)
        self._stats_counts: Tuple[int, int] = (0, 0)
        self._stats_kv_usage = 0.0
        self._stats_at = float("-inf")
        #: Extra figures for the `gmock_stats` utility (set by the runtime).
        self.stats_provider: Callable[[], Dict[str, Any]] = dict
        self.log = logger.bind(engine=self.rank)
        #: Warnings a client can cause (bad values, duplicates, unknown
        #: utilities) are rate-limited per kind.
        self.throttle = Throttle(self.log)

    # -- queries ---------------------------------------------------------

    @property
    def can_admit(self) -> bool:
        """Waiting requests may join the running batch now."""
        limit = self.settings.max_num_seqs
        return self.pause_state is PauseState.UNPAUSED and (limit is None or len(self.active) < limit)

    @property
    def has_work(self) -> bool:
        """True when a step would do something."""
        if self.pause_state is PauseState.PAUSED_ALL:
            return False
        return bool(self.active) or (bool(self.waiting) and self.can_admit)

    @property
    def num_active(self) -> int:
        """Requests not finished yet: running and waiting."""
        return len(self.active) + len(self.waiting)

    def next_step_time(self, step_started: float) -> Optional[float]:
        """When the next step is due, on the engine clock (None: idle).

        The step after one that started at `step_started` comes `step_delay`
        later; but if nothing could emit then (every running request still
        prefilling, nothing to admit), it comes when the first prefill is done.
        """
        if not self.has_work:
            return None
        due = step_started + self.step_delay
        if (
            self.prefilling
            and not self.chunking  # chunked prefills progress every step
            and len(self.prefilling) == len(self.active)
            and not self._head_admissible()
        ):
            due = max(due, min(self.prefilling.values()))
        return due

    def _head_admissible(self) -> bool:
        """The next waiting request could join the batch now (limit, pause, KV)."""
        if not (self.waiting and self.can_admit):
            return False
        kv_blocks = self.settings.kv_blocks
        if kv_blocks is None:
            return True
        return self.used_blocks + self._blocks_to_admit(self._peek_waiting()) <= kv_blocks

    def _blocks_for(self, tokens: int) -> int:
        """KV blocks that hold `tokens` tokens."""
        return -(-tokens // self.settings.block_size)

    def _next_tokens(self, entry: ActiveRequest) -> int:
        """Tokens the request emits in its next decode step."""
        remaining = entry.max_tokens - entry.num_output_tokens
        return self.chunk if self.chunk < remaining else remaining

    def _blocks_to_admit(self, entry: ActiveRequest) -> int:
        """Blocks a waiting request needs to join the batch: its prompt and
        what it already generated (recomputed after a preemption), plus its
        next token's slot, so that it is never preempted by its own first
        decode step (vLLM allocates the new tokens' slots at admission)."""
        return self._blocks_for(entry.prompt_len + entry.num_output_tokens + self._next_tokens(entry))

    # -- input -----------------------------------------------------------

    def apply(self, message: InputMessage) -> List[Outbound]:
        """Apply one decoded input message; return what to send at once."""
        if isinstance(message, EngineCoreRequest):
            return self.add_request(message)
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
        batches: Dict[int, _Batch] = {}
        self._finish_now(batches, client, rid, FinishReason.ERROR, protocol.request_error(code, reason))
        return self._flush(batches)

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
            entry = self.active.pop(rid, None)
            if entry is not None:
                self._release(entry)
            elif self.waiting.pop(rid, None) is None and rid not in self.ledger.open:
                self.ledger.started(rid)
            batches: Dict[int, _Batch] = {}
            self._finish_now(batches, client, rid, FinishReason.ERROR, protocol.request_error("internal_error", reason))
            return self._flush(batches)
        if isinstance(message, UtilityCall) and self._valid_client(message.client_index, f"UTILITY {short(message.method)}"):
            return [self._reply(message, failure=reason)]
        return []

    def fail_all(self, reason: str) -> List[Outbound]:
        """End every running and waiting request with ERROR (a step failed:
        no request is left waiting for tokens that will not come)."""
        batches: Dict[int, _Batch] = {}
        error = protocol.request_error("internal_error", reason)
        for entry in [*self.active.values(), *self.waiting.values()]:
            batch = self._batch(batches, entry.client_index)
            batch.outputs.append(protocol.engine_core_output(entry.request_id, [], FinishReason.ERROR, error, self.layout))
            batch.finished.append(entry.request_id)
            self._count_finish(entry, FinishReason.ERROR)
        self.active.clear()
        self.waiting.clear()
        self._priority_queue.clear()
        self.prefilling.clear()
        self.chunking.clear()
        self.used_blocks = self.kv_tokens = 0
        out = self._flush(batches)
        self._check_drained(out)
        return out

    def add_request(self, request: EngineCoreRequest) -> List[Outbound]:
        """ADD (§3.2, §9.3)."""
        rid = request.request_id
        if not self._valid_client(request.client_index, f"ADD {rid}"):
            return []
        batches: Dict[int, _Batch] = {}
        client = request.client_index
        self.ledger.started(rid)
        # A duplicate first: even an abort_immediately ADD must not end the original.
        if rid in self.active or rid in self.waiting:
            self.throttle.warning("duplicate request id", "ADD {}: duplicate of an active request id; answered with ERROR", short(rid))
            self._finish_now(
                batches, client, rid, FinishReason.ERROR, protocol.request_error("duplicate_request_id", f"request id {short(rid)} is already active")
            )
            return self._flush(batches)
        if request.abort_immediately:
            # §3.2 idx 19: no output, only the id in finished_requests.
            self.counters["aborted"] += 1
            self._batch(batches, client).finished.append(rid)
            return self._flush(batches)
        if self.shutting_down:
            # vLLM's _reject_add_in_shutdown: an ABORT output for the newcomer
            self._finish_now(batches, client, rid, FinishReason.ABORT)
            return self._flush(batches)
        if not request.has_sampling_params:
            self.throttle.warning("pooling request", "ADD {}: sampling_params is nil (pooling request); answered with ERROR", short(rid))
            self._finish_now(batches, client, rid, FinishReason.ERROR, protocol.request_error("unsupported", "the mock engine only generates"))
            return self._flush(batches)
        if self.reject_new_requests:
            self._finish_now(
                batches,
                client,
                rid,
                FinishReason.ERROR,
                protocol.request_error("engine_paused", "Generation is paused. Please retry after it resumes.", retryable=True),
            )
            return self._flush(batches)
        max_tokens = request.max_tokens or 0
        state = self.tokens.initial_state(rid, request.prompt_token_ids)
        entry = ActiveRequest(rid, client, max_tokens, state, request.prompt_len, self.clock())
        entry.pending_events = [protocol.engine_core_event(EngineCoreEventType.QUEUED, entry.queued_at)]
        if request.prompt_len > self.settings.max_model_len:
            reason = f"the prompt has {request.prompt_len} tokens, more than max_model_len {self.settings.max_model_len}"
            self.throttle.warning("invalid request", "ADD {}: {}; answered with ERROR", short(rid), reason)
            self._finish_now(batches, client, rid, FinishReason.ERROR, protocol.request_error("validation_error", reason))
            return self._flush(batches)
        try:
            self._plan_end(entry, request)
        except BadValue as exc:
            reason = f"{str(exc):.200}"
            self.throttle.warning("invalid request", "ADD {}: bad vllm_xargs ({}); answered with ERROR", short(rid), reason)
            self._finish_now(batches, client, rid, FinishReason.ERROR, protocol.request_error("validation_error", f"bad vllm_xargs: {reason}"))
            return self._flush(batches)
        self.counters["started"] += 1
        if self.settings.log_requests:
            self.log.info(
                "mock request started engine={} request_id={} prompt_len={} max_tokens={} chunk={}",
                self.rank,
                short(rid),
                request.prompt_len,
                max_tokens,
                self.chunk,
            )
        if max_tokens == 0:
            self._finish_now(batches, client, rid, FinishReason.LENGTH)
            return self._flush(batches)
        entry.priority = request.priority
        if self.prefix_cache is not None and request.prompt_token_ids:
            entry.block_hashes = block_hashes(request.prompt_token_ids, self.settings.block_size)
        self.waiting[rid] = entry
        if self.settings.scheduling_policy == "priority":
            heapq.heappush(self._priority_queue, (request.priority, next(self._arrivals), rid))
        return []

    def _plan_end(self, entry: ActiveRequest, request: EngineCoreRequest) -> None:
        """Decide how many tokens the request gets and how it ends (§3.3).

        Length: max_tokens, cut to max_model_len - prompt_len. Then, first
        match wins: `mock_fail_after` (vllm_xargs) ends with ERROR; an EOS
        length (`mock_output_len`, else the configured length model unless
        `ignore_eos`; never before `min_tokens`) ends with STOP and the EOS id
        as last token. `mock_finish` = stop | error | length changes how the
        request ends at its length; `mock_stop_token_id` makes a STOP end on
        that id, reported as stop_reason. Random tokens never hit a stop id;
        when the stop ids cover every id the engine could emit, the request
        stops on its first token (after min_tokens), as vLLM's would.

        A vllm_xargs value of the wrong type or out of range raises BadValue
        naming the key and the value: nothing is coerced.
        """
        xargs = request.extra_args
        for key in xargs:
            if isinstance(key, str) and key.startswith("mock_") and key not in MOCK_XARGS:
                raise BadValue(f"unknown key {short(key, 40)} (known: {', '.join(MOCK_XARGS)})")
        fail_after = _xarg_int(xargs, "mock_fail_after", 0, _INT64_MAX)
        natural = _xarg_int(xargs, "mock_output_len", 1, _INT64_MAX)
        stop_token = _xarg_int(xargs, "mock_stop_token_id", 0, TOKEN_ID_LIMIT - 1)
        mode = xargs.get("mock_finish")
        if mode is not None and (not isinstance(mode, str) or mode not in _MOCK_FINISH):
            raise BadValue(f"mock_finish must be stop, length or error, not {_cut(mode)}")
        ttft = xargs.get("mock_ttft_ms")
        if ttft is not None:
            if isinstance(ttft, bool) or not isinstance(ttft, (int, float)) or not 0 <= ttft <= MAX_XARGS_TTFT_MS:
                raise BadValue(f"mock_ttft_ms must be a number in 0..{MAX_XARGS_TTFT_MS}, not {_cut(ttft)}")  # also nan, inf
            entry.ttft_ms = float(ttft)
        limit = min(entry.max_tokens, max(0, self.settings.max_model_len - request.prompt_len))
        finish = FinishReason.LENGTH
        # EOS ends a request only if the frontend named an EOS id: vllm-rs
        # implements ignore_eos by sending none (Python sends ignore_eos).
        eos_possible = request.eos_token_id is not None and not request.ignore_eos
        stop_ids = set(request.all_stop_token_ids) | set(request.stop_token_ids)
        if request.eos_token_id is not None:
            stop_ids.add(request.eos_token_id)
        stoppers = set(request.stop_token_ids)
        if eos_possible:
            stoppers.update(request.all_stop_token_ids)
            stoppers.add(request.eos_token_id)
        # Stop ids covering every id the source can emit: a real engine stops
        # on its first token that may stop (vLLM's check_stop, after min_tokens).
        first_stop: Optional[int] = None
        if stoppers and self.tokens.only_emits(entry.rng_state, stoppers):
            first_stop = self.tokens.draw(entry.rng_state, 1)[0][0]
            at = max(request.min_tokens, 1)
            natural = at if natural is None else min(natural, at)
        if natural is None and self.settings.output_lengths is not None and eos_possible:
            seed = request_seed(self.settings.seed, self.rank, entry.request_id) ^ 0x9E3779B97F4A7C15
            natural = self.settings.output_lengths.draw(random.Random(seed))
        if fail_after is not None and fail_after < limit:
            limit, finish = fail_after, FinishReason.ERROR
        elif natural is not None and max(natural, request.min_tokens, 1) < limit + (first_stop is not None):
            # (a covering stop set stops even on the max_tokens-th token, as vLLM checks stops before length)
            limit, finish = max(natural, request.min_tokens, 1), FinishReason.STOP
        if mode is not None:
            finish = _MOCK_FINISH[mode]
        entry.max_tokens, entry.finish = limit, finish
        if finish is FinishReason.STOP:
            if stop_token is not None:
                entry.last_token = entry.stop_reason = stop_token
            elif first_stop is not None:
                entry.last_token = first_stop
                # vLLM reports a stop_token_ids hit as stop_reason, EOS as none
                entry.stop_reason = first_stop if first_stop in request.stop_token_ids and first_stop != request.eos_token_id else None
            else:
                entry.last_token = request.eos_token_id
        # nothing is left to avoid when every id stops
        entry.stop_ids = frozenset(stop_ids) if stop_ids and first_stop is None else None

    def _peek_waiting(self) -> ActiveRequest:
        """The waiting request to admit next (FCFS, or by priority)."""
        if self.settings.scheduling_policy != "priority":
            return self.waiting[next(iter(self.waiting))]
        while True:
            rid = self._priority_queue[0][2]
            if rid in self.waiting:
                return self.waiting[rid]
            heapq.heappop(self._priority_queue)  # aborted or already admitted

    def _pop_waiting(self, entry: ActiveRequest) -> None:
        del self.waiting[entry.request_id]
        if self.settings.scheduling_policy == "priority":
            heapq.heappop(self._priority_queue)

    def _admit(self, now: float, budget: Optional[int], batches: Dict[int, "_Batch"]) -> int:
        """Move waiting requests into the running batch while the batch limit,
        the token budget (`budget` left, None: unlimited) and the KV blocks
        allow; return the prompt tokens they prefill in this step."""
        prefill_tokens = 0
        latency = self.latency
        kv_blocks = self.settings.kv_blocks
        while self.waiting and self.can_admit and (budget is None or budget > 0):
            entry = self._peek_waiting()
            target = entry.prompt_len + entry.num_output_tokens  # recompute after a preemption
            if kv_blocks is not None:
                need = self._blocks_to_admit(entry)
                if self.used_blocks + need > kv_blocks:
                    if not self.active and need > kv_blocks:
                        self._reject_too_long(entry, batches)
                        continue
                    break  # waits for blocks to free up, as vLLM
                entry.blocks = need
                self.used_blocks += need
            self._pop_waiting(entry)
            entry.scheduled_at = now
            events = entry.pending_events or []
            events.append(protocol.engine_core_event(EngineCoreEventType.SCHEDULED, now))
            entry.pending_events = events
            self.active[entry.request_id] = entry
            self.kv_tokens += target
            if self.prefix_cache is not None:
                # cached prompt blocks are not computed again (KV is still held)
                entry.cached_tokens = self.prefix_cache.admit(entry.block_hashes, entry.prompt_len)
                target -= entry.cached_tokens
            take = target if budget is None else min(target, budget)
            prefill_tokens += take
            if budget is not None:
                budget -= take
            entry.prefill_left = target - take
            if entry.prefill_left:
                self.chunking[entry.request_id] = entry
            if entry.ttft_ms is not None:
                entry.ready_at = now + latency.first_token_seconds(entry.prompt_len, self._rng, entry.ttft_ms)
            elif latency.paced:
                entry.ready_at = now + latency.first_token_seconds(entry.prompt_len, self._rng)
            else:
                entry.ready_at = now
            if entry.prefill_left or entry.ready_at > now:
                self.prefilling[entry.request_id] = float("inf") if entry.prefill_left else entry.ready_at
        return prefill_tokens

    def _reject_too_long(self, entry: ActiveRequest, batches: Dict[int, "_Batch"]) -> None:
        """A request whose KV can never fit: ERROR now, not a queue that never moves."""
        self._pop_waiting(entry)
        self._finish_now(
            batches,
            entry.client_index,
            entry.request_id,
            FinishReason.ERROR,
            protocol.request_error("kv_cache_too_small", f"needs more than the engine's {self.settings.kv_blocks} KV blocks"),
        )

    def _continue_prefills(self, now: float, budget: int) -> Tuple[int, int]:
        """Chunked prefill of running requests (admission order) within
        `budget`; return (tokens prefilled, budget left)."""
        prefilled = 0
        for entry in list(self.chunking.values()):
            if budget <= 0:
                break
            take = min(entry.prefill_left, budget)
            entry.prefill_left -= take
            budget -= take
            prefilled += take
            if not entry.prefill_left:
                del self.chunking[entry.request_id]
                if entry.ready_at > now:
                    self.prefilling[entry.request_id] = entry.ready_at
                else:
                    del self.prefilling[entry.request_id]
        return prefilled, budget

    def _reserve_decode_blocks(self, now: float) -> bool:
        """KV for the running requests' tokens of this step, before anything
        is admitted (vLLM schedules running requests first): a request
        crossing a block boundary needs a new block; when they run out, the
        newest running request is preempted (vLLM's recompute preemption)
        until the rest fit. True when something was preempted: then nothing
        is admitted in this step, as in vLLM."""
        kv_blocks, prefilling = self.settings.kv_blocks, self.prefilling
        preempted = False
        while True:
            needs = []
            total = 0
            for entry in self.active.values():
                if entry.request_id in prefilling:
                    continue  # its next token's block came with its admission
                need = self._blocks_for(entry.prompt_len + entry.num_output_tokens + self._next_tokens(entry)) - entry.blocks
                if need > 0:
                    needs.append((entry, need))
                    total += need
            if self.used_blocks + total <= kv_blocks or not self.active:
                break
            self._preempt(next(reversed(self.active.values())), now)
            preempted = True
        for entry, need in needs:
            entry.blocks += need
            self.used_blocks += need
        return preempted

    def _preempt(self, entry: ActiveRequest, now: float) -> None:
        """Back to the front of the queue; its KV is freed and recomputed later."""
        del self.active[entry.request_id]
        self._release(entry)
        # Events not sent yet (QUEUED, SCHEDULED of a request preempted before
        # its first token) stay: they all ride on its next output, as in vLLM.
        entry.pending_events = (entry.pending_events or []) + [protocol.engine_core_event(EngineCoreEventType.PREEMPTED, now)]
        self.waiting = {entry.request_id: entry, **self.waiting}
        if self.settings.scheduling_policy == "priority":
            heapq.heappush(self._priority_queue, (entry.priority, -next(self._arrivals), entry.request_id))
        self.counters["preemptions"] += 1
        if self.settings.log_requests:
            self.log.info("mock request preempted engine={} request_id={}", self.rank, short(entry.request_id))

    def _release(self, entry: ActiveRequest) -> None:
        """Account for a running request that left `active` (its KV is freed)."""
        self.kv_tokens -= entry.prompt_len + entry.num_output_tokens
        self.prefilling.pop(entry.request_id, None)
        self.chunking.pop(entry.request_id, None)
        self.used_blocks -= entry.blocks
        entry.blocks = 0

    def abort_requests(self, request_ids: List[str]) -> List[Outbound]:
        """ABORT (§3.4): end the listed active ids; unknown ids are ignored."""
        batches: Dict[int, _Batch] = {}
        for rid in request_ids:
            entry = self.active.pop(rid, None)
            if entry is not None:
                self._release(entry)
            else:
                entry = self.waiting.pop(rid, None)
                if entry is None:
                    continue
            self._end(batches, entry, FinishReason.ABORT)
        out = self._flush(batches)
        self._check_drained(out)
        return out

    def abort_all(self) -> List[Outbound]:
        """End every in-flight request with an explicit ABORT output (§3.4:
        pause/sleep in mode abort; the frontend does not end those streams)."""
        return self.abort_requests(list(self.active) + list(self.waiting))

    # -- the decode step -------------------------------------------------

    def step(self) -> List[Outbound]:
        """Advance every running request once (§9.3).

        Each request gets min(chunk, remaining) tokens; one that reaches
        max_tokens ends with LENGTH and its id goes into that message's
        finished_requests. One EngineCoreOutputs per client.
        """
        if not self.has_work:
            return []
        now = self.clock()
        budget = self.settings.max_num_batched_tokens
        prefill_tokens = 0
        # Running requests first (vLLM's scheduler): their KV for this step,
        # then their token budget, then chunked prefills go on; admission
        # last, and not at all in a step that had to preempt.
        preempted = self.settings.kv_blocks is not None and bool(self.active) and self._reserve_decode_blocks(now)
        if budget is not None:
            budget -= (len(self.active) - len(self.prefilling)) * self.chunk
            if self.chunking:
                prefill_tokens, budget = self._continue_prefills(now, budget)
        batches: Dict[int, _Batch] = {}
        if not preempted:
            prefill_tokens += self._admit(now, budget, batches)
        chunk = self.chunk
        draw = self.tokens.draw
        make_output = protocol.engine_core_output
        prefilling = self.prefilling
        done: List[ActiveRequest] = []
        emitted = 0
        for entry in self.active.values():
            if prefilling:
                ready_at = prefilling.get(entry.request_id)
                if ready_at is not None:
                    if ready_at > now:
                        continue  # prefill not done (inf: chunks left): no token this step
                    del prefilling[entry.request_id]
            batch = batches.get(entry.client_index)
            if batch is None:
                batch = batches[entry.client_index] = _Batch()
            remaining = entry.max_tokens - entry.num_output_tokens
            n = chunk if chunk < remaining else remaining
            tokens, entry.rng_state = draw(entry.rng_state, n)
            if entry.stop_ids is not None and not entry.stop_ids.isdisjoint(tokens):
                tokens = self.tokens.avoid(tokens, entry.stop_ids)
            first = entry.num_output_tokens == 0
            events = entry.pending_events
            entry.num_output_tokens += n
            emitted += n
            finish = None
            if n == remaining:
                finish = entry.finish
                if entry.last_token is not None and tokens:
                    tokens[-1] = entry.last_token
            if events is not None or (finish is not None and finish is not FinishReason.LENGTH):
                # §4.5: queue/prefill time and prompt tokens for the frontend's
                # metrics; a STOP or ERROR end says why (stop_reason, error).
                output = make_output(
                    entry.request_id,
                    tokens,
                    finish,
                    error=protocol.request_error("mock_failure", MOCK_FAILURE_MESSAGE) if finish is FinishReason.ERROR else None,
                    stop_reason=entry.stop_reason if finish is FinishReason.STOP else None,
                    layout=self.layout,
                    events=events,
                    prefill_stats=protocol.prefill_stats(entry.prompt_len, entry.cached_tokens) if first else None,
                )
                entry.pending_events = None
            elif finish is None:
                # protocol.engine_core_output's running shape, built inline on
                # the per-token path (test_engine checks they are the same)
                output = [entry.request_id, tokens]
            else:
                output = make_output(entry.request_id, tokens, finish)
            batch.outputs.append(output)
            if finish is not None:
                batch.finished.append(entry.request_id)
                done.append(entry)
        self.counters["steps"] += 1
        self.counters["tokens"] += emitted
        if self.latency.paced:
            self.step_delay = self.latency.step_seconds(len(self.active), prefill_tokens, self._rng)
        self.kv_tokens += emitted
        for entry in done:
            del self.active[entry.request_id]
            self._release(entry)
            self._count_finish(entry, entry.finish)
        out = self._flush(batches)
        self._check_drained(out)
        return out

    # -- utility calls (§3.5, §5) ----------------------------------------

    def call_utility(self, call: UtilityCall) -> List[Outbound]:
        """Answer a UTILITY exactly once on outputs[client_index] (§3.5),
        except pause mode "wait", answered when the engine has drained."""
        if not self._valid_client(call.client_index, f"UTILITY {call.method} (call id {call.call_id})"):
            return []
        self.counters["utility_calls"] += 1
        handler = _UTILITIES.get(call.method)
        if handler is None:
            self.throttle.warning("unknown utility", "UTILITY {}: unsupported method; answered with a failure", short(call.method, 60))
            return [self._reply(call, failure=f"unsupported method {_cut(call.method)} (gmock_engine)")]
        self.log.opt(lazy=True).debug("UTILITY {} args={} call_id={}", lambda: call.method, lambda: _cut(call.args, 200), lambda: call.call_id)
        try:
            return handler(self, call)
        except _UtilityFailure as exc:
            self.throttle.warning("utility failure", "UTILITY {}: {}", call.method, exc)
            return [self._reply(call, failure=str(exc))]
        except (TypeError, ValueError, AttributeError, IndexError, KeyError, OverflowError) as exc:
            # arguments of a shape the handler did not expect: that call fails, nothing else
            self.throttle.warning("utility failure", "UTILITY {}: bad arguments {} ({})", call.method, _cut(call.args), exc)
            return [self._reply(call, failure=f"{call.method}: bad arguments {_cut(call.args)}: {type(exc).__name__}: {str(exc):.200}")]

    def fail_utility(self, call: UtilityCall, failure: str) -> List[Outbound]:
        """Answer a utility call with `failure_message` without running it
        (--fault-fail-utility)."""
        if not self._valid_client(call.client_index, f"UTILITY {call.method} (call id {call.call_id})"):
            return []
        self.counters["utility_calls"] += 1
        return [self._reply(call, failure=failure)]

    def _reply(self, call: UtilityCall, result: Any = None, failure: Optional[str] = None) -> Outbound:
        return (call.client_index, protocol.utility_reply(self.rank, call.call_id, self.clock(), result, failure))

    def _pause(self, call: UtilityCall, mode: Any, reject_new: Optional[bool]) -> List[Outbound]:
        """vLLM's pause_scheduler (0.32/0.33 core.py): abort ends every
        request; wait keeps stepping and answers when drained; keep freezes."""
        if mode not in PAUSE_MODES:
            raise _UtilityFailure(f"Invalid pause mode: {_cut(mode)}")
        out = self.abort_all() if mode == "abort" else []
        self.pause_state = PauseState.PAUSED_ALL if mode == "keep" else PauseState.PAUSED_NEW
        if reject_new is not None:
            self.reject_new_requests = reject_new
        if mode == "wait" and self.active:
            self._replies_when_drained.append((call.client_index, call.call_id))
            return out
        out.append(self._reply(call))
        return out

    def resume(self) -> None:
        """resume_scheduler: waiting requests are admitted again."""
        self.pause_state = PauseState.UNPAUSED
        self.reject_new_requests = False

    def _check_drained(self, out: List[Outbound]) -> None:
        if self._replies_when_drained and not self.active:
            for client, call_id in self._replies_when_drained:
                out.append((client, protocol.utility_reply(self.rank, call_id, self.clock())))
            self._replies_when_drained.clear()

    # -- helpers -----------------------------------------------------------

    @staticmethod
    def _batch(batches: Dict[int, _Batch], client: int) -> _Batch:
        batch = batches.get(client)
        if batch is None:
            batch = batches[client] = _Batch()
        return batch

    def _finish_now(
        self,
        batches: Dict[int, _Batch],
        client: int,
        rid: str,
        reason: FinishReason,
        error: Optional[Dict[str, Any]] = None,
    ) -> None:
        """A terminal output with no tokens for a request that never ran."""
        batch = self._batch(batches, client)
        batch.outputs.append(protocol.engine_core_output(rid, [], reason, error, self.layout))
        batch.finished.append(rid)
        self.counters["finished_" + reason.name.lower()] += 1
        if self.settings.log_requests:
            self.log.info(
                "mock request finished engine={} request_id={} output_tokens=0 finish_reason={}", self.rank, short(rid), reason.name.lower()
            )

    def _end(self, batches: Dict[int, _Batch], entry: ActiveRequest, reason: FinishReason) -> None:
        """A terminal output for a request that was active (already removed)."""
        batch = self._batch(batches, entry.client_index)
        batch.outputs.append(protocol.engine_core_output(entry.request_id, [], reason, None, self.layout))
        batch.finished.append(entry.request_id)
        self._count_finish(entry, reason)

    def _count_finish(self, entry: ActiveRequest, reason: FinishReason) -> None:
        if reason is FinishReason.ABORT:
            self.counters["aborted"] += 1
            if self.settings.log_requests:
                self.log.info(
                    "mock request aborted engine={} request_id={} output_tokens={}", self.rank, short(entry.request_id), entry.num_output_tokens
                )
            return
        self.counters["finished_" + reason.name.lower()] += 1
        if self.settings.log_requests:
            self.log.info(
                "mock request finished engine={} request_id={} output_tokens={} finish_reason={}",
                self.rank,
                short(entry.request_id),
                entry.num_output_tokens,
                reason.name.lower(),
            )

    def _flush(self, batches: Dict[int, _Batch]) -> List[Outbound]:
        """One EngineCoreOutputs per client; SchedulerStats on the first one
        when due (§4.1, §7.3), and then also to the coordinator (§6.2).
        Every message passes the ledger on its way out."""
        now = self.clock()
        stats = self._stats_if_due(now) if batches else None
        out: List[Outbound] = []
        for client, batch in batches.items():
            message = protocol.engine_core_outputs(self.rank, batch.outputs, now, batch.finished or None, stats)
            violations = self.ledger.sent(message)
            if violations:
                self._report(violations)
            out.append((client, message))
            stats = None
        if out and out[0][1][2] is not None and self.settings.has_coordinator:
            out.append((COORDINATOR, protocol.engine_core_outputs(self.rank, [], now, None, out[0][1][2])))
        return out

    def _report(self, violations: List[str]) -> None:
        for violation in violations[:5]:
            self.log.error("ledger violation engine={}: {}", self.rank, violation)
        if self.settings.strict_ledger:
            raise LedgerViolation(violations[0])

    def _stats_if_due(self, now: float) -> Optional[Dict[str, Any]]:
        """SchedulerStats when something the frontend shows has moved: the
        running/waiting counts, the KV usage (it grows with every token of a
        long request) or the prefix-cache counters; while requests run, at
        most every STATS_INTERVAL_S."""
        counts = (len(self.active), len(self.waiting))
        if counts[0] and now - self._stats_at < STATS_INTERVAL_S:
            return None
        usage = self.kv_cache_usage
        changed = (
            counts != self._stats_counts
            or usage != self._stats_kv_usage
            or (self.prefix_cache is not None and self.prefix_cache.pending)
        )
        if not changed:
            return None
        self._stats_counts, self._stats_kv_usage, self._stats_at = counts, usage, now
        return self.scheduler_stats(self.prefix_cache.take_stats() if self.prefix_cache is not None else None)

    @property
    def kv_cache_usage(self) -> float:
        """Blocks used / blocks when KV is enforced, else the running
        requests' tokens / capacity."""
        if self.settings.kv_blocks:
            return self.used_blocks / self.settings.kv_blocks
        return min(1.0, self.kv_tokens / self._kv_capacity)

    def scheduler_stats(self, prefix_cache_stats: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
        """The engine's SchedulerStats now. KV usage is blocks used / blocks
        when KV is enforced, else the running requests' tokens / capacity."""
        return protocol.scheduler_stats(
            prefix_cache_stats=prefix_cache_stats,
            num_running_reqs=len(self.active),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=self.kv_cache_usage,
            step_counter=self.counters["steps"],
        )


_MOCK_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "error": FinishReason.ERROR}


def _cut(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _xarg_int(xargs: Dict[str, Any], key: str, low: int, high: int) -> Optional[int]:
    """vllm_xargs[key] as an int in low..high (None when absent or null);
    BadValue for anything else: a float, a string, a bool, a huge number."""
    value = xargs.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise BadValue(f"{key} must be an int in {low}..{high}, not {_cut(value)}")
    return value


class LedgerViolation(RuntimeError):
    """An engine sent something a frontend must never see (--strict-ledger)."""


class _UtilityFailure(Exception):
    """A utility call the engine answers with `failure_message`."""


def _arg(call: UtilityCall, index: int, default: Any) -> Any:
    return call.args[index] if len(call.args) > index else default


def _u_value(value: Any) -> Callable[[EngineCore, UtilityCall], List[Outbound]]:
    return lambda engine, call: [engine._reply(call, value)]


def _u_supported_tasks(engine: EngineCore, call: UtilityCall) -> List[Outbound]:
    return [engine._reply(call, list(engine.settings.supported_tasks))]


def _u_is_sleeping(engine: EngineCore, call: UtilityCall) -> List[Outbound]:
    # vLLM 0.33: is_sleeping = scheduler paused or executor asleep.
    return [engine._reply(call, engine.sleep_level > 0 or engine.pause_state is not PauseState.UNPAUSED)]


def _u_is_paused(engine: EngineCore, call: UtilityCall) -> List[Outbound]:
    return [engine._reply(call, engine.pause_state is not PauseState.UNPAUSED)]


def _u_sleep(engine: EngineCore, call: UtilityCall) -> List[Outbound]:
    # [level, mode]; older frontends send only level (§5). Sleep pauses first.
    level = _arg(call, 0, 1)
    if not isinstance(level, int) or isinstance(level, bool) or level < 0:
        raise _UtilityFailure(f"Invalid sleep level: {_cut(level)}")
    out = engine._pause(call, _arg(call, 1, "abort"), reject_new=None)
    engine.sleep_level = level
    return out


def _u_wake_up(engine: EngineCore, call: UtilityCall) -> List[Outbound]:
    # A mock holds no memory: any wake_up wakes fully, which also resumes.
    engine.sleep_level = 0
    engine.resume()
    return [engine._reply(call, True)]


def _u_pause_generation(engine: EngineCore, call: UtilityCall) -> List[Outbound]:
    mode = _arg(call, 0, "abort")
    return engine._pause(call, mode, reject_new=mode != "keep")


def _u_pause_scheduler(engine: EngineCore, call: UtilityCall) -> List[Outbound]:
    return engine._pause(call, _arg(call, 0, "abort"), reject_new=None)


def _u_resume_scheduler(engine: EngineCore, call: UtilityCall) -> List[Outbound]:
    engine.resume()
    return [engine._reply(call)]


def _u_reset_prefix_cache(engine: EngineCore, call: UtilityCall) -> List[Outbound]:
    if engine.prefix_cache is not None:
        engine.prefix_cache.reset()
    return [engine._reply(call, True)]


def _u_get_weight_version(engine: EngineCore, call: UtilityCall) -> List[Outbound]:
    return [engine._reply(call, engine.weight_version)]


def _u_set_weight_version(engine: EngineCore, call: UtilityCall) -> List[Outbound]:
    version = _arg(call, 0, None)
    if version is not None and not isinstance(version, str):
        raise _UtilityFailure(f"weight version must be a string, got {type(version).__name__}")
    engine.weight_version = version
    return [engine._reply(call)]


def _u_gmock_stats(engine: EngineCore, call: UtilityCall) -> List[Outbound]:
    """gmock_engine's own method (not vLLM's): counters and runtime figures,
    for the bench driver and for ad-hoc inspection by a test harness."""
    stats: Dict[str, Any] = {
        "rank": engine.rank,
        "active": len(engine.active),
        "waiting": len(engine.waiting),
        "counters": dict(engine.counters),
        "ledger": engine.ledger.summary(),
    }
    stats.update(engine.stats_provider())
    return [engine._reply(call, stats)]


def _u_add_lora(engine: EngineCore, call: UtilityCall) -> List[Outbound]:
    raise _UtilityFailure("LoRA is not supported by gmock_engine (supports_lora is false)")


#: Utility methods and their answers (PROTOCOL.md §5, "recommended mock answer").
_UTILITIES: Dict[str, Callable[[EngineCore, UtilityCall], List[Outbound]]] = {
    "get_supported_tasks": _u_supported_tasks,
    "is_sleeping": _u_is_sleeping,
    "is_scheduler_paused": _u_is_paused,
    "sleep": _u_sleep,
    "wake_up": _u_wake_up,
    "pause_generation": _u_pause_generation,
    "pause_scheduler": _u_pause_scheduler,
    "resume_scheduler": _u_resume_scheduler,
    "reset_prefix_cache": _u_reset_prefix_cache,
    "reset_mm_cache": _u_value(None),
    "reset_encoder_cache": _u_value(None),
    "profile": _u_value(None),
    "execute_dummy_batch": _u_value(None),
    "get_weight_version": _u_get_weight_version,
    "set_weight_version": _u_set_weight_version,
    "list_loras": _u_value([]),
    "gmock_stats": _u_gmock_stats,
    "add_lora": _u_add_lora,
    "remove_lora": _u_add_lora,
    "pin_lora": _u_add_lora,
    "collective_rpc": _u_value([]),
    "compute_weight_checksums": _u_value([]),
    "release_kv_cache_memory": _u_value(None),
    "save_sharded_state": _u_value(None),
}

SUPPORTED_UTILITIES = tuple(sorted(_UTILITIES))
