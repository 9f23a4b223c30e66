"""The reference emitter's prefix caching and KV events (`--prefix-caching`,
`--kv-events-config`): vLLM's block pool at the least cost there is, a
request looked at only in the steps where one of its blocks becomes full or
it needs a new one. The script and what it is for: reference_emitter.py.
§ sections: docs/protocol.md.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, Dict, List, Optional

from gmock_engine.content.tokens import RandomTokens
from gmock_engine.core.prefix_cache import block_hash, block_hashes
from gmock_engine.kv import events as kv_events
from gmock_engine.wire.eras import DEFAULT_PROTOCOL_VERSION, layout_for_version

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
