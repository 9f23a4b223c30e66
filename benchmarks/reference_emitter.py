"""The reference emitter: the floor of a Python engine, in pyzmq + msgpack.

`gmock-engine bench` runs this beside gmock_engine under the same load and
reports gmock's CPU per token as a ratio to it. It is meant as the floor,
the least a Python engine has to spend to send the messages gmock sends,
so the ratio says how far gmock is from it. A yardstick, not a user
command: it lives beside the benchmarks, outside the package, and bench.py
runs it by path from the checkout (gmock_engine must be importable). It
sends:

* the same wire messages: the same token ids (content/tokens.py's pool, at the
  position gmock seeds per request), a first output carrying the QUEUED and
  SCHEDULED events and the prefill stats, a final output with
  finish_reason LENGTH and its id in finished_requests, SchedulerStats on the
  first message of a step when the counts moved (at most every 50 ms while
  requests run, at once when the engine goes idle), one EngineCoreOutputs
  per client per step. Only the order of the outputs inside one message
  differs (ended requests first);
* no more work than that: a request's finish step is known at its first
  step and bucketed, so the running loop never checks a length; each request
  keeps one `[request_id, tokens]` list, reused for every running output. A
  step is one loop that slices each request's next ids out of the pool
  (inline) and swaps them into each of those lists, then one `pack` and one
  `send` per client.
* logprobs (SamplingParams `logprobs`, k <= logprobs.ROW_POOL_MAX_K) the
  cheapest way there is to make them valid: the rows of the pool's
  positions drawn once (logprobs.RowPool, the blocks a request will read
  drawn at its ADD), and per token the three slices of them swapped into
  the request's reused LogprobsLists;
* prefix caching and KV events (`--prefix-caching`, `--kv-events-config`,
  as gmock's flags) the cheapest way there is to send the same events: a
  request's blocks are touched only when one of them becomes full or a new
  one is needed, at steps computed when it starts (bucketed as its finish
  step), so nothing is kept per token; a full block's tokens are sliced
  out of the prompt and the token pool, hashed once, and the step's events
  packed as vLLM's KVEventBatch and sent on a PUB (`FloorKV`);
* one thread, a blocking poll, no gevent, no queues, no validation, no
  logging, no token budget, KV blocks enforced or latency model, no replay
  of KV events. Bad input crashes it.

Paced (`--itl-ms`, as gmock's flag) every engine steps at that interval,
counted from the actual start of the step before (a step that starts late
does not make the next one come sooner), the first step after idle at once;
it sleeps in its poll until then, woken by a timerfd at the deadline (as
gmock's runtime/steptimer.py), and keeps the step lateness for `gmock_stats`.

It answers get_supported_tasks with ["generate"], gmock_stats with the step
lateness (`step_lateness_us`, the window restarted by gmock_stats(True), as
gmock's), every other utility call with nil, and an ABORT with an ABORT
output.

    python benchmarks/reference_emitter.py --handshake-address tcp://127.0.0.1:29550 \\
        [--engine-count N] [--output-token-chunk-size K] [--vocab-size V] [--seed S] \\
        [--itl-ms MS] [--prefix-caching] [--kv-events-config JSON] [--num-gpu-blocks B] [--block-size S]

§N: section N of docs/protocol.md.
"""

from __future__ import annotations

import argparse
import gc
import math
import signal
import sys
import time
from collections import OrderedDict
from typing import Any, Callable, Dict, List, Optional

import msgpack
import zmq

from gmock_engine.kv import events as kv_events
from gmock_engine.wire.eras import DEFAULT_PROTOCOL_VERSION, layout_for_version, WireLayout  # noqa: E402
from gmock_engine.wire.outputs import engine_core_event, engine_core_output, logprobs_lists, prefill_stats, scheduler_stats  # noqa: E402
from gmock_engine.wire.types import EngineCoreEventType, FinishReason  # noqa: E402
from gmock_engine.content.logprobs import LogprobModel
from gmock_engine.core.outbox import STATS_INTERVAL_S
from gmock_engine.core.prefix_cache import block_hash, block_hashes
from gmock_engine.utils.stats import Samples
from gmock_engine.runtime.steptimer import TimerFD
from gmock_engine.content.tokens import POOL_PAD, RandomTokens

