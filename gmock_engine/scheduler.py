"""The scheduler: what one step does, pure (vLLM: `vllm/v1/core/sched/scheduler.py`).

A step, in vLLM's order: the running requests first (their KV blocks for
this step's tokens, preempting the newest when they do not fit, and their
share of the token budget), then chunked prefills go on, then waiting
requests are admitted (the batch limit, the token budget and the KV blocks
allowing, and not at all in a step that had to preempt), then every running
request whose prefill is done emits its next tokens into the outbox. The
waiting requests are what the frontends show as `num_requests_waiting`.

Timing is the latency model's (latency.py): the step asks its successor to
wait `step_delay`, and a request's first token comes at its `ready_at`.

A reload (SIGHUP, reload.py) reaches the scheduler between steps, through
`reconfigure`: the latency model and the limits apply from the next step;
a request draws its tokens and logprobs from the `Sampler` of its ADD, so a
new token source or logprob setting is for the requests that come after.
"""

from __future__ import annotations

import enum
import random
import sys
from collections import Counter
from typing import Any, Callable, Dict, List, Optional

import msgpack

from .kv_cache_manager import KVCacheManager
from .kv_transfer import KV_LOAD_FAILURE_MESSAGE, KVTransfer
from .latency import LatencyModel
from .logprobs import ROW_POOL_MAX_K, LogprobModel
from .lora import AdapterRegistry, LoRAError
from .outbox import Outbox
from .request import Request
from .request_queue import create_request_queue
from .tokens import POOL_PAD, TokenPool, TokenSource
from .wire.eras import Wire
from .wire.outputs import RAW_VIEW_EXT, engine_core_event, engine_core_output, logprobs_lists, prefill_stats, request_error, scheduler_stats
from .wire.types import EngineCoreEventType, FinishReason

#: Stop sets whose lanes draw from a stop-free copy of the pool
#: (tokens.TokenPool.ids_avoiding), per scheduler; requests with any other
#: stop set take a lane whose loop checks every token.
LANE_POOLS = 4
#: A stop set gets its copy when the second request with it joins a lane
#: (a set seen once, such as a client's one-off stop_token_ids, is not worth
#: ~1 ms); this many sets are counted at most.
STOP_SETS_COUNTED = 1024

#: The error of a request ended by mock_fail_after (vllm_xargs, or --fault-error-mid-stream).
MOCK_FAILURE_MESSAGE = "mock failure on request (vllm_xargs mock_fail_after or --fault-error-mid-stream)"


class PauseState(enum.Enum):
    """As in vLLM's scheduler: PAUSED_NEW holds new requests but keeps
    stepping the running ones; PAUSED_ALL steps nothing."""

    UNPAUSED = "unpaused"
    PAUSED_NEW = "paused_new"
    PAUSED_ALL = "paused_all"


# Enum members read on the per-step and per-request paths, bound once: on
# CPython 3.11 `PauseState.PAUSED_ALL` is a ~0.1 µs lookup through the enum
# metaclass, a module global ~15 ns (issue 17).
_UNPAUSED, _PAUSED_ALL = PauseState.UNPAUSED, PauseState.PAUSED_ALL
_LENGTH, _STOP, _ERROR = FinishReason.LENGTH, FinishReason.STOP, FinishReason.ERROR
_SCHEDULED = EngineCoreEventType.SCHEDULED


def _next_pooled(requests: Any, pool: List[int], size: int, chunk: int, append: Callable[[Any], None]) -> None:
    """Each lane member's next `chunk` ids out of the pool (tokens.TokenPool.draw,
    inline: the member's position in the pool is its rng_state), swapped into
    its own reused `[id, tokens]` output, which goes to `append`: the per-token
    work of a steady request and nothing else, the floor's loop
    (reference_emitter.py). Shared by `Scheduler._emit_lanes` and
    `Scheduler.steady_step`."""
    if chunk == 1:
        # the one-id token list written in place (the output list is made
        # when the request joins its lane)
        for request in requests:
            position = request.rng_state
            out = request.lane_output
            out[1][0] = pool[position]
            position += 1
            request.rng_state = position if position < size else 0
            request.num_output_tokens += 1
            append(out)
    else:
        # the next slice of the pool (padded by POOL_PAD: a chunk that fits
        # never wraps inside the slice)
        for request in requests:
            position = request.rng_state
            end = position + chunk
            out = request.lane_output
            out[1] = pool[position:end]
            request.rng_state = end if end < size else end % size
            request.num_output_tokens += chunk
            append(out)


def _next_pooled_rows(requests: Any, pool: List[int], size: int, chunk: int, append: Callable[[Any], None], rows: Any) -> None:
    """`_next_pooled` for lane members with logprobs: the same slices of the
    pool, and of `rows` (the pool's logprobs.RowPool at their k) the rows of
    those positions, swapped into the member's reused LogprobsLists: the
    floor's loop for such requests (reference_emitter.py)."""
    stride, row_ids, row_lps, row_ranks = rows.stride, rows.row_ids, rows.row_lps, rows.row_ranks
    new, ext = tuple.__new__, msgpack.ExtType
    for request in requests:
        position = request.rng_state
        end = position + chunk
        out = request.lane_output
        out[1] = pool[position:end]
        arrays = out[2]
        arrays[0][2] = new(ext, (RAW_VIEW_EXT, row_ids[position * stride : end * stride]))
        arrays[1][2] = new(ext, (RAW_VIEW_EXT, row_lps[position * stride : end * stride]))
        arrays[2][2] = new(ext, (RAW_VIEW_EXT, row_ranks[position * 8 : end * 8]))
        request.rng_state = end if end < size else end % size
        request.num_output_tokens += chunk
        append(out)


