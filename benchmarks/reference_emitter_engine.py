"""The reference emitter's engine: one DP rank's requests, finish buckets
and steps, the wire messages gmock sends at the least a Python loop spends
on them. The script, its sockets and what it is for: reference_emitter.py.
"""

from __future__ import annotations

import time
from typing import Any, Dict, List, Optional

import msgpack

from gmock_engine.content.logprobs import LogprobModel
from gmock_engine.content.tokens import POOL_PAD, RandomTokens
from gmock_engine.core.outbox import STATS_INTERVAL_S
from gmock_engine.wire.eras import WireLayout
from gmock_engine.wire.outputs import engine_core_event, engine_core_output, logprobs_lists, prefill_stats, scheduler_stats
from gmock_engine.wire.types import EngineCoreEventType, FinishReason

from reference_emitter_kv import FloorKV  # beside this file: benchmarks/

#: EngineCoreRequest fields read here (the 0.33 layout the bench driver sends).
_PROMPT, _SAMPLING, _CLIENT = 1, 3, 11


class Engine:
    """One DP rank: its sockets, its requests by client, its finish buckets."""

    def __init__(self, rank: int, chunk: int, tokens: RandomTokens, layout: WireLayout, kv: Optional[FloorKV] = None) -> None:
        self.rank = rank
        self.chunk = chunk
        self.tokens = tokens
        self.layout = layout
        self.inputs: List[Any] = []
        self.outputs: List[Any] = []
        self.step = 0
        #: client -> request id -> [reused output list, generator state, tokens of its last output]
        self.running: Dict[int, Dict[str, List[Any]]] = {}
        #: the same for requests with logprobs: [reused [id, tokens, LogprobsLists], state, last, RowPool]
        self.running_logprobs: Dict[int, Dict[str, List[Any]]] = {}
        #: requests added since the last step: (client, id, max_tokens, state, events, prompt, RowPool)
        self.fresh: List[Any] = []
        #: prefix caching (None: off), and its record of each running request
        self.kv = kv
        self.kv_records: Dict[str, List[Any]] = {}
        self.logprob_model = LogprobModel(low=tokens.low, span=tokens.span)
        #: step -> [(client, id)] whose last chunk goes out in that step
        self.finish_at: Dict[int, List[Any]] = {}
        self.count = 0
        self._stats_counts = (0, 0)
        self._stats_at = float("-inf")

    @property
    def busy(self) -> bool:
        return self.count > 0

    def add(self, body: List[Any]) -> None:
        """ADD: its generator state, its QUEUED event; its finish step is fixed at its first step."""
        rid, client, sampling = body[0], body[_CLIENT], body[_SAMPLING]
        n = sampling.get("max_tokens", 16)
        events = [engine_core_event(EngineCoreEventType.QUEUED, time.monotonic())]
        state = self.tokens.initial_state(rid)
        pool = None
        k = sampling.get("logprobs")
        if k is not None:
            pool = self.logprob_model.pooled(self.tokens, k)
            assert pool is not None and self.chunk <= POOL_PAD, "the floor makes logprobs for k <= 20 and chunks <= 64 only"
            # the rows of every position it will read, drawn now
            end = state + n
            pool.ensure(state, min(end, len(pool.ids)))
            if end > pool.size:
                pool.ensure(0, min(end - pool.size, pool.size))
        self.fresh.append((client, rid, n, state, events, body[_PROMPT] or [], pool))
        self.count += 1

    def abort(self, rid: str) -> None:
        for client, requests in [*self.running.items(), *self.running_logprobs.items()]:
            if requests.pop(rid, None) is not None:
                break
        else:
            for i, entry in enumerate(self.fresh):
                if entry[1] == rid:
                    client = entry[0]
                    del self.fresh[i]
                    break
            else:
                return
        self.count -= 1
        record = self.kv_records.pop(rid, None)
        if record is not None:
            self.kv.free(record)  # type: ignore[union-attr]
        out = engine_core_output(rid, [], FinishReason.ABORT, None, self.layout)
        self.outputs[client].send(pack([self.rank, [out], None, time.monotonic(), None, [rid]]))

    def run_step(self) -> None:
        """One step: last outputs, one draw per running request, then first outputs."""
        step = self.step = self.step + 1
        chunk = self.chunk
        batches: Dict[int, Any] = {}
        now = time.monotonic()
        kv = self.kv
        # the blocks of requests that end: released before new requests take
        # theirs (gmock and vLLM free what ended before they schedule), and
        # of new requests that end at once, after
        freeing: List[Any] = []
        if kv is not None:
            kv.step(step)
        ending = self.finish_at.pop(step, None)
        if ending:
            for client, rid in ending:
                entry = self.running.get(client, {}).pop(rid, None) or self.running_logprobs.get(client, {}).pop(rid, None)
                if entry is None:
                    continue  # aborted
                position = entry[1]
                tokens, entry[1] = self.tokens.draw(position, entry[2])
                logprobs = _logprobs(entry[3], position, len(tokens), self.layout) if len(entry) > 3 else None
                batch = batches.get(client) or batches.setdefault(client, ([], []))
                batch[0].append([rid, tokens, logprobs, None, None, 1])
                batch[1].append(rid)
                self.count -= 1
                if kv is not None:
                    kv.free(self.kv_records.pop(rid))
        ids, size = self.tokens.ids, self.tokens.size
        for client, requests in self.running.items():
            batch = batches.get(client) or batches.setdefault(client, ([], []))
            append = batch[0].append
            if chunk == 1:  # as below, one index instead of a slice
                for entry in requests.values():
                    position = entry[1]
                    out = entry[0]
                    out[1] = [ids[position]]
                    position += 1
                    entry[1] = position if position < size else 0
                    append(out)
            elif chunk <= POOL_PAD:
                # The per-token work and nothing else: the next ids of the
                # request's pool position (content/tokens.py's TokenPool.draw, inline:
                # one slice) swapped into its reused [request_id, tokens] list.
                for entry in requests.values():
                    end = entry[1] + chunk
                    out = entry[0]
                    out[1] = ids[entry[1] : end]
                    entry[1] = end if end < size else end % size
                    append(out)
            else:
                for entry in requests.values():
                    out = entry[0]
                    out[1], entry[1] = self.tokens.draw(entry[1], chunk)
                    append(out)
        ext = msgpack.ExtType
        for client, requests in self.running_logprobs.items():
            batch = batches.get(client) or batches.setdefault(client, ([], []))
            append = batch[0].append
            # as the loops above, and the rows of the same positions: three
            # slices of the RowPool's buffers swapped into the reused lists
            for entry in requests.values():
                position, out, pool = entry[1], entry[0], entry[3]
                end = position + chunk
                out[1] = ids[position:end]
                id_row, lp_row, rank_row = out[2][0], out[2][1], out[2][2]
                stride = pool.stride
                id_row[2] = tuple.__new__(ext, (3, pool.row_ids[position * stride : end * stride]))
                lp_row[2] = tuple.__new__(ext, (3, pool.row_lps[position * stride : end * stride]))
                rank_row[2] = tuple.__new__(ext, (3, pool.row_ranks[position * 8 : end * 8]))
                entry[1] = end if end < size else end % size
                append(out)
        if self.fresh:  # after the draw loop: their next tokens are for the next step
            scheduled = engine_core_event(EngineCoreEventType.SCHEDULED, now)
            for client, rid, n, state, events, prompt, pool in self.fresh:
                events.append(scheduled)
                first_n = chunk if chunk < n else n
                position = state
                tokens, state = self.tokens.draw(state, first_n)
                left = n - first_n
                hit = 0
                if kv is not None:
                    record, hit = kv.start(prompt, n, position, step)
                    if left:
                        self.kv_records[rid] = record
                    else:
                        freeing.append(record)
                first = engine_core_output(
                    rid, tokens, None if left else FinishReason.LENGTH, None, self.layout,
                    events=events, prefill_stats=prefill_stats(len(prompt), hit),
                    new_logprobs=None if pool is None else _logprobs(pool, position, first_n, self.layout),
                )  # fmt: skip
                batch = batches.get(client) or batches.setdefault(client, ([], []))
                batch[0].append(first)
                if not left:
                    batch[1].append(rid)
                    self.count -= 1
                    continue
                # the finish step, bucketed now: the running loop never checks a length
                steps = -(-left // chunk)
                last = left - (steps - 1) * chunk
                if pool is None:
                    self.running.setdefault(client, {})[rid] = [[rid, None], state, last]
                else:
                    reused = _logprobs(pool, 0, chunk, self.layout)  # its arrays are swapped in every step
                    self.running_logprobs.setdefault(client, {})[rid] = [[rid, None, reused], state, last, pool]
                self.finish_at.setdefault(step + steps, []).append((client, rid))
            self.fresh = []
        if kv is not None:
            for record in freeing:
                kv.free(record)
            kv.flush()
        stats = self._stats_if_due(now)
        for client, (outputs, finished) in batches.items():
            if not outputs and not finished:
                continue
            message = [self.rank, outputs, stats, now]
            if finished:
                message += [None, finished]
            self.outputs[client].send(pack(message))
            stats = None

    def _stats_if_due(self, now: float) -> Any:
        """outbox.StatsCadence's rule (no waiting queue, no KV usage here;
        prefix-cache counters not reported yet make them due)."""
        running = self.count
        if running and now - self._stats_at < STATS_INTERVAL_S:
            return None
        counts = (running, 0)
        pending = self.kv is not None and self.kv.requests
        if counts == self._stats_counts and not pending:
            return None
        self._stats_counts, self._stats_at = counts, now
        return scheduler_stats(running, 0, 0.0, self.step, prefix_cache_stats=self.kv.take_stats() if pending else None)


def _logprobs(pool: Any, position: int, n: int, layout: WireLayout) -> List[Any]:
    """new_logprobs of the n tokens from pool position `position` on."""
    stride, end = pool.stride, position + n
    ids, lps, ranks = pool.row_ids[position * stride : end * stride], pool.row_lps[position * stride : end * stride], pool.row_ranks[position * 8 : end * 8]
    return logprobs_lists(n, pool.k + 1, ids, lps, ranks, layout)


pack = msgpack.Packer(use_bin_type=True).pack
