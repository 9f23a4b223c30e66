"""A prefix cache of KV blocks, as vLLM's block pool: hits skip prefill work. Pure.

vLLM: `vllm/v1/core/block_pool.py`. A request's full blocks of `block_size`
tokens are hashed in a chain (each hash covers the block and everything
before it), so a hit means the whole prefix up to that block was seen.

The model keeps physical blocks, as vLLM does, because the KV events a
router reads (docs/protocol.md Appendix D) must say exactly what is cached:

* a running request holds its blocks (`Request.kv_blocks`); a hit *touches*
  the cached blocks of its prefix (shared: `ref` + 1) instead of taking new
  ones;
* a block gets its hash when it is full and its KV computed (`cache`: the
  prompt's blocks as they are prefilled, then the generated tokens' blocks
  as they are computed, vLLM's `cache_full_blocks`): one `BlockStored`
  event per request and step, chained to the block before it;
* a freed block keeps its hash and waits in an LRU of evictable blocks
  (tail blocks of a request first, as vLLM frees them in reverse); a new
  block is taken from the never-cached free blocks first and otherwise by
  evicting the least recently freed one: a `BlockRemoved` event for it;
* `reset` forgets every hash (`AllBlocksCleared`), refused while a running
  request holds blocks, as vLLM's `reset_prefix_cache`.

Capacity is `--num-gpu-blocks`. When blocks are not enforced (no
`--num-gpu-blocks` given) the scheduler never waits for blocks, so the pool
may hold more than its capacity; it then evicts whatever is evictable.

Events are plain tuples (`STORED`, `REMOVED`, `CLEARED` first), collected
only when `events` is on and taken once per step by the engine; their wire
form is kv/events.py's business. `admit` records the request for the next
SchedulerStats' `prefix_cache_stats` (per-interval deltas, §7.1).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Dict, List, Optional, Sequence, Tuple

from gmock_engine.kv.events import CLEARED, REMOVED, STORED

#: Hashes are unsigned 64-bit ints on the wire, as vLLM's default
#: (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1: the low 64 bits of the sha256).
HASH_MASK = (1 << 64) - 1


def block_hashes(token_ids: Sequence[int], block_size: int, previous: int = 0) -> Tuple[int, ...]:
    """Chained hashes of the full blocks of `token_ids`, the first chained to
    `previous` (0: the root). Ints hash the same in every process, so runs are
    reproducible; only the mock itself compares them (routers recompute their
    keys from the token ids, Appendix D)."""
    hashes = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        previous = block_hash(previous, token_ids[start : start + block_size])
        hashes.append(previous)
    return tuple(hashes)


def block_hash(parent: int, block_token_ids: Sequence[int]) -> int:
    """The hash of one full block chained to its parent's (0: the root)."""
    return hash((parent, tuple(block_token_ids))) & HASH_MASK


def mm_block_hashes(token_ids: Sequence[int], block_size: int, previous: int, features: Sequence[Any]
                    ) -> Tuple[Tuple[int, ...], List[Optional[Tuple[Any, ...]]]]:
    """`block_hashes` of a prompt with multimodal items, and the extra keys
    of each block the prompt reaches (its last, partial one too: generated
    tokens fill it) as BlockStored publishes them (None: none). A block that
    holds any of an item's placeholder tokens is hashed with ("mm",
    identifier, the item's offset from the block's start) for each such
    item, as vLLM's `_gen_mm_extra_hash_keys`; its event keys are the
    (identifier, offset) pairs (`to_event_extra_keys`). The placeholder ids
    are alike for every image, so the same text with another image shares
    only the blocks before that image."""
    hashes = []
    extras: List[Optional[Tuple[Any, ...]]] = []
    for start in range(0, len(token_ids), block_size):
        end = start + block_size
        keys = tuple((f.identifier, f.offset - start) for f in features if f.offset < end and f.offset + f.length > start)
        extras.append(keys or None)
        if end <= len(token_ids):
            previous = keyed_block_hash(previous, token_ids[start:end], extras[-1])
            hashes.append(previous)
    return tuple(hashes), extras


def keyed_block_hash(parent: int, block_token_ids: Sequence[int], keys: Optional[Tuple[Any, ...]]) -> int:
    """`block_hash` with a block's image keys ((identifier, offset) pairs, None: none)."""
    if not keys:
        return block_hash(parent, block_token_ids)
    return hash((parent, tuple(block_token_ids), tuple(("mm", *pair) for pair in keys))) & HASH_MASK


class Block:
    """One physical KV block: its hash once cached, and how many running
    requests hold it."""

    __slots__ = ("hash", "ref")

    def __init__(self) -> None:
        self.hash: Optional[int] = None
        self.ref = 0


