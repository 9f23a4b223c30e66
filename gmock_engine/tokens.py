"""Where tokens are made: the one place that picks generated token ids.

Each request carries its own generator state seeded from (seed, engine rank,
request id), so a run with the same seed and the same request ids produces
the same tokens, whatever the interleaving of requests (the Rust mock's rule,
PROTOCOL.md §9.2).

The generator is a 64-bit LCG (Knuth's MMIX constants) whose top 32 bits are
scaled onto [0, vocab_size) by multiply-shift. That is plenty uniform for a
mock, costs a few integer operations per token and keeps the per-request
state to one int (a `random.Random` is ~2.5 KB, which matters at 100 000
active requests).
"""

from __future__ import annotations

import hashlib
from typing import List, Tuple

_MASK64 = (1 << 64) - 1
_LCG_MUL = 6364136223846793005
_LCG_INC = 1442695040888963407


def request_seed(seed: int, rank: int, request_id: str) -> int:
    """A stable 64-bit seed for one request (Python's hash() is salted per process)."""
    digest = hashlib.blake2b(f"{seed}\0{rank}\0{request_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


class RandomTokens:
    """Token ids drawn uniformly from [0, vocab_size)."""

    def __init__(self, vocab_size: int, seed: int, rank: int) -> None:
        if vocab_size < 1:
            raise ValueError("vocab_size must be >= 1")
        self.vocab_size = vocab_size
        self.seed = seed
        self.rank = rank

    def initial_state(self, request_id: str) -> int:
        """The generator state of a new request."""
        return request_seed(self.seed, self.rank, request_id)

    def draw(self, state: int, n: int) -> Tuple[List[int], int]:
        """The next `n` token ids after `state`, and the state after them."""
        vocab = self.vocab_size
        if n == 1:  # the common case (chunk 1): no loop, no list growth
            state = (state * _LCG_MUL + _LCG_INC) & _MASK64
            return [((state >> 32) * vocab) >> 32], state
        tokens = []
        for _ in range(n):
            state = (state * _LCG_MUL + _LCG_INC) & _MASK64
            tokens.append(((state >> 32) * vocab) >> 32)
        return tokens, state
