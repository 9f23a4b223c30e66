"""The output processor: the tokens and outputs of a step, pure (vLLM:
`Scheduler.update_from_output` with the model runner's sampling, here one
object beside the scheduler).

`take_plan` takes what `Scheduler.schedule` decided (sched_output.py): the
new requests, and the rejected ones, which get their ERROR. At the end of
the step, `update_from_output` makes what a model and vLLM's
`update_from_output` would: every running request whose prefill is done gets
its next tokens (`make_tokens`, the one place a request's token ids are
drawn and shaped: sampling controls, stop ids, the planned last token), its
logprobs, and its output in its client's batch of the outbox; the first
output carries its events and prefill stats, the last one its finish (and a
P/D producer's kv_transfer_params). It returns the requests that ended,
which `Scheduler.retire` takes out of the batch.

The steady state (a request past its first output, nothing pending) takes
the lanes (lanes.py, `LaneBooks`, this class's base): the full path here
decides when a request joins one.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, List, Optional

from gmock_engine.content import pooling
from gmock_engine.wire.outputs import engine_core_output, logprobs_lists, prefill_stats, request_error
from gmock_engine.wire.types import FinishReason
from gmock_engine.core.kv_cache_manager import KVCacheManager
from gmock_engine.core.lanes import LaneBooks
from gmock_engine.core.outbox import Outbox
from gmock_engine.kv.transfer import KV_LOAD_FAILURE_MESSAGE
from gmock_engine.core.request import Request
from gmock_engine.core.sched_output import BatchObserver, SchedulerOutput
from gmock_engine.content.sampler import Sampler
from gmock_engine.core.scheduler import Scheduler

#: The error of a request ended by mock_fail_after (vllm_xargs, or --fault-error-mid-stream).
MOCK_FAILURE_MESSAGE = "mock failure on request (vllm_xargs mock_fail_after or --fault-error-mid-stream)"

# Read on the per-request path: module constants, not enum member lookups.
_LENGTH, _STOP, _ERROR = FinishReason.LENGTH, FinishReason.STOP, FinishReason.ERROR


class OutputProcessor(LaneBooks, BatchObserver):
    """The tokens, logprobs and outputs of each step the scheduler plans."""

    def __init__(self, scheduler: Scheduler, reuse_outputs: bool = False) -> None:
        self._scheduler = scheduler
        self.kv: KVCacheManager = scheduler.kv
        self.wire = scheduler.wire
        self.chunk = scheduler.chunk
        #: speculative decoding's verifier (content/spec_decode.py); None: off
        self.spec = scheduler.spec
        self.counters = scheduler.counters
        self.kv_transfer = scheduler.kv_transfer
        #: The sampler of new requests, what the lanes draw from.
        self.sampler: Sampler = scheduler.sampler
        #: Lane members' outputs reuse one `[id, tokens]` list each (at 8 192
        #: running, making and freeing two lists per token cost more than the
        #: rest of the step's work). Only for a caller that encodes every
        #: message before the next step (EngineSettings.reuse_outputs).
        self.reuse_outputs = reuse_outputs
        #: Running requests on the full path (the others are in a lane), in
        #: the order their outputs are made.
        self._full: Dict[str, Request] = {}
        #: the plan of a steady step (lanes.py), for the latency model
        self._steady_plan = SchedulerOutput(chunk=self.chunk)
        self._init_lanes()
        scheduler.output_processor = self

    def reconfigure(self, sampler: Sampler, changed: bool) -> None:
        """A reload (Scheduler.reconfigure): a new sampler is for new
        requests; the lanes, which draw from the current one, let their
        members go on on the full path (each with its own sampler)."""
        self.sampler = sampler
        self._reset_lanes(changed)

    def drop(self, request: Request) -> None:
        """A running request left the batch (ended, preempted, aborted):
        out of its lane or the full path."""
        if request.lane is not None:
            self._out_of_lane(request)
        else:
            self._full.pop(request.request_id, None)

    def clear(self, running: Iterable[Request]) -> None:
        """Every running request left the batch at once (Scheduler.remove_all)."""
        for request in running:
            request.lane = request.lane_output = None
        self._full.clear()
        self.lanes.clear()
        self._lane_exits.clear()

    # -- the step ----------------------------------------------------------------

    def take_plan(self, scheduler_output: SchedulerOutput, outbox: Outbox) -> None:
        """The plan `Scheduler.schedule` made: its rejections get their
        ERROR in `outbox` now; its new requests take the full path, their
        first output (with their events) comes when their prefill is done."""
        if scheduler_output.rejected_reqs:
            layout = self.wire.layout
            for request, error in scheduler_output.rejected_reqs:
                outbox.end(request.client_index, request.request_id, engine_core_output(request.request_id, [], _ERROR, error, layout))
        if scheduler_output.scheduled_new_reqs:
            full = self._full
            for request in scheduler_output.scheduled_new_reqs:
                full[request.request_id] = request  # its next output carries events
                if request.replay is not None:
                    self._replay_wait(request, request.replay.due())

    def prefilled_at_once(self, requests: List[Request], now: float, outbox: Outbox) -> List[Request]:
        """Requests the plan just admitted whose prefill takes no time (no
        latency model): the step that computes their prompt ends as it
        begins, so their first output goes into this boundary's messages;
        return those that ended with it."""
        on_output = self.kv.on_output if self.kv.caching else None
        done: List[Request] = []
        emitted = self._emit_full(now, outbox, on_output, done, self._emitted_steps, requests)
        self.counters["tokens"] += emitted
        self.kv.tokens += emitted
        return done

    def update_from_output(self, now: float, outbox: Outbox) -> List[Request]:
        """The step that ends at `now`, the per-token path: each ready
        running request's next tokens into `outbox`; return the requests
        that ended (their last output made), which `Scheduler.retire` takes
        out of the batch. Each request gets min(chunk, remaining) tokens;
        one that reaches its planned length ends as planned (request.plan)
        and its id goes into that message's finished_requests.

        A request in its steady state sits in a lane (lanes.py) until its
        last output. Everything else (the first output with its events and
        prefill stats, the last one with its finish, shaped requests, a
        request from before a reload) takes the full path (`_full`), which
        also decides when a request may join a lane."""
        step = self._emitted_steps = self._emitted_steps + 1
        exits = self._lane_exits.pop(step, None)
        if exits:
            self._leave_lanes(exits)
        # prefix caching: the step's tokens are computed KV (kv_cache_manager.py)
        on_output = self.kv.on_output if self.kv.caching else None
        done: List[Request] = []
        emitted = self._emit_lanes(outbox, on_output) if self.lanes else 0
        if self._full:
            emitted += self._emit_full(now, outbox, on_output, done, step, self._full.values())
        self.counters["steps"] += 1
        self.counters["tokens"] += emitted
        self.kv.tokens += emitted
        return done

    def _emit_full(
        self,
        now: float,
        outbox: Outbox,
        on_output: Optional[Callable[[Request, List[int]], None]],
        done: List[Request],
        step: int,
        requests: Iterable[Request],
    ) -> int:
        """The full path's outputs (see `update_from_output`): first and last outputs,
        shaped requests, prefills coming to an end; those that end go to
        `done`, those that may join a lane do so after this step's lane
        outputs. Returns the tokens emitted."""
        chunk = self.chunk
        spec = self.spec  # a request under speculative decoding stays here: a lane emits a fixed chunk
        sampler = self.sampler
        make_output = engine_core_output
        scheduler = self._scheduler
        prefilling = scheduler.prefilling
        batches = outbox.outputs
        joining: List[Request] = []
        emitted = 0
        for request in requests:
            if prefilling:
                ready_at = prefilling.get(request.request_id)
                if ready_at is not None:
                    if ready_at > now:
                        continue  # prefill not done (inf: chunks left): no token this step
                    del prefilling[request.request_id]
                    if request.kv is not None:
                        scheduler.remote_kvs_arrived(request)
                        if request.kv.fail:
                            wait = scheduler.kv_load_failed(request, now)
                            if wait is None:
                                self._kv_load_error(request, outbox)
                                done.append(request)
                                continue
                            if wait:
                                continue
            outputs = batches.get(request.client_index)
            if outputs is None:
                outputs = batches[request.client_index] = []
            if request.pooling is not None:  # its prefill done (its blocks cached): its one output, the pooled tensor (§3.7)
                outputs.append(pooling.final_output(request, self._prefill_stats(request), self.wire.layout))
                outbox.finish(request.client_index, request.request_id)
                done.append(request)
                continue
            remaining = request.max_tokens - request.num_output_tokens
            replaying = request.replay
            if replaying is None:
                n = chunk if chunk < remaining else remaining
                if spec is not None:
                    n = spec.next_count(request, remaining)
            else:
                n = replaying.next_count(remaining, chunk)  # --replay: the recorded output's count
            tokens, new_logprobs = self.make_tokens(request, n, n == remaining)
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
            elif replaying is not None:
                # never in a lane: each output waits for its recorded time
                self._replay_wait(request, replaying.advance(), now)
            elif spec is None and (not request.shaped or self._rows_lane(request)) and request.sampler is sampler and remaining - n > chunk:
                # from its next output on, a lane does what this path would
                # (until its last output, a preemption or a reload)
                joining.append(request)
        if joining:  # after the lanes' outputs of this step
            self._join_lanes(joining, step)
        return emitted

    def make_tokens(self, request: Request, n: int, last: bool) -> "tuple[List[int], Optional[List[Any]]]":
        """The next `n` token ids of a request (`last`: its last output) and
        their new_logprobs (None: not asked): drawn from its sampler's token source, shaped by its controls
        (its pool, its stop ids, the planned last token), the logprobs
        computed on the final ids. The full path's one call for the tokens a
        request emits (a lane slices the pool instead: its members have
        nothing to shape)."""
        position = request.rng_state
        source = request.sampler.tokens
        tokens, request.rng_state = source.draw(position, n)
        if not request.shaped:  # the common case: its stop ids only
            if request.stop_ids is not None and not request.stop_ids.isdisjoint(tokens):
                tokens = source.avoid(tokens, request.stop_ids)
            return tokens, None
        if request.pool is not None:  # allowed_token_ids / logit_bias +100 (request.plan)
            pool = request.pool
            tokens = [pool[t % len(pool)] for t in tokens]
        elif request.stop_ids is not None and not request.stop_ids.isdisjoint(tokens):
            tokens = source.avoid(tokens, request.stop_ids)
        if last and request.last_token is not None and tokens:
            tokens[-1] = request.last_token
        return tokens, None if request.num_logprobs is None else self._logprobs(request, tokens, position)

    def _replay_wait(self, request: Request, due: Optional[float], now: Optional[float] = None) -> None:
        """--replay (timing/replay.py): no output of `request` before `due`, its
        next recorded output's time. It waits as a prefill does (`prefilling`:
        no token until then; `Scheduler.next_step_time` wakes the engine
        then when nothing else runs); a new request (`now` None) waits for
        the later of its prefill and its recorded first output."""
        if due is None:
            return
        prefilling = self._scheduler.prefilling
        if now is None:
            if due <= request.ready_at:
                return
            request.ready_at = due
            if prefilling.get(request.request_id) == float("inf"):
                return  # chunks left: their last one waits for ready_at (Scheduler._continue_prefills)
        elif due <= now:
            return
        prefilling[request.request_id] = due

    def _logprobs(self, request: Request, tokens: List[int], position: Any) -> Optional[List[Any]]:
        """new_logprobs for this output's tokens (content/logprobs.py, Appendix E);
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

    # -- P/D disaggregation (kv/transfer.py) ------------------------------------

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

    def _kv_load_error(self, request: Request, outbox: Outbox) -> None:
        """The ERROR output, with no tokens, of a consumer whose KV load
        failed (Scheduler.kv_load_failed: policy "fail")."""
        error = request_error("kv_load_failed", KV_LOAD_FAILURE_MESSAGE)
        output = engine_core_output(request.request_id, [], FinishReason.ERROR, error, self.wire.layout, events=request.pending_events)
        outbox.end(request.client_index, request.request_id, output)
        request.pending_events = None