#: EngineCoreRequest fields read here (the 0.33 layout the bench driver sends).
_PROMPT, _SAMPLING, _CLIENT = 1, 3, 11
#: KV events as the floor's era (the layout it speaks: wire.eras.DEFAULT_PROTOCOL_VERSION) encodes them
_EVENT_FORMAT = kv_events.EventFormat.of(layout_for_version(DEFAULT_PROTOCOL_VERSION))


class _Block:
    """One physical KV block: its hash once it is full and computed, and how
    many running requests hold it."""

    __slots__ = ("hash", "ref")

    def __init__(self) -> None:
        self.hash: Optional[int] = None
        self.ref = 1


class FloorKV:
    """Prefix caching and KV events at the floor (`--prefix-caching`).

    The job is vLLM's block pool (docs/protocol.md Appendix D): cached blocks by
    hash, an LRU of the evictable ones, and for each running request its
    blocks, hashed as they fill, with one BlockStored per request and step
    for the blocks that became full, one BlockRemoved per evicted block.
    The cheapest way to do it: nothing per token. A request's record is
    [blocks, hashes, prompt, pool position, max_tokens, first step, steps];
    the steps at which a block of it becomes full (its KV computed: the step
    after its last token went out) or it needs a new block are computed from
    its length and the chunk, and it is looked at in those steps only
    (`at`, as the finish buckets). A full block's tokens are sliced out of
    its prompt and the token pool at its position, which is where its
    output came from. The events are made as vLLM encodes them
    (kv_events.block_stored / block_removed, 0.33: tagged maps) and sent as one KVEventBatch per step (`publish`); none
    are kept when nothing publishes them.
    """

    def __init__(self, capacity: int, block_size: int, tokens: RandomTokens, chunk: int, publish: Optional[Callable[[List[Any]], None]]) -> None:
        self.capacity = capacity
        self.block_size = block_size
        self.ids, self.pool_size = tokens.ids, tokens.size
        self.chunk = chunk
        #: hash -> the physical blocks holding it
        self.cached: Dict[int, List[_Block]] = {}
        #: cached blocks no request holds, least recently freed first
        self.evictable: "OrderedDict[_Block, None]" = OrderedDict()
        self.held = 0
        #: step -> records with block work at that step
        self.at: Dict[int, List[List[Any]]] = {}
        self.publish = publish
        self.events: Optional[List[Any]] = [] if publish is not None else None
        #: prefix_cache_stats since the last SchedulerStats
        self.requests = self.queries = self.hits = 0

    def start(self, prompt: List[int], n: int, position: int, step: int) -> "tuple[List[Any], int]":
        """A request's first step (its admission and first output): the
        cached blocks of its prompt touched, its prompt's other full blocks
        stored, blocks for its first tokens. Returns its record and the
        prompt tokens that were cached."""
        size, cached = self.block_size, self.cached
        full = len(prompt) // size
        hashes = list(block_hashes(prompt, size))
        blocks: List[_Block] = []
        for value in hashes[: (len(prompt) - 1) // size]:  # never the whole prompt: one token is computed
            holders = cached.get(value)
            if not holders:
                break
            block = holders[0]
            if block.ref == 0:
                del self.evictable[block]
                self.held += 1
            block.ref += 1
            blocks.append(block)
        hit = len(blocks)
        self.requests += 1
        self.queries += len(prompt)
        self.hits += hit * size
        record = [blocks, hashes, prompt, position, n, step, -(-n // self.chunk)]
        first = self.chunk if self.chunk < n else n
        self._grow(blocks, -(-(len(prompt) + first) // size))
        for j in range(hit, full):
            block = blocks[j]
            block.hash = hashes[j]
            cached.setdefault(hashes[j], []).append(block)
        if full > hit and self.events is not None:
            self._stored(hashes[hit:full], hashes[hit - 1] if hit else None, prompt[hit * size : full * size])
        self._schedule(record, 1)
        return record, hit * size

    def step(self, step: int) -> None:
        """The block work of this step's records: blocks that became full
        stored, new blocks taken."""
        records = self.at.pop(step, None)
        if not records:
            return
        size, chunk = self.block_size, self.chunk
        for record in records:
            blocks, hashes, prompt, _, n, first = record[:6]
            if blocks is None:
                continue  # aborted
            k = step - first + 1
            prompt_len = len(prompt)
            full = (prompt_len + min((k - 1) * chunk, n)) // size
            if full > len(hashes):
                self._cache(record, full)
            self._grow(blocks, -(-(prompt_len + min(k * chunk, n)) // size))
            self._schedule(record, k)

    def free(self, record: List[Any]) -> None:
        """The request left (finished, aborted): its blocks released, the
        tail first; cached ones become evictable."""
        blocks = record[0]
        record[0] = None
        evictable = self.evictable
        for block in reversed(blocks):
            block.ref -= 1
            if block.ref == 0:
                self.held -= 1
                if block.hash is not None:
                    evictable[block] = None

    def flush(self) -> None:
        """This step's events, if any, out as one batch."""
        if self.events:
            self.publish(self.events)  # type: ignore[misc]
            self.events = []

    def take_stats(self) -> Optional[Dict[str, Any]]:
        """prefix_cache_stats since the last call (None: nothing moved)."""
        if not self.requests:
            return None
        stats = {"reset": False, "requests": self.requests, "queries": self.queries, "hits": self.hits,
                 "preempted_requests": 0, "preempted_queries": 0, "preempted_hits": 0}  # fmt: skip
        self.requests = self.queries = self.hits = 0
        return stats

    def _schedule(self, record: List[Any], k: int) -> None:
        """File the record under its next step with block work after its
        step k, if it has one before its last."""
        blocks, hashes, prompt, _, n, first, steps = record
        size, chunk, prompt_len = self.block_size, self.chunk, len(prompt)
        after = steps + 1
        # the next block full: its last token's KV is computed in the step after it went out
        need = size * (len(hashes) + 1) - prompt_len
        if need <= n:
            after = 1 - (-need // chunk)
        # the next block needed: the first step whose tokens do not fit
        room = size * len(blocks) - prompt_len
        if room < n:
            grow = room // chunk + 1
            if grow < after:
                after = grow
        if after <= steps:
            bucket = self.at.get(first + after - 1)
            if bucket is None:
                self.at[first + after - 1] = [record]
            else:
                bucket.append(record)

    def _cache(self, record: List[Any], full: int) -> None:
        """Hash the request's blocks up to `full` (generated tokens: sliced
        out of the pool at the request's position) and store them."""
        blocks, hashes, prompt, position = record[:4]
        size, ids, pool_size, cached = self.block_size, self.ids, self.pool_size, self.cached
        start = len(hashes)
        prompt_len = len(prompt)
        parent = hashes[-1] if hashes else 0
        tokens: List[int] = []
        for j in range(start, full):
            offset = j * size - prompt_len  # the block's first token, as an output index
            if offset >= 0:
                at = (position + offset) % pool_size
                block_tokens = ids[at : at + size]  # the pool is padded: no wrap inside a block
            else:
                block_tokens = prompt[j * size :] + ids[position : position + size + offset]
            parent = block_hash(parent, block_tokens)
            hashes.append(parent)
            block = blocks[j]
            block.hash = parent
            holders = cached.get(parent)
            if holders is None:
                cached[parent] = [block]
            else:
                holders.append(block)
            tokens += block_tokens
        if self.events is not None:
            self._stored(hashes[start:full], hashes[start - 1] if start else None, tokens)

    def _grow(self, blocks: List[_Block], count: int) -> None:
        """New blocks until there are `count`: never-cached ones while the
        pool has room, else the least recently freed cached one (evicted)."""
        while len(blocks) < count:
            if self.held + len(self.evictable) >= self.capacity and self.evictable:
                block, _ = self.evictable.popitem(last=False)
                value = block.hash
                holders = self.cached[value]
                holders.remove(block)
                if not holders:
                    del self.cached[value]
                block.hash = None
                block.ref = 1
                if self.events is not None:
                    self.events.append(kv_events.block_removed([value], _EVENT_FORMAT))
            else:
                block = _Block()
            self.held += 1
            blocks.append(block)

    def _stored(self, hashes: List[int], parent: Optional[int], tokens: List[int]) -> None:
        self.events.append(kv_events.block_stored(hashes, parent, tokens, self.block_size, _EVENT_FORMAT))  # type: ignore[union-attr]


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

#: The young-generation threshold of gmock's entry point (cli.GC_THRESHOLD, a
#: test holds them equal; not imported: cli imports gevent, which the floor
#: does without).
GC_THRESHOLD = 100_000


def _publisher(pub: Any, topic: bytes, rank: int) -> Callable[[List[Any]], None]:
    """A step's KV events out on the PUB as vLLM's KVEventBatch
    [ts, events, data_parallel_rank], under the next seq (8 bytes big-endian)."""
    seq = 0

    def publish(events: List[Any]) -> None:
        nonlocal seq
        pub.send_multipart((topic, kv_events.seq_bytes(seq), pack(kv_events.batch_payload(time.time(), events, rank))), zmq.NOBLOCK)
        seq += 1

    return publish


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="reference_emitter.py")
    parser.add_argument("--handshake-address", default="tcp://127.0.0.1:29550")
    parser.add_argument("--engine-count", type=int, default=1)
    parser.add_argument("--data-parallel-start-rank", type=int, default=0)
    parser.add_argument("--output-token-chunk-size", type=int, default=1)
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--seed", type=int, default=0)
    # gmock's flags of the same names (bench.py passes them to both)
    parser.add_argument("--itl-ms", type=float, default=0.0)
    parser.add_argument("--prefix-caching", action="store_true")
    parser.add_argument("--kv-events-config", type=kv_events.parse_config, default=None, metavar="JSON")
    parser.add_argument("--num-gpu-blocks", type=int, default=65536)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args(argv)
    events = args.kv_events_config if args.kv_events_config is not None and args.kv_events_config.enabled else None
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    # As gmock's entry point (runtime/cli.py): the cyclic GC runs rarely. A step's
    # lists are acyclic and freed by reference counting; with the default
    # thresholds the collector walks every live request and block again and
    # again, which no engine needs to pay.
    gc.freeze()
    gc.set_threshold(GC_THRESHOLD, 50, 100)

    ctx = zmq.Context()
    layout = layout_for_version(DEFAULT_PROTOCOL_VERSION)
    engines: List[Engine] = []
    poller = zmq.Poller()
    for rank in range(args.data_parallel_start_rank, args.data_parallel_start_rank + args.engine_count):
        identity = rank.to_bytes(2, "little")
        hs = ctx.socket(zmq.DEALER)
        hs.setsockopt(zmq.IDENTITY, identity)
        hs.connect(args.handshake_address)
        hs.send(pack({"status": "HELLO", "local": False, "headless": True}))
        addresses = msgpack.unpackb(hs.recv())["addresses"]
        ready = {
            "max_model_len": 1048576, "num_gpu_blocks": args.num_gpu_blocks, "block_size": args.block_size, "dp_stats_address": None,
            "dtype": "bfloat16", "vllm_version": "0.33.0", "world_size": 1, "data_parallel_size": args.engine_count,
            "tensor_parallel_size": 1, "pipeline_parallel_size": 1, "decode_context_parallel_size": 1,
            "data_parallel_rank": rank, "max_num_seqs": 256, "max_num_batched_tokens": 8192,
            "instance_id": f"reference-{rank}", "supports_lora": False, "max_loras": 0,
        }  # fmt: skip
        tokens = RandomTokens(args.vocab_size, args.seed, rank)
        kv = None
        if args.prefix_caching:
            publish = None
            if events is not None:
                pub = ctx.socket(zmq.PUB)
                mine = events.for_rank(rank)  # vLLM's offset_endpoint_port: the rank's port
                pub.bind(mine.endpoint)
                publish = _publisher(pub, mine.topic.encode(), rank)
            kv = FloorKV(args.num_gpu_blocks, args.block_size, tokens, args.output_token_chunk_size, publish)
        engine = Engine(rank, args.output_token_chunk_size, tokens, layout, kv)
        for address in addresses["inputs"]:
            dealer = ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.IDENTITY, identity)
            dealer.connect(address)
            dealer.send(pack(ready))
            poller.register(dealer, zmq.POLLIN)
            engine.inputs.append(dealer)
        for address in addresses["outputs"]:
            push = ctx.socket(zmq.PUSH)
            push.connect(address)
            engine.outputs.append(push)
        hs.send(pack({"status": "READY", "local": False, "headless": True, "num_gpu_blocks": args.num_gpu_blocks}))
        engines.append(engine)
    owner = {sock: e for e in engines for sock in e.inputs}

    lateness = Samples()
    take = _input_handler(owner, lateness)
    if args.itl_ms > 0:
        _serve_paced(engines, poller, take, args.itl_ms / 1e3, lateness)
    while True:
        busy = any(e.busy for e in engines)
        for sock, _ in poller.poll(0 if busy else None):
            take(sock)
        for engine in engines:
            if engine.busy:
                engine.run_step()


def _input_handler(owner: Dict[Any, Engine], lateness: Samples) -> Callable[[Any], None]:
    """What to do with a readable input socket: every message it holds."""

    def take(sock: Any) -> None:
        engine = owner[sock]
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            kind, body = frames[0], msgpack.unpackb(frames[1], strict_map_key=False)
            if kind == b"\x00":
                engine.add(body)
            elif kind == b"\x01":
                for rid in body:
                    engine.abort(rid)
            elif kind == b"\x03":
                client, call_id, method = body[0], body[1], body[2]
                # get_supported_tasks is the one answer a real frontend cannot do without
                result: Any = None
                if method == "get_supported_tasks":
                    result = ["generate"]
                elif method == "gmock_stats":  # the bench driver's step lateness, as gmock answers it
                    result = {"step_lateness_us": lateness.summary(scale=1e6)}
                    if body[3][:1] == [True]:
                        lateness.restart()
                reply = [engine.rank, [], None, time.monotonic(), [call_id, None, [None, result]]]
                engine.outputs[client].send(pack(reply))

    return take


def _serve_paced(engines: List[Engine], poller: Any, take: Callable[[Any], None], interval: float, lateness: Samples) -> None:
    """The loop with --itl-ms: a step of every busy engine each `interval`
    from the start of the one before; none while idle (then the next work
    steps at once). Never returns."""
    timer = TimerFD.create()
    timer_fd = None
    if timer is not None:
        timer_fd = timer.fileno()
        poller.register(timer_fd, zmq.POLLIN)
    due: Optional[float] = None
    while True:
        busy = any(e.busy for e in engines)
        if not busy:
            due, timeout = None, None
        elif due is None:
            timeout = 0
        else:
            wait = due - time.monotonic()
            # the timerfd (armed at `due`) wakes the poll; without one, whole milliseconds
            timeout = 0 if wait <= 0 else (None if timer is not None else math.ceil(wait * 1e3))
        for sock, _ in poller.poll(timeout):
            if sock == timer_fd:
                timer.consume()  # type: ignore[union-attr]
            else:
                take(sock)
        started = time.monotonic()
        if due is not None and started < due:
            continue
        stepped = False
        for engine in engines:
            if engine.busy:
                if due is not None:  # each engine's own: the ones after the first wait for it, as gmock's engines of one process
                    lateness.add(time.monotonic() - due)
                engine.run_step()
                stepped = True
        if stepped:
            due = started + interval
            if timer is not None:
                timer.arm(due)


if __name__ == "__main__":
    sys.exit(main())
