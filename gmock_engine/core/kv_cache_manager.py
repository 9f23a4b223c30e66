"""KV blocks: pure (vLLM: `vllm/v1/core/kv_cache_manager.py`).

A running request holds ceil(tokens / block_size) blocks. With the blocks
enforced (`--num-gpu-blocks` given) the scheduler asks here whether a
request fits before it admits or grows it; otherwise blocks are only
reported and the usage the frontends show is the running requests' tokens
against the reported capacity. The prefix cache (prefix_cache.py) sits
behind the manager: admission asks it how many prompt tokens are cached,
and the scheduler tells it as a request's tokens are computed (prefill
chunks, then each step's generated tokens), so that full blocks are cached
as vLLM's `allocate_slots` -> `cache_blocks` does. With KV events on
(`--kv-events-config`) the cache records what it stores, evicts and
clears; the engine takes those events once per step (`take_events`).
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from gmock_engine.core.prefix_cache import PrefixCache
from gmock_engine.core.request import Request


class KVCacheManager:
    """Blocks used by the running requests, and the prefix cache."""

    def __init__(
        self, num_gpu_blocks: int, block_size: int, enforced_blocks: Optional[int], prefix_caching: bool, kv_events: bool = False
    ) -> None:
        self.block_size = block_size
        #: Blocks enforced (None: only reported, never a reason to wait).
        self.num_blocks = enforced_blocks
        #: num_blocks is not None (read every step)
        self.enforced = enforced_blocks is not None
        self.used_blocks = 0
        #: Σ (prompt + output tokens) of the running requests: the usage when
        #: blocks are not enforced.
        self.tokens = 0
        self._capacity = max(1, num_gpu_blocks * block_size)
        self.prefix_cache: Optional[PrefixCache] = (
            PrefixCache(enforced_blocks or num_gpu_blocks, block_size, kv_events) if prefix_caching else None
        )
        #: The scheduler reports computed tokens (`computed`, `on_output`) only when True.
        self.caching = self.prefix_cache is not None

    def blocks_for(self, tokens: int) -> int:
        """Blocks that hold `tokens` tokens."""
        return -(-tokens // self.block_size)

    def blocks_to_admit(self, request: Request) -> int:
        """Blocks a waiting request needs to join the batch: its prompt and
        what it already generated (recomputed after a preemption). vLLM
        admits a request only if its whole sequence fits
        (`allocate_slots(full_sequence_must_fit=...)`, on by default:
        `scheduler_reserve_full_isl`), and takes the slot of its first
        decode at the step that computes it."""
        return self.blocks_for(request.num_tokens)

    def blocks_to_grow(self, request: Request, next_tokens: int) -> int:
        """New blocks a running request needs for its next tokens."""
        return self.blocks_for(request.num_tokens + next_tokens) - request.blocks

    def fits(self, blocks: int) -> bool:
        return self.num_blocks is None or self.used_blocks + blocks <= self.num_blocks

    def allocate(self, request: Request, blocks: int) -> None:
        """Give `request` `blocks` more blocks (the caller checked they fit)."""
        request.blocks += blocks
        self.used_blocks += blocks
        if request.kv_blocks is not None and self.prefix_cache is not None:  # running: its new blocks now
            self.prefix_cache.ensure(request, request.blocks)

    def admit(self, request: Request, resumed: bool = False) -> int:
        """A request joins the running batch (`resumed`: back after a
        preemption): its tokens count towards the usage; returns the tokens
        the prefix cache already holds (the blocks allocated before
        admission are taken here, after the hit blocks)."""
        self.tokens += request.num_tokens
        cache = self.prefix_cache
        if cache is None or request.all_token_ids is None:
            return 0
        cached = cache.admit(request, resumed)
        cache.ensure(request, max(request.blocks, self.blocks_for(request.num_tokens)))
        return cached

    def computed(self, request: Request, tokens: int) -> None:
        """The request's KV covers its first `tokens` tokens (a prefill or a
        chunk of it was scheduled): its full blocks are cached."""
        if request.kv_blocks is not None:
            self.prefix_cache.cache(request, tokens)  # type: ignore[union-attr]

    def on_output(self, request: Request, token_ids: List[int]) -> None:
        """A step emitted `token_ids` for the request: its KV now covers every
        token before them (a decode step computes the last sampled token), and
        they join its token ids. Only called when `caching`; this is the
        per-token path, so the pool is asked only at block boundaries."""
        blocks = request.kv_blocks
        if blocks is None:
            return
        all_token_ids = request.all_token_ids
        computed = len(all_token_ids)  # type: ignore[arg-type]
        size = self.block_size
        if computed // size > request.num_cached_blocks:
            self.prefix_cache.cache(request, computed)  # type: ignore[union-attr]
        all_token_ids += token_ids  # type: ignore[operator]
        if self.num_blocks is None and len(blocks) * size < computed + len(token_ids):
            # not enforced: nobody allocated the new slots
            self.prefix_cache.ensure(request, self.blocks_for(computed + len(token_ids)))  # type: ignore[union-attr]

    def on_lane_outputs(self, requests: Iterable[Request]) -> None:
        """`on_output` for each request of a lane, with the tokens its step
        wrote into its own output list (`lane_output[1]`): one call per lane
        and step instead of one per request, the scheduler's sliced lane
        loops kept for prefix caching (a call per token would be a large
        part of a step with caching on). The same rules as `on_output`; a test
        holds the two to the same blocks, hashes and events."""
        size = self.block_size
        cache = self.prefix_cache
        assert cache is not None
        unenforced = self.num_blocks is None
        for request in requests:
            blocks = request.kv_blocks
            if blocks is None:
                continue
            all_token_ids = request.all_token_ids
            computed = len(all_token_ids)  # type: ignore[arg-type]
            if computed // size > request.num_cached_blocks:
                cache.cache(request, computed)
            token_ids = request.lane_output[1]  # type: ignore[index]
            all_token_ids += token_ids  # type: ignore[operator]
            if unenforced and len(blocks) * size < computed + len(token_ids):
                cache.ensure(request, self.blocks_for(computed + len(token_ids)))

    def free(self, request: Request) -> None:
        """A running request left the batch (finished, aborted, preempted)."""
        self.tokens -= request.num_tokens
        self.used_blocks -= request.blocks
        request.blocks = 0
        if self.prefix_cache is not None:
            self.prefix_cache.free(request)

    def free_all(self, requests: Sequence[Request] = ()) -> None:
        """Every running request (`requests`) left the batch at once."""
        self.tokens = self.used_blocks = 0
        for request in requests:
            request.blocks = 0
            if self.prefix_cache is not None:
                self.prefix_cache.free(request)

    def track(self, request: Request, prompt_token_ids: Optional[Sequence[int]]) -> None:
        """A new request's prompt ids and block hashes, when prefix caching is on."""
        if self.prefix_cache is not None and prompt_token_ids:
            self.prefix_cache.track(request, prompt_token_ids)

    def take_events(self) -> List[Tuple[Any, ...]]:
        """KV events since the last call (prefix_cache.py tuples; none when off)."""
        return self.prefix_cache.take_events() if self.prefix_cache is not None else []

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

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; False (nothing changed) while running
        requests hold blocks, as vLLM. True without prefix caching."""
        return self.prefix_cache.reset() if self.prefix_cache is not None else True