class PrefixCache:
    """The block pool: cached blocks by hash, the LRU of evictable ones, hit
    and query counters since the last report, and the KV events not taken yet."""

    def __init__(self, capacity: int, block_size: int, events: bool = False) -> None:
        self.capacity = max(1, capacity)
        self.block_size = block_size
        #: hash -> the physical blocks holding it (two requests may compute
        #: the same block, as in vLLM's BlockHashToBlockMap)
        self._cached: Dict[int, List[Block]] = {}
        #: cached blocks no request holds, least recently freed first
        self._evictable: "OrderedDict[Block, None]" = OrderedDict()
        #: physical blocks held by running requests
        self.held = 0
        self._requests = self._queries = self._hits = 0
        self._preempted_requests = self._preempted_queries = self._preempted_hits = 0
        self._reset = False
        #: KV events since the last `take_events` (None: events are off, nothing is kept)
        self.events: Optional[List[Tuple[Any, ...]]] = [] if events else None

    def __len__(self) -> int:
        """Distinct block hashes cached."""
        return len(self._cached)

    def cached_hashes(self) -> List[int]:
        """Every hash cached now (tests compare it with what the events say)."""
        return list(self._cached)

    # -- requests --------------------------------------------------------------

    def track(self, request: Any, token_ids: Optional[Sequence[int]]) -> None:
        """A new request's tokens and prompt hashes (no prompt ids: never cached)."""
        if token_ids is None:
            return
        request.all_token_ids = list(token_ids)
        # vLLM hashes a LoRA request's blocks with its adapter's name as an
        # extra key (kv_cache_utils._gen_lora_extra_hash_keys): the same prompt
        # under another adapter shares no block. A root per adapter does that.
        lora = getattr(request, "lora_request", None)
        root = 0 if lora is None else hash(("lora", lora.lora_name)) & HASH_MASK
        features = getattr(request, "mm_features", ())
        if features:
            hashes, request.block_extra_keys = mm_block_hashes(token_ids, self.block_size, root, features)
            request.block_hashes = list(hashes)
        else:
            request.block_hashes = list(block_hashes(token_ids, self.block_size, root))

    def admit(self, request: Any, resumed: bool = False) -> int:
        """A request joins the running batch (`resumed`: back after a
        preemption): touch the cached blocks of its longest cached prefix and
        return the tokens they hold (never the whole of its tokens: at least
        one is computed, as in vLLM)."""
        hashes = request.block_hashes
        limit = min(len(hashes), (request.num_tokens - 1) // self.block_size)
        hits: List[Block] = []
        cached, evictable = self._cached, self._evictable
        for index in range(limit):
            blocks = cached.get(hashes[index])
            if not blocks:
                break
            hits.append(blocks[0])
        for block in hits:
            if block.ref == 0:
                del evictable[block]
                self.held += 1
            block.ref += 1
        request.kv_blocks = hits
        request.num_cached_blocks = len(hits)
        hit_tokens = len(hits) * self.block_size
        if resumed:  # §7.1 preempted_*: vLLM counts any request preempted before, token or not
            self._preempted_requests += 1
            self._preempted_queries += request.num_tokens
            self._preempted_hits += hit_tokens
        else:
            self._requests += 1
            self._queries += request.prompt_len
            self._hits += hit_tokens
        return hit_tokens

    def ensure(self, request: Any, blocks: int) -> None:
        """The request holds at least `blocks` blocks (new ones evict when needed)."""
        held = request.kv_blocks
        while len(held) < blocks:
            held.append(self._new_block())

    def _new_block(self) -> Block:
        if self.held + len(self._evictable) >= self.capacity and self._evictable:
            block, _ = self._evictable.popitem(last=False)
            self._evict(block)
        else:
            block = Block()
        block.ref = 1
        self.held += 1
        return block

    def _evict(self, block: Block) -> None:
        """vLLM's _maybe_evict_cached_block: the hash goes, one BlockRemoved."""
        value = block.hash
        block.hash = None
        blocks = self._cached[value]
        blocks.remove(block)
        if not blocks:
            del self._cached[value]
        if self.events is not None:
            self.events.append((REMOVED, [value]))

    def cache(self, request: Any, computed_tokens: int) -> None:
        """The request's KV now covers `computed_tokens` tokens: its blocks
        that became full get their hashes (vLLM's cache_full_blocks), one
        BlockStored for them, its parent the block before."""
        size = self.block_size
        start = request.num_cached_blocks
        full = min(computed_tokens // size, len(request.kv_blocks), len(request.all_token_ids) // size)
        if full <= start:
            return
        hashes = request.block_hashes
        if full == start + 1 and len(hashes) == start:
            self._cache_generated_block(request, start)
            return
        if len(hashes) < full:  # the generated tokens' blocks
            first = len(hashes)
            extra = getattr(request, "block_extra_keys", None)
            if extra is not None and first < len(extra) and extra[first] is not None:
                # the prompt's last block, filled by generated tokens, holds an image's placeholders
                ids = request.all_token_ids
                hashes.append(keyed_block_hash(hashes[-1] if hashes else 0, ids[first * size : (first + 1) * size], extra[first]))
                first += 1
            hashes.extend(block_hashes(request.all_token_ids[first * size : full * size], size, hashes[-1] if hashes else 0))
        cached = self._cached
        blocks = request.kv_blocks
        for index in range(start, full):
            block = blocks[index]
            block.hash = hashes[index]
            cached.setdefault(block.hash, []).append(block)
        request.num_cached_blocks = full
        if self.events is not None:
            parent = hashes[start - 1] if start else None
            self._stored(request, hashes[start:full], parent, request.all_token_ids[start * size : full * size], start)

    def _cache_generated_block(self, request: Any, index: int) -> None:
        """`cache` for the case of every decode step that fills a block: one
        block of generated tokens, not hashed yet. The same result (the
        tests hold it to the general path's) at half the work: one slice of
        the ids for the hash and the event (with caching on, caching the
        blocks is a large part of a step)."""
        hashes = request.block_hashes
        size = self.block_size
        tokens = request.all_token_ids[index * size : (index + 1) * size]
        parent = hashes[index - 1] if index else None
        extra = getattr(request, "block_extra_keys", None)
        if extra is not None and index < len(extra):
            value = keyed_block_hash(parent or 0, tokens, extra[index])  # the prompt's last block may hold an image
        else:
            value = block_hash(parent or 0, tokens)
        hashes.append(value)
        block = request.kv_blocks[index]
        block.hash = value
        self._cached.setdefault(value, []).append(block)
        request.num_cached_blocks = index + 1
        if self.events is not None:
            self._stored(request, [value], parent, tokens, index)

    def _stored(self, request: Any, hashes: List[int], parent: Optional[int], tokens: List[int], first: int = 0) -> None:
        """One BlockStored for blocks `cache` just hashed (events on), the
        first of them block `first` of the request: with the blocks' extra
        keys when an image's placeholders are in any of them."""
        lora = getattr(request, "lora_request", None)
        extra = getattr(request, "block_extra_keys", None)
        if extra is not None:
            keys = list(extra[first : first + len(hashes)])
            if any(key is not None for key in keys):
                keys += [None] * (len(hashes) - len(keys))  # generated blocks past the prompt: none
                self.events.append((STORED, hashes, parent, tokens, lora and lora.lora_int_id, lora and lora.lora_name, keys))  # type: ignore[union-attr]
                return
        if lora is None:
            self.events.append((STORED, hashes, parent, tokens))  # type: ignore[union-attr]
        else:  # BlockStored's lora_id / lora_name (Appendix D)
            self.events.append((STORED, hashes, parent, tokens, lora.lora_int_id, lora.lora_name))  # type: ignore[union-attr]

    def free(self, request: Any) -> None:
        """The request left the batch: its blocks are released, the tail
        first (vLLM frees in reverse, so the prefix is evicted last); cached
        ones become evictable, the others are free."""
        evictable = self._evictable
        for block in reversed(request.kv_blocks or ()):
            block.ref -= 1
            if block.ref == 0:
                self.held -= 1
                if block.hash is not None:
                    evictable[block] = None
        request.kv_blocks = None
        request.num_cached_blocks = 0

    # -- the whole cache -------------------------------------------------------

    def reset(self) -> bool:
        """reset_prefix_cache: forget every block and say AllBlocksCleared;
        refused (False, nothing changes) while running requests hold blocks,
        as vLLM's BlockPool.reset_prefix_cache."""
        if self.held:
            return False
        self._cached.clear()
        for block in self._evictable:
            block.hash = None
        self._evictable.clear()
        self._reset = True
        if self.events is not None:
            self.events.append((CLEARED,))
        return True

    def take_events(self) -> List[Tuple[Any, ...]]:
        """The events since the last call, in order (then none are kept)."""
        events = self.events
        if not events:
            return []
        self.events = []
        return events

    @property
    def pending(self) -> bool:
        """Counters not reported yet (the next SchedulerStats must carry them)."""
        return bool(self._requests or self._preempted_requests or self._reset)

    def take_stats(self) -> Dict[str, object]:
        """The prefix_cache_stats map since the last call (then zeroed)."""
        stats = {
            "reset": self._reset,
            "requests": self._requests,
            "queries": self._queries,
            "hits": self._hits,
            "preempted_requests": self._preempted_requests,
            "preempted_queries": self._preempted_queries,
            "preempted_hits": self._preempted_hits,
        }
        self._requests = self._queries = self._hits = 0
        self._preempted_requests = self._preempted_queries = self._preempted_hits = 0
        self._reset = False
        return stats