class Sampler:
    """Where a request's tokens and logprobs come from: the token source
    (tokens.py) and the logprob model (logprobs.py) of its ADD. A request
    keeps its sampler to its end: its generator state belongs to that
    source, so a reload that changes --token-source or the logprob settings
    changes them for new requests only (vLLM's sampler is one per engine;
    here a request's tokens stay deterministic per its arrival settings)."""

    __slots__ = ("tokens", "logprobs")

    def __init__(self, tokens: TokenSource, logprobs: LogprobModel) -> None:
        self.tokens = tokens
        self.logprobs = logprobs


class Scheduler:
    """The running batch, the waiting queue, and the step."""

    def __init__(
        self,
        kv: KVCacheManager,
        tokens: TokenSource,
        latency: LatencyModel,
        rng: random.Random,
        wire: Wire,
        chunk: int,
        max_num_seqs: Optional[int],
        max_num_batched_tokens: Optional[int],
        policy: str,
        on_preempt: Callable[[Request], None] = lambda request: None,
        on_reject: Callable[[Request], None] = lambda request: None,
        logprob_model: Optional[LogprobModel] = None,
        lora: Optional[AdapterRegistry] = None,
        kv_transfer: Optional[KVTransfer] = None,
    ) -> None:
        self.kv = kv
        #: The adapter registry (None: LoRA not enabled); the scheduler keeps
        #: at most `lora.max_loras` distinct adapters in the running batch.
        self.lora = lora
        #: P/D disaggregation (kv_transfer.py); None: off.
        self.kv_transfer = kv_transfer
        #: Consumer requests waiting for their KV (vLLM's WAITING_FOR_REMOTE_KVS):
        #: in the running batch here, but counted as waiting, as vLLM's kv_holding_waiting.
        self.transferring: set = set()
        #: The sampler of new requests (running ones keep their own: Sampler).
        self.sampler = Sampler(tokens, logprob_model or LogprobModel())
        self.latency = latency
        self._rng = rng
        self.wire = wire
        self.chunk = chunk
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        #: The running batch, in admission order (the newest is preempted first).
        self.running: Dict[str, Request] = {}
        #: Running requests on the full path of `_emit` (the others are in a lane).
        self._full: Dict[str, Request] = {}
        #: (client, stops, k) -> the steady requests of that lane (`_emit`);
        #: stops: False (no stop ids), a stop set (its lane slices the stop-free
        #: pool `_lane_pools` holds for it) or True (the loop checks each token);
        #: k: the logprobs its members ask (their rows from the RowPool of the
        #: pool the lane slices), None for none.
        self.lanes: Dict[Any, Dict[str, Request]] = {}
        #: stop set -> the stop-free copy of the pool its lanes slice (`_stop_lane`)
        self._lane_pools: Dict[frozenset, List[int]] = {}
        #: (stops, k) -> the logprobs.RowPool the lanes of that kind read their
        #: members' rows from (held here: the rows `_join_lanes` drew stay
        #: theirs whatever the process's RowPool cache drops)
        self._lane_rows: Dict[Any, Any] = {}
        self._stop_sets_seen: Dict[frozenset, int] = {}
        #: `_emit` call -> the lane members that go back to the full path then.
        self._lane_exits: Dict[int, List[Request]] = {}
        self._emitted_steps = 0
        #: (client, lane, pool) when there is one lane, it slices a pool and
        #: the engine's settings let a step skip the rest: what
        #: `steady_step` steps (kept by `_lanes_changed`), else None
        self._solo: Optional[tuple] = None
        #: Lane members' outputs reuse one `[id, tokens]` list each (issue 17:
        #: at 8 192 running, making and freeing two lists per token cost more
        #: than the rest of the step's work). Only for a caller that encodes
        #: every message before the next step (EngineSettings.reuse_outputs).
        self.reuse_outputs = False
        #: (pooled, pool ids, pool size) of the sampler's source, for the lanes
        self._lane_source = self._pool_of(self.sampler)
        self.waiting = create_request_queue(policy)
        #: Running requests whose prefill is not done: id -> ready_at (inf: chunks left).
        self.prefilling: Dict[str, float] = {}
        #: Running requests with prompt tokens still to prefill (token budget).
        self.chunking: Dict[str, Request] = {}
        self.pause_state = PauseState.UNPAUSED
        #: Engine time the last step asked its successor to wait (latency model).
        self.step_delay = 0.0
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
    def logprob_model(self) -> LogprobModel:
        """The logprob model of new requests."""
        return self.sampler.logprobs

    def reconfigure(
        self,
        latency: LatencyModel,
        sampler: Sampler,
        max_num_seqs: Optional[int],
        max_num_batched_tokens: Optional[int],
    ) -> None:
        """New settings from a reload, between two steps (never within one).

        The latency model times the next step at once (the delay the last
        step asked for is recomputed with it); requests already waiting for
        their first token keep the time they were given. A lower
        --max-num-seqs admits nothing until the batch is below it (nobody is
        preempted); a lifted token budget lets the chunked prefills finish
        in the next step."""
        if latency != self.latency:
            self.latency = latency
            self.step_delay = latency.step_seconds(len(self.running), 0, self._rng) if latency.paced else 0.0
        if sampler is not self.sampler:
            # a lane draws from the current sampler: its members, from the
            # old one, go on on the full path (each with its own sampler)
            for lane in list(self.lanes.values()):
                for request in list(lane.values()):
                    self._out_of_lane(request)
                    self._full[request.request_id] = request
        if sampler is not self.sampler:
            self._lane_pools, self._stop_sets_seen = {}, {}  # copies of the old source's pool
            self._lane_rows = {}  # and their rows
        self.sampler = sampler
        self._lane_source = self._pool_of(sampler)
        self._lanes_changed()
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
        if (
            self.prefilling
            and not self.chunking  # chunked prefills progress every step
            and len(self.prefilling) == len(self.running)
            and not self._head_admissible()
        ):
            due = max(due, min(self.prefilling.values()))
        return due

    def _next_tokens(self, request: Request) -> int:
        """Tokens the request emits in its next decode step."""
        remaining = request.max_tokens - request.num_output_tokens
        return self.chunk if self.chunk < remaining else remaining

    def _head_admissible(self) -> bool:
        """The next waiting request could join the batch now (limit, pause, KV)."""
        if not (self.waiting and self.can_admit):
            return False
        head = self.waiting.peek_request()
        return self.kv.fits(self.kv.blocks_to_admit(head, self._next_tokens(head)))

    # -- requests in and out ---------------------------------------------------

    def add_request(self, request: Request) -> None:
        """A new request waits for admission."""
        self.waiting.add_request(request)

    def remove(self, request_id: str) -> Optional[Request]:
        """Take a running or waiting request out (ABORT); its KV is freed."""
        request = self.running.pop(request_id, None)
        if request is not None:
            self._release(request)
            return request
        return self.waiting.remove_request(request_id)

    def remove_all(self) -> List[Request]:
        """Every running and waiting request, taken out (running first)."""
        out = [*self.running.values(), *self.waiting.requests()]
        self.kv.free_all(list(self.running.values()))
        for request in self.running.values():
            request.lane = request.lane_output = None
        self.running.clear()
        self._full.clear()
        self.lanes.clear()
        self._lane_exits.clear()
        self.waiting.clear()
        self.prefilling.clear()
        self.chunking.clear()
        self.transferring.clear()
        return out

    def _release(self, request: Request) -> None:
        """Account for a running request that left `running` (its KV is freed)."""
        if request.lane is not None:
            self._out_of_lane(request)
        else:
            self._full.pop(request.request_id, None)
        self.kv.free(request)
        self.prefilling.pop(request.request_id, None)
        self.chunking.pop(request.request_id, None)
        self.transferring.discard(request.request_id)

    # -- the step ----------------------------------------------------------------

    def step(self, now: float, outbox: Outbox) -> List[Request]:
        """Advance every running request once (§9.3); return those that ended.

        Each request gets min(chunk, remaining) tokens; one that reaches its
        planned length ends as planned (request.plan) and its id goes into
        that message's finished_requests.
        """
        budget = self.max_num_batched_tokens
        prefill_tokens = 0
        preempted = self.kv.enforced and bool(self.running) and self._reserve_decode_blocks(now)
        if budget is not None:
            budget -= (len(self.running) - len(self.prefilling)) * self.chunk
            if self.chunking:
                prefill_tokens, budget = self._continue_prefills(now, budget)
        elif self.chunking:  # a reload lifted the budget: what was chunked is prefilled now
            prefill_tokens, _ = self._continue_prefills(now, sys.maxsize)
        if not preempted and self.waiting:
            prefill_tokens += self._admit(now, budget, outbox)
        done = self._emit(now, outbox)
        if self.latency.paced:
            self.step_delay = self.latency.step_seconds(len(self.running), prefill_tokens, self._rng)
        for request in done:
            del self.running[request.request_id]
            self._release(request)
        return done

    def steady_step(self) -> "Optional[tuple[int, List[Any]]]":
        """The step, when it is a steady one: (client, outputs) of its one
        message; None when it is not (the caller then takes `step`).

        Steady: nothing waiting, every running request in one lane of one
        client that slices the token pool (so none on the full path: no
        first or last output, no prefill, no shaped request), none leaving
        it at this step, and nothing else a step has to do per request (no
        KV blocks enforced, no prefix caching; outputs reused). Such a step
        is what `step` would make then, without its per-step branches for
        admission, preemption, budgets, the full path and lane exits: behind
        a real frontend most steps are of a few requests, and their fixed
        cost is what the mock spends (issue 17, P2). A property test runs
        scenarios with and without this path and compares the bytes."""
        solo = self._solo
        if (
            solo is None
            or self._full  # (prefilling and chunking requests are on the full path)
            or self.waiting
            or self.pause_state is _PAUSED_ALL
        ):
            return None
        step = self._emitted_steps + 1
        if step in self._lane_exits:
            return None
        self._emitted_steps = step
        client, lane, pool = solo
        outputs: List[Any] = []
        chunk = self.chunk
        _next_pooled(lane.values(), pool, self._lane_source[2], chunk, outputs.append)
        emitted = chunk * len(lane)
        counters = self.counters
        counters["steps"] += 1
        counters["tokens"] += emitted
        self.kv.tokens += emitted
        if self.latency.paced:
            self.step_delay = self.latency.step_seconds(len(self.running), 0, self._rng)
        return client, outputs

    def _emit(self, now: float, outbox: Outbox) -> List[Request]:
        """The per-token path: each ready running request's next tokens.

        A request in its steady state (past its first output, nothing
        pending, no sampling controls or logprobs, drawing from the current
        sampler) sits in a lane (`lanes`, per client) until its last output:
        a lane is one tight loop per step (its next ids out of the token
        pool, one `[id, tokens]` output each: the request's own list, reused
        from step to step with `reuse_outputs`), and when a request joins
        one, the step it leaves it in is fixed (`_lane_exits`), so the loop
        checks nothing per request (issue 17: the steady state pays for
        nothing but its tokens). Everything else (the first output with its
        events and prefill stats, the last one with its finish, shaped
        requests, a request from before a reload) takes the full path
        (`_full`), which also decides when a request may join a lane."""
        step = self._emitted_steps = self._emitted_steps + 1
        exits = self._lane_exits.pop(step, None)
        if exits:
            self._leave_lanes(exits)
        # prefix caching: the step's tokens are computed KV (kv_cache_manager.py)
        on_output = self.kv.on_output if self.kv.caching else None
        done: List[Request] = []
        emitted = self._emit_lanes(outbox, on_output) if self.lanes else 0
        if self._full:
            emitted += self._emit_full(now, outbox, on_output, done, step)
        self.counters["steps"] += 1
        self.counters["tokens"] += emitted
        self.kv.tokens += emitted
        return done

    def _emit_full(self, now: float, outbox: Outbox, on_output: Optional[Callable[[Request, List[int]], None]], done: List[Request], step: int) -> int:
        """The full path's outputs (see `_emit`): first and last outputs,
        shaped requests, prefills coming to an end; those that end go to
        `done`, those that may join a lane do so after this step's lane
        outputs. Returns the tokens emitted."""
        chunk = self.chunk
        sampler = self.sampler
        make_output = engine_core_output
        prefilling = self.prefilling
        batches = outbox.outputs
        joining: List[Request] = []
        emitted = 0
        for request in self._full.values():
            if prefilling:
                ready_at = prefilling.get(request.request_id)
                if ready_at is not None:
                    if ready_at > now:
                        continue  # prefill not done (inf: chunks left): no token this step
                    del prefilling[request.request_id]
                    if request.kv is not None:
                        self.transferring.discard(request.request_id)
                        if request.kv.fail and self._kv_load_failed(request, now, outbox, done):
                            continue
            outputs = batches.get(request.client_index)
            if outputs is None:
                outputs = batches[request.client_index] = []
            remaining = request.max_tokens - request.num_output_tokens
            n = chunk if chunk < remaining else remaining
            position = request.rng_state
            tokens, request.rng_state = request.sampler.tokens.draw(position, n)
            new_logprobs = None
            if request.shaped:  # sampling controls or logprobs: off the common path
                tokens, new_logprobs = self._shape(request, tokens, n == remaining, position)
            elif request.stop_ids is not None and not request.stop_ids.isdisjoint(tokens):
                tokens = request.sampler.tokens.avoid(tokens, request.stop_ids)
            first = request.num_output_tokens == 0
            events = request.pending_events
            request.num_output_tokens += n
            emitted += n
            finish = None
            if n == remaining:
                finish = request.finish
                if request.last_token is not None and tokens:
                    tokens[-1] = request.last_token
            if on_output is not None:
                on_output(request, tokens)
            kv_params = None
            if finish is not None and request.kv is not None and request.kv.produce:
                kv_params = self._kv_response(request, finish)
            if events is not None or kv_params is not None or (finish is not None and finish is not _LENGTH):
                # §4.5: queue/prefill time and prompt tokens for the frontend's
                # metrics; a STOP or ERROR end says why (stop_reason, error).
                output = make_output(
                    request.request_id,
                    tokens,
                    finish,
                    error=request_error("mock_failure", MOCK_FAILURE_MESSAGE) if finish is _ERROR else None,
                    stop_reason=request.stop_reason if finish is _STOP else None,
                    layout=self.wire.layout,
                    events=events,
                    prefill_stats=self._prefill_stats(request) if first else None,
                    new_logprobs=new_logprobs,
                    new_prompt_logprobs_tensors=self._prompt_logprobs(request) if first else None,
                    kv_transfer_params=kv_params,
                )
                request.pending_events = None
            elif finish is None and new_logprobs is None:
                # engine_core_output's running shape, built inline on
                # the per-token path (test_engine checks they are the same)
                output = [request.request_id, tokens]
            else:
                output = make_output(request.request_id, tokens, finish, new_logprobs=new_logprobs)
            outputs.append(output)
            if finish is not None:
                outbox.finish(request.client_index, request.request_id)
                done.append(request)
            elif (not request.shaped or self._rows_lane(request)) and request.sampler is sampler and remaining - n > chunk:
                # from its next output on, a lane does what this path would
                # (until its last output, a preemption or a reload)
                joining.append(request)
        if joining:  # after the lanes' outputs of this step
            self._join_lanes(joining, step)
        return emitted

    def _emit_lanes(self, outbox: Outbox, on_output: Optional[Callable[[Request, List[int]], None]]) -> int:
        """The steady state's outputs: per lane one loop, the next ids of
        each request (tokens.TokenPool.draw, inline: the request's position
        in the pool is its rng_state), nothing else checked. Returns the
        tokens emitted."""
        batches = outbox.outputs
        chunk = self.chunk
        pooled, base_pool, size = self._lane_source
        reuse = self.reuse_outputs
        # the loops below that slice the pool into the request's own output
        # list: decided once per step, not per lane (a step of one request
        # is what a mock behind a real frontend mostly makes, issue 17).
        # With prefix caching they run too, and the KV manager takes each
        # lane's tokens from those lists afterwards, one call per lane
        # (KVCacheManager.on_lane_outputs) instead of one per request.
        lane_outputs = self.kv.on_lane_outputs if on_output is not None and reuse else None
        emitted = 0
        for (client, stops, k), lane in self.lanes.items():
            outputs = batches.get(client)
            if outputs is None:
                outputs = batches[client] = []
            append = outputs.append
            # no stop ids, or a stop set with its stop-free pool: a slice
            # of the pool is what the checked draw would make
            pool = self._lane_pool(stops)
            if k is not None:
                # logprobs: the same slices, and the rows of those positions
                # (`_join_lanes` let only such requests in, and drew the rows)
                _next_pooled_rows(lane.values(), pool, size, chunk, append, self._lane_rows[stops, k])
                if lane_outputs is not None:
                    lane_outputs(lane.values())
            elif pool is not None and reuse:
                # the common case: the next ids of the pool swapped into each
                # request's own output (_next_pooled, the floor's loop,
                # reference_emitter.py). New lists every step (reuse off:
                # callers that keep what step() returned) take the general
                # loop below.
                _next_pooled(lane.values(), pool, size, chunk, append)
                if lane_outputs is not None:
                    lane_outputs(lane.values())
            else:
                source = self.sampler.tokens
                avoid = source.avoid
                checked = stops is True
                if pool is None:
                    pool = base_pool
                for request in lane.values():
                    if pooled:
                        position = request.rng_state
                        end = position + chunk
                        tokens = pool[position:end]
                        request.rng_state = end if end < size else end % size
                    else:
                        tokens, request.rng_state = source.draw(request.rng_state, chunk)
                    if checked and not request.stop_ids.isdisjoint(tokens):
                        tokens = avoid(tokens, request.stop_ids)
                    request.num_output_tokens += chunk
                    if on_output is not None:
                        on_output(request, tokens)
                    if reuse:
                        # the token list is new (on_output may keep it); the
                        # output list is the request's own
                        out = request.lane_output
                        out[1] = tokens
                        append(out)
                    else:
                        append([request.request_id, tokens])
            emitted += chunk * len(lane)
        return emitted

    def _pool_of(self, sampler: Sampler) -> "tuple[bool, Optional[List[int]], int]":
        """What the lanes slice: a pooled source's ids when a chunk fits the pad."""
        source = sampler.tokens
        if isinstance(source, TokenPool) and self.chunk <= POOL_PAD:
            return True, source.ids, source.size
        return False, None, 0

    def _join_lanes(self, requests: List[Request], step: int) -> None:
        """Requests that took the full path in this step and need nothing of
        it until their last output: into the lane of their client, leaving
        it before the step that makes their last output."""
        chunk, full, lanes, exits = self.chunk, self._full, self.lanes, self._lane_exits
        for request in requests:
            remaining = request.max_tokens - request.num_output_tokens
            stops = False if request.stop_ids is None else self._stop_lane(request.stop_ids)
            k = request.num_logprobs
            rows = None
            if k is not None:
                # its rows from the RowPool of the pool its lane slices; none
                # (a lane that checks its stop ids, no room for the rows):
                # it stays on the full path
                pool = self._lane_pool(stops)
                rows = self._lane_rows.get((stops, k))
                if rows is None and pool is not None:
                    rows = self.sampler.logprobs.pooled(self.sampler.tokens, k, pool)
                    if rows is not None:
                        self._lane_rows[stops, k] = rows
                if rows is None:
                    continue
                # every row it will read, drawn now (the lane's loop checks nothing)
                position, end = request.rng_state, request.rng_state + remaining
                rows.ensure(position, min(end, len(pool)))
                if end > rows.size:
                    rows.ensure(0, min(end - rows.size, rows.size))
            key = (request.client_index, stops, k)
            lane = lanes.get(key)
            if lane is None:
                lane = lanes[key] = {}
                self._lanes_changed()
            del full[request.request_id]
            lane[request.request_id] = request
            request.lane = key
            if rows is not None:  # its arrays are swapped in at every step (`_next_pooled_rows`)
                request.lane_output = [request.request_id, [0], logprobs_lists(chunk, k + 1, b"", b"", b"", self.wire.layout)]
            elif self.reuse_outputs:
                request.lane_output = [request.request_id, [0]]
            # the outputs the lane makes: every one before the last
            leave = request.lane_exit = step + 1 + (remaining - 1) // chunk
            exit_list = exits.get(leave)
            if exit_list is None:
                exits[leave] = [request]
            else:
                exit_list.append(request)

    def _stop_lane(self, stops: frozenset) -> Any:
        """The lane kind of a request with stop ids: its stop set, when its
        lanes slice a stop-free copy of the pool (built when the second
        request with that set joins a lane, at most LANE_POOLS sets), else
        True: a loop that checks every token against the request's ids."""
        if stops in self._lane_pools:
            return stops
        if not self._lane_source[0] or len(self._lane_pools) >= LANE_POOLS:
            return True
        seen = self._stop_sets_seen
        if seen.get(stops) is None:
            if len(seen) >= STOP_SETS_COUNTED:
                seen.clear()
            seen[stops] = 1
            return True
        pool = self.sampler.tokens.ids_avoiding(stops)
        if pool is None:
            return True
        del seen[stops]
        self._lane_pools[stops] = pool
        return stops

    def _leave_lanes(self, requests: List[Request]) -> None:
        """Lane members whose last output is due: back on the full path."""
        full = self._full
        for request in requests:
            self._remove_from_lane(request)
            full[request.request_id] = request

    def _remove_from_lane(self, request: Request) -> None:
        key = request.lane
        request.lane = None
        request.lane_output = None
        lane = self.lanes[key]
        del lane[request.request_id]
        if not lane:
            del self.lanes[key]
            self._lanes_changed()

    def _lanes_changed(self) -> None:
        """A lane was opened or closed, or the pools changed (a reload):
        which lane `steady_step` may step alone, if any."""
        self._solo = None
        # what else a steady step must not skip is fixed when the engine is
        # built (KV blocks enforced, prefix caching, reused outputs), so it
        # is looked at here, not in every step
        if len(self.lanes) == 1 and self.reuse_outputs and not self.kv.enforced and not self.kv.caching:
            for (client, stops, k), lane in self.lanes.items():
                pool = self._lane_pool(stops)
                if pool is not None and k is None:  # not: a source that is not pooled, a lane that checks its stop ids, logprobs
                    self._solo = (client, lane, pool)

    def _rows_lane(self, request: Request) -> bool:
        """Whether a shaped request may join a lane all the same: it asks
        for logprobs and nothing else shapes its tokens or their rows (no
        allowed_token_ids or forced ids, no banned ids), so a lane's slices
        of the pool and of its RowPool are what the full path would make;
        the outputs are reused, and the era sends logprobs as arrays."""
        return (
            request.pool is None
            and request.banned is None
            and not request.forced
            and request.num_logprobs is not None
            and request.num_logprobs <= ROW_POOL_MAX_K
            and self.reuse_outputs
            and self._lane_source[0]
            and not self.wire.layout.logprobs_as_lists
        )

    def _lane_pool(self, stops: Any) -> Optional[List[int]]:
        """The pool a lane of kind `stops` slices: the source's ids (no stop
        ids), a stop set's stop-free copy, or None (the source is not pooled,
        or the lane checks each token against its stop ids)."""
        if stops is False:
            return self._lane_source[1]
        return self._lane_pools.get(stops) if stops is not True else None

    def _out_of_lane(self, request: Request) -> None:
        """A lane member leaves it before its exit (preempted, ended, a
        reload): out of its lane and of the exits."""
        self._remove_from_lane(request)
        exits = self._lane_exits[request.lane_exit]
        exits.remove(request)
        if not exits:
            del self._lane_exits[request.lane_exit]

    # -- P/D disaggregation (kv_transfer.py) ------------------------------------

    def _prefill_stats(self, request: Request) -> Dict[str, Any]:
        """PrefillStats of a request's first output: a consumer's loaded
        prompt tokens are external cache hits, as vLLM counts them."""
        loaded = request.kv.loaded_tokens if request.kv is not None and request.kv.consume else 0
        return prefill_stats(request.prompt_len, request.cached_tokens, loaded)

    def _kv_response(self, request: Request, finish: FinishReason) -> Optional[Dict[str, Any]]:
        """A producer's kv_transfer_params on its terminal output; none for an
        ERROR or ABORT end (NIXL's request_finished: only LENGTH_CAPPED or STOPPED)."""
        if finish is not _LENGTH and finish is not _STOP or self.kv_transfer is None:
            return None
        return self.kv_transfer.response(request.request_id, request.prompt_len, self.kv.block_size, request.cached_tokens)

    def _kv_admit(self, request: Request, now: float, target: int, extra: float = 0.0) -> None:
        """A consumer request joins the batch: it waits for its KV (the
        prompt tokens not in the local cache) instead of prefilling them, as
        vLLM's WAITING_FOR_REMOTE_KVS; its first token comes when the
        transfer is done (also at once: a failure is then seen in _emit);
        `extra`: a LoRA load in the same step."""
        assert self.kv_transfer is not None
        wait = self.kv_transfer.admitted(request.kv, target, self.kv.block_size, self.latency.time_scale) + extra
        request.prefill_left = 0
        request.ready_at = now + wait
        self.prefilling[request.request_id] = request.ready_at
        self.transferring.add(request.request_id)

    def _kv_load_failed(self, request: Request, now: float, outbox: Outbox, done: List[Request]) -> bool:
        """A consumer's transfer failed (mock_kv_load, --fault-kv-transfer-fail).
        kv_load_failure_policy "fail" (vLLM's default): the request ends with
        ERROR and no tokens (scheduler.py: failed_kv_load_req_ids ->
        FINISHED_ERROR). "recompute": it prefills itself now, with the
        latency model's prefill time. True: no token in this step."""
        request.kv.fail = False
        assert self.kv_transfer is not None
        if self.kv_transfer.settings.load_failure_policy == "recompute":
            request.kv.loaded_tokens = 0
            wait = self.latency.first_token_seconds(request.prompt_len, self._rng) if self.latency.paced else 0.0
            if wait <= 0:
                return False
            request.ready_at = now + wait
            self.prefilling[request.request_id] = request.ready_at
            return True
        request.finish = FinishReason.ERROR
        error = request_error("kv_load_failed", KV_LOAD_FAILURE_MESSAGE)
        output = engine_core_output(request.request_id, [], FinishReason.ERROR, error, self.wire.layout, events=request.pending_events)
        outbox.end(request.client_index, request.request_id, output)
        request.pending_events = None
        done.append(request)
        return True

    def _shape(self, request: Request, tokens: List[int], last: bool, position: Any) -> "tuple[List[int], Optional[List[Any]]]":
        """Tokens of a request with sampling controls (drawn from its pool)
        or logprobs, and their new_logprobs (computed on the final ids,
        the planned last token included). `position`: the token source's
        state the tokens were drawn from."""
        if request.pool is not None:  # allowed_token_ids / logit_bias +100 (request.plan)
            pool = request.pool
            tokens = [pool[t % len(pool)] for t in tokens]
        elif request.stop_ids is not None and not request.stop_ids.isdisjoint(tokens):
            tokens = request.sampler.tokens.avoid(tokens, request.stop_ids)
        if last and request.last_token is not None and tokens:
            tokens[-1] = request.last_token
        return tokens, None if request.num_logprobs is None else self._logprobs(request, tokens, position)

    def _logprobs(self, request: Request, tokens: List[int], position: Any) -> Optional[List[Any]]:
        """new_logprobs for this output's tokens (logprobs.py, Appendix E);
        none for an output without tokens, as vLLM. Without sampling
        controls, the pre-drawn rows of the token pool's positions
        (logprobs.RowPool) where the tokens are the pool's own."""
        if not tokens:
            return None
        k = request.num_logprobs
        if request.alternatives is None and request.banned is None and not request.forced:
            pool = request.sampler.logprobs.pooled(request.sampler.tokens, k)
            if pool is not None:
                rows = pool.take(position, tokens)
                if rows is not None:
                    return logprobs_lists(len(tokens), k + 1, rows[0], rows[1], rows[2], self.wire.layout)
        width, ids, lps, ranks, request.logprob_state = request.sampler.logprobs.rows(
            request.logprob_state, tokens, request.num_logprobs, request.alternatives, request.banned, request.forced
        )
        return logprobs_lists(len(tokens), request.num_logprobs + 1, ids, lps, ranks, self.wire.layout, ids_width=width)

    def _prompt_logprobs(self, request: Request) -> Optional[List[Any]]:
        """new_prompt_logprobs_tensors, once with the first output: a row per
        prompt position after the first (the frontend puts None for that)."""
        if request.num_prompt_logprobs is None or request.prompt_token_ids is None or request.prompt_len < 2:
            return None
        k = request.num_prompt_logprobs
        prompt = request.prompt_token_ids[1:]
        width, ids, lps, ranks, request.logprob_state = request.sampler.logprobs.rows(request.logprob_state, prompt, k, banned=request.banned)
        request.prompt_token_ids = None
        return logprobs_lists(len(prompt), k + 1, ids, lps, ranks, self.wire.layout, tensors=True, ids_width=width)

    def _admit(self, now: float, budget: Optional[int], outbox: Outbox) -> int:
        """Move waiting requests into the running batch while the batch limit,
        the token budget (`budget` left, None: unlimited) and the KV blocks
        allow; return the prompt tokens they prefill in this step."""
        prefill_tokens = 0
        latency, kv, waiting, lora = self.latency, self.kv, self.waiting, self.lora
        # max_loras: a request whose adapter would be one too many in the batch
        # is skipped and keeps its place (vllm/v1/core/sched/scheduler.py,
        # scheduled_loras / skipped_waiting_requests)
        running_loras = self._running_lora_ids() if lora is not None else set()
        skipped: List[Request] = []
        while waiting and self.can_admit and (budget is None or budget > 0):
            request = waiting.peek_request()
            adapter = request.lora_request
            if adapter is not None and lora is not None:
                if adapter.lora_int_id not in running_loras and len(running_loras) >= lora.max_loras:
                    skipped.append(waiting.pop_request())
                    continue
            need = 0
            if kv.enforced:
                need = kv.blocks_to_admit(request, self._next_tokens(request))
                if not kv.fits(need):
                    if not self.running and need > kv.num_blocks:
                        self._reject_too_long(waiting.pop_request(), outbox)
                        continue
                    break  # waits for blocks to free up, as vLLM
            loaded = False
            if adapter is not None and lora is not None:
                loads = lora.loads
                try:
                    lora.add(adapter)  # what vLLM's model runner does for each adapter it schedules
                except LoRAError as exc:
                    self._reject_lora(waiting.pop_request(), str(exc), outbox)
                    continue
                loaded = lora.loads != loads
                running_loras.add(adapter.lora_int_id)
            if kv.enforced:
                kv.allocate(request, need)
            waiting.pop_request()
            request.scheduled_at = now
            events = request.pending_events or []
            events.append(engine_core_event(_SCHEDULED, now))
            request.pending_events = events
            self.running[request.request_id] = request
            self._full[request.request_id] = request  # its next output carries events
            target = request.num_tokens  # recompute after a preemption
            # cached prompt blocks are not computed again (KV is still held)
            request.cached_tokens = kv.admit(request)
            target -= request.cached_tokens
            if request.kv is not None and request.kv.consume and not request.num_output_tokens:
                # P/D consumer: its KV comes over the transfer, not from the token budget; its
                # blocks are cached when its first token comes (kv.on_output), i.e. after the
                # load, as vLLM caches them once the remote KV has arrived
                self._kv_admit(request, now, target, latency.lora_load_seconds() if loaded else 0.0)
                continue
            take = target if budget is None else min(target, budget)
            prefill_tokens += take
            if budget is not None:
                budget -= take
            request.prefill_left = target - take
            if kv.caching:  # the prompt blocks prefilled in this step are cached now, as vLLM's
                kv.computed(request, request.num_tokens - request.prefill_left)
            if request.prefill_left:
                self.chunking[request.request_id] = request
            if request.ttft_ms is not None:
                request.ready_at = now + latency.first_token_seconds(request.prompt_len, self._rng, request.ttft_ms)
            elif latency.paced:
                request.ready_at = now + latency.first_token_seconds(request.prompt_len, self._rng)
            else:
                request.ready_at = now
            if loaded:
                request.ready_at += latency.lora_load_seconds()
            if request.prefill_left or request.ready_at > now:
                self.prefilling[request.request_id] = float("inf") if request.prefill_left else request.ready_at
        for request in reversed(skipped):
            waiting.prepend_request(request)
        return prefill_tokens

    def _running_lora_ids(self) -> "set[int]":
        return {r.lora_request.lora_int_id for r in self.running.values() if r.lora_request is not None}

    def _reject_lora(self, request: Request, message: str, outbox: Outbox) -> None:
        """An adapter that cannot be loaded or activated: where vLLM's worker
        raises (and its engine dies), this request ends with ERROR and
        vLLM's message; the engine goes on."""
        error = request_error("lora_load_failed", message)
        outbox.end(request.client_index, request.request_id, engine_core_output(request.request_id, [], FinishReason.ERROR, error, self.wire.layout))
        self._on_reject(request)

    def lora_adapters(self) -> "tuple[Dict[str, int], Dict[str, int]]":
        """SchedulerStats waiting_lora_adapters / running_lora_adapters:
        requests per adapter name (§7.1; vLLM's LoRARequestStates)."""
        waiting: Counter = Counter()
        running: Counter = Counter()
        if self.lora is not None:
            for request in self.running.values():
                if request.lora_request is not None:
                    running[request.lora_request.lora_name] += 1
            for request in self.waiting.requests():
                if request.lora_request is not None:
                    waiting[request.lora_request.lora_name] += 1
        return dict(waiting), dict(running)

    def _reject_too_long(self, request: Request, outbox: Outbox) -> None:
        """A request whose KV can never fit: ERROR now, not a queue that never moves."""
        error = request_error("kv_cache_too_small", f"needs more than the engine's {self.kv.num_blocks} KV blocks")
        outbox.end(request.client_index, request.request_id, engine_core_output(request.request_id, [], FinishReason.ERROR, error, self.wire.layout))
        self._on_reject(request)

    def _continue_prefills(self, now: float, budget: int) -> "tuple[int, int]":
        """Chunked prefill of running requests (admission order) within
        `budget`; return (tokens prefilled, budget left)."""
        prefilled = 0
        for request in list(self.chunking.values()):
            if budget <= 0:
                break
            take = min(request.prefill_left, budget)
            request.prefill_left -= take
            budget -= take
            prefilled += take
            if self.kv.caching:
                self.kv.computed(request, request.num_tokens - request.prefill_left)
            if not request.prefill_left:
                del self.chunking[request.request_id]
                if request.ready_at > now:
                    self.prefilling[request.request_id] = request.ready_at
                else:
                    del self.prefilling[request.request_id]
        return prefilled, budget

    def _reserve_decode_blocks(self, now: float) -> bool:
        """KV for the running requests' tokens of this step, before anything
        is admitted (vLLM schedules running requests first): a request
        crossing a block boundary needs a new block; when they run out, the
        newest running request is preempted (vLLM's recompute preemption)
        until the rest fit. True when something was preempted: then nothing
        is admitted in this step, as in vLLM."""
        kv, prefilling = self.kv, self.prefilling
        preempted = False
        while True:
            needs = []
            total = 0
            for request in self.running.values():
                if request.request_id in prefilling:
                    continue  # its next token's block came with its admission
                need = kv.blocks_to_grow(request, self._next_tokens(request))
                if need > 0:
                    needs.append((request, need))
                    total += need
            if kv.fits(total) or not self.running:
                break
            self._preempt(next(reversed(self.running.values())), now)
            preempted = True
        for request, need in needs:
            kv.allocate(request, need)
        return preempted

    def preempt_all(self, now: float) -> None:
        """Every running request back to the queue, newest first (vLLM's
        reset_prefix_cache(reset_running_requests=True))."""
        while self.running:
            self._preempt(next(reversed(self.running.values())), now)

    def _preempt(self, request: Request, now: float) -> None:
        """Back to the front of the queue; its KV is freed and recomputed later."""
        del self.running[request.request_id]
        self._release(request)
        # Events not sent yet (QUEUED, SCHEDULED of a request preempted before
        # its first token) stay: they all ride on its next output, as in vLLM.
        request.pending_events = (request.pending_events or []) + [engine_core_event(EngineCoreEventType.PREEMPTED, now)]
        self.waiting.prepend_request(request)
        self.counters["preemptions"] += 1
        self._on_preempt(request)

    def request_counts(self) -> "tuple[int, int]":
        """(running, waiting) as SchedulerStats show them (vLLM's
        get_request_counts): a consumer waiting for its KV is waiting."""
        transferring = len(self.transferring)
        return len(self.running) - transferring, len(self.waiting) + transferring

    def scheduler_stats(self, prefix_cache_stats: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
        """The engine's SchedulerStats now (§7.1)."""
        waiting_loras, running_loras = self.lora_adapters()
        return scheduler_stats(
            waiting_lora_adapters=waiting_loras,
            running_lora_adapters=running_loras,
            prefix_cache_stats=prefix_cache_stats,
            num_running_reqs=len(self.running) - len(self.transferring),
            num_waiting_reqs=len(self.waiting) + len(self.transferring),
            kv_cache_usage=self.kv.usage,
            step_counter=self.counters["steps"],
        )
