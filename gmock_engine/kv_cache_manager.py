"""KV blocks: pure (vLLM: `vllm/v1/core/kv_cache_manager.py`).

A running request holds ceil(tokens / block_size) blocks. With the blocks
enforced (`--num-gpu-blocks` given) the scheduler asks here whether a
request fits before it admits or grows it; otherwise blocks are only
reported and the usage the frontends show is the running requests' tokens
against the reported capacity. The prefix cache (prefix_cache.py) sits
behind the manager: admission asks it how many prompt tokens are cached.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Sequence

from .prefix_cache import PrefixCache, block_hashes
from .request import Request


class KVCacheManager:
    """Blocks used by the running requests, and the prefix cache."""

    def __init__(self, num_gpu_blocks: int, block_size: int, enforced_blocks: Optional[int], prefix_caching: bool) -> None:
        self.block_size = block_size
        #: Blocks enforced (None: only reported, never a reason to wait).
        self.num_blocks = enforced_blocks
        self.used_blocks = 0
        #: Σ (prompt + output tokens) of the running requests: the usage when
        #: blocks are not enforced.
        self.tokens = 0
        self._capacity = max(1, num_gpu_blocks * block_size)
        self.prefix_cache: Optional[PrefixCache] = (
            PrefixCache(enforced_blocks or num_gpu_blocks, block_size) if prefix_caching else None
        )

    @property
    def enforced(self) -> bool:
        return self.num_blocks is not None

    def blocks_for(self, tokens: int) -> int:
        """Blocks that hold `tokens` tokens."""
        return -(-tokens // self.block_size)

    def blocks_to_admit(self, request: Request, next_tokens: int) -> int:
        """Blocks a waiting request needs to join the batch: its prompt and
        what it already generated (recomputed after a preemption), plus its
        next tokens' slots, so that it is never preempted by its own first
        decode step (vLLM allocates the new tokens' slots at admission)."""
        return self.blocks_for(request.num_tokens + next_tokens)

    def blocks_to_grow(self, request: Request, next_tokens: int) -> int:
        """New blocks a running request needs for its next tokens."""
        return self.blocks_for(request.num_tokens + next_tokens) - request.blocks

    def fits(self, blocks: int) -> bool:
        return self.num_blocks is None or self.used_blocks + blocks <= self.num_blocks

    def allocate(self, request: Request, blocks: int) -> None:
        """Give `request` `blocks` more blocks (the caller checked they fit)."""
        request.blocks += blocks
        self.used_blocks += blocks

    def admit(self, request: Request) -> int:
        """A request joins the running batch: its tokens count towards the
        usage; returns the prompt tokens the prefix cache already holds."""
        self.tokens += request.num_tokens
        if self.prefix_cache is None:
            return 0
        return self.prefix_cache.admit(request.block_hashes, request.prompt_len)

    def free(self, request: Request) -> None:
        """A running request left the batch (finished, aborted, preempted)."""
        self.tokens -= request.num_tokens
        self.used_blocks -= request.blocks
        request.blocks = 0

    def free_all(self) -> None:
        self.tokens = self.used_blocks = 0

    def hash_prompt(self, prompt_token_ids: Optional[Sequence[int]]) -> tuple:
        """The prompt's chained block hashes, when prefix caching is on."""
        if self.prefix_cache is None or not prompt_token_ids:
            return ()
        return block_hashes(prompt_token_ids, self.block_size)

    @property
    def usage(self) -> float:
        """Blocks used / blocks when enforced, else tokens / capacity."""
        if self.num_blocks:
            return self.used_blocks / self.num_blocks
        return min(1.0, self.tokens / self._capacity)

    @property
    def stats_pending(self) -> bool:
        """Prefix-cache counters the next SchedulerStats must carry."""
        return self.prefix_cache is not None and self.prefix_cache.pending

    def take_prefix_cache_stats(self) -> Optional[Dict[str, Any]]:
        return self.prefix_cache.take_stats() if self.prefix_cache is not None else None

    def reset_prefix_cache(self) -> None:
        if self.prefix_cache is not None:
            self.prefix_cache.reset()
