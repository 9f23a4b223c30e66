"""The lanes: the steady state's short path of the output processor, pure.

A running request past its first output, with nothing pending and no
sampling controls (or logprobs only), sits in a lane (per client, stop set
and logprob k) until the step before its last output: a lane is one tight
loop per step, its members' next ids out of the token pool, one
`[id, tokens]` output each (the request's own list, reused from step to step
with `reuse_outputs`). The step a request leaves its lane in is fixed when
it joins (`_lane_exits`), so the loop checks nothing per request: the
steady state pays for its tokens and nothing else, as the floor's loop
(benchmarks/reference_emitter.py). Everything else takes the output processor's
full path (output_processor.py), which also decides when a request joins.

`LaneBooks` is a base of `OutputProcessor`: its methods are the output
processor's own (no attribute hop on the per-step path); nothing else
touches the lanes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional

import msgpack

from gmock_engine.wire.outputs import RAW_VIEW_EXT, logprobs_lists
from gmock_engine.content.logprobs import ROW_POOL_MAX_K
from gmock_engine.core.outbox import Outbox
from gmock_engine.core.request import Request
from gmock_engine.core.sched_output import PauseState
from gmock_engine.content.tokens import POOL_PAD, TokenPool

if TYPE_CHECKING:
    from gmock_engine.content.sampler import Sampler

#: Stop sets whose lanes draw from a stop-free copy of the pool
#: (tokens.TokenPool.ids_avoiding), per engine; requests with any other
#: stop set take a lane whose loop checks every token.
LANE_POOLS = 4
#: A stop set gets its copy when the second request with it joins a lane
#: (a set seen once, such as a client's one-off stop_token_ids, is not worth
#: building a pool copy for); this many sets are counted at most.
STOP_SETS_COUNTED = 1024

# bound once: an enum member through its metaclass costs more than a global
_PAUSED_ALL = PauseState.PAUSED_ALL


def _next_pooled(requests: Any, pool: List[int], size: int, chunk: int, append: Callable[[Any], None]) -> None:
    """Each lane member's next `chunk` ids out of the pool (tokens.TokenPool.draw,
    inline: the member's position in the pool is its rng_state), swapped into
    its own reused `[id, tokens]` output, which goes to `append`: the per-token
    work of a steady request and nothing else, the floor's loop
    (reference_emitter.py). Shared by `LaneBooks._emit_lanes` and
    `LaneBooks.steady_step`."""
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





class LaneBooks:
    """The lanes' books and loops (see the module docstring); a base of
    `OutputProcessor`, which sets `chunk`, `sampler`, `kv`, `wire`,
    `counters`, `reuse_outputs`, `_full` and `_scheduler` before
    `_init_lanes`."""

    def _init_lanes(self) -> None:
        #: (client, stops, k) -> the steady requests of that lane;
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
        #: output step -> the lane members that go back to the full path then.
        self._lane_exits: Dict[int, List[Request]] = {}
        self._emitted_steps = 0
        #: (client, lane, pool) when there is one lane, it slices a pool and
        #: the engine's settings let a step skip the rest: what
        #: `steady_step` steps (kept by `_lanes_changed`), else None
        self._solo: Optional[tuple] = None
        #: (pooled, pool ids, pool size) of the sampler's source, for the lanes
        self._lane_source = self._pool_of(self.sampler)

    def _reset_lanes(self, sampler_changed: bool) -> None:
        """A reload: lane members go on on the full path (each with its own
        sampler); a new sampler drops the pools copied from the old one."""
        if sampler_changed:
            for lane in list(self.lanes.values()):
                for request in list(lane.values()):
                    self._out_of_lane(request)
                    self._full[request.request_id] = request
            self._lane_pools, self._stop_sets_seen = {}, {}
            self._lane_rows = {}
        self._lane_source = self._pool_of(self.sampler)
        self._lanes_changed()

    def steady_step(self) -> "Optional[tuple[int, List[Any]]]":
        """The step, when it is a steady one: (client, outputs) of its one
        message; None when it is not (the caller then takes the full step).

        Steady: nothing waiting, every running request in one lane of one
        client that slices the token pool (so none on the full path: no
        first or last output, no prefill, no shaped request), none leaving
        it at this step, and nothing else a step has to do per request (no
        KV blocks enforced, no prefix caching; outputs reused). Such a step
        is what `EngineCore.step` would make then, without its per-step branches for
        admission, preemption, budgets, the full path and lane exits: behind
        a real frontend most steps are of a few requests, and their fixed
        cost is what the mock spends (P2). A property test runs
        scenarios with and without this path and compares the bytes."""
        solo = self._solo
        scheduler = self._scheduler
        if (
            solo is None
            or self._full  # (prefilling and chunking requests are on the full path)
            or scheduler.waiting
            or scheduler.pause_state is _PAUSED_ALL
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
        if scheduler.latency.paced:
            plan = self._steady_plan
            plan.num_running_reqs = len(scheduler.running)
            scheduler.step_delay = scheduler.latency.step_time(plan, scheduler.rng, self.kv.tokens, scheduler.step_sizes)
        return client, outputs

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
        # is what a mock behind a real frontend mostly makes).
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

    def _pool_of(self, sampler: "Sampler") -> "tuple[bool, Optional[List[int]], int]":
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

