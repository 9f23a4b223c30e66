"""A prefix cache of prompt blocks, as vLLM's: hits skip prefill work.

Pure. A prompt's full blocks of `block_size` tokens are hashed in a chain
(each hash covers the block and everything before it), so a hit means the
whole prefix up to that block was seen. The cache keeps the most recently
used `capacity` block hashes. `admit(hashes, prompt_len)` returns how many
prompt tokens are cached (never the whole prompt: at least one token is
computed, as in vLLM) and records the request for the next SchedulerStats'
`prefix_cache_stats` (per-interval deltas, §7.1).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Dict, Sequence, Tuple


def block_hashes(prompt_token_ids: Sequence[int], block_size: int) -> Tuple[int, ...]:
    """Chained hashes of the prompt's full blocks (ints hash the same in
    every process, so runs are reproducible)."""
    hashes, previous = [], 0
    for start in range(0, len(prompt_token_ids) - block_size + 1, block_size):
        previous = hash((previous, tuple(prompt_token_ids[start : start + block_size])))
        hashes.append(previous)
    return tuple(hashes)


class PrefixCache:
    """LRU of block hashes with hit/query counters since the last report."""

    def __init__(self, capacity: int, block_size: int) -> None:
        self.capacity = max(1, capacity)
        self.block_size = block_size
        self._blocks: "OrderedDict[int, None]" = OrderedDict()
        self._requests = self._queries = self._hits = 0
        self._reset = False

    def __len__(self) -> int:
        return len(self._blocks)

    def admit(self, hashes: Sequence[int], prompt_len: int) -> int:
        """Cached prompt tokens of a request being scheduled; its blocks
        become the most recently used."""
        blocks = self._blocks
        hit_blocks = 0
        for value in hashes:
            if value not in blocks:
                break
            hit_blocks += 1
        for value in hashes:
            if value in blocks:
                blocks.move_to_end(value)
            else:
                blocks[value] = None
        while len(blocks) > self.capacity:
            blocks.popitem(last=False)
        cached = min(hit_blocks * self.block_size, max(0, prompt_len - 1))
        self._requests += 1
        self._queries += prompt_len
        self._hits += cached
        return cached

    @property
    def pending(self) -> bool:
        """Counters not reported yet (the next SchedulerStats must carry them)."""
        return bool(self._requests or self._reset)

    def reset(self) -> None:
        """reset_prefix_cache: forget every block."""
        self._blocks.clear()
        self._reset = True

    def take_stats(self) -> Dict[str, object]:
        """The prefix_cache_stats map since the last call (then zeroed)."""
        stats = {
            "reset": self._reset,
            "requests": self._requests,
            "queries": self._queries,
            "hits": self._hits,
            "preempted_requests": 0,
            "preempted_queries": 0,
            "preempted_hits": 0,
        }
        self._requests = self._queries = self._hits = 0
        self._reset = False
        return stats
