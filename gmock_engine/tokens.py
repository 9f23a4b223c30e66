"""Where tokens are made: the one place that picks generated token ids.

Sources (`--token-source`): `random` (default; `--token-id-range` narrows it,
e.g. to ids a tokenizer decodes to clean text), `echo` (the request's own
prompt ids, over and over) and `file:PATH` (ids read from a file, each
request starting at its own seeded offset). Every source has the same
calls: `initial_state(request_id, prompt_token_ids)` and `draw(state, n)`,
and for stop ids (a real engine stops on them, the mock's plan decides the
end): `only_emits(state, ids)` (can the request make no other id?) and
`avoid(tokens, ids)` (move drawn ids off them, staying within the source).

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
from typing import AbstractSet, List, Optional, Sequence, Tuple, Union

from .protocol import TOKEN_ID_LIMIT

_MASK64 = (1 << 64) - 1
_LCG_MUL = 6364136223846793005
_LCG_INC = 1442695040888963407


def request_seed(seed: int, rank: int, request_id: str) -> int:
    """A stable 64-bit seed for one request (Python's hash() is salted per process)."""
    digest = hashlib.blake2b(f"{seed}\0{rank}\0{request_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


class RandomTokens:
    """Token ids drawn uniformly from [low, high) (default [0, vocab_size))."""

    def __init__(self, vocab_size: int, seed: int, rank: int, low: int = 0, high: Optional[int] = None) -> None:
        high = vocab_size if high is None else high
        if not 0 <= low < high:
            raise ValueError(f"empty token id range [{low}, {high})")
        self.vocab_size = vocab_size
        self.seed = seed
        self.rank = rank
        self.low = low
        self.span = high - low

    def initial_state(self, request_id: str, prompt_token_ids: Optional[Sequence[int]] = None) -> int:
        """The generator state of a new request."""
        return request_seed(self.seed, self.rank, request_id)

    def draw(self, state: int, n: int) -> Tuple[List[int], int]:
        """The next `n` token ids after `state`, and the state after them."""
        span, low = self.span, self.low
        if n == 1:  # the common case (chunk 1): no loop, no list growth
            state = (state * _LCG_MUL + _LCG_INC) & _MASK64
            return [low + (((state >> 32) * span) >> 32)], state
        tokens = []
        for _ in range(n):
            state = (state * _LCG_MUL + _LCG_INC) & _MASK64
            tokens.append(low + (((state >> 32) * span) >> 32))
        return tokens, state

    def only_emits(self, state: int, ids: AbstractSet[int]) -> bool:
        """True when every id of [low, high) is in `ids`."""
        if len(ids) < self.span:
            return False  # the common case: a few stop ids
        low = self.low
        return all(low + i in ids for i in range(self.span))

    def avoid(self, tokens: List[int], ids: AbstractSet[int]) -> List[int]:
        """Each drawn id in `ids` moved to the next id of the range that is
        not (there is one: the plan handles a range made only of stop ids)."""
        low, span = self.low, self.span
        out = []
        for token in tokens:
            for _ in range(min(len(ids), span)):
                if token not in ids:
                    break
                token = low + (token - low + 1) % span
            out.append(token)
        return out


class EchoTokens:
    """The request's prompt ids, repeated (a prompt of none echoes id 0)."""

    def initial_state(self, request_id: str, prompt_token_ids: Optional[Sequence[int]] = None) -> Tuple[Sequence[int], int]:
        return (prompt_token_ids or (0,), 0)

    def draw(self, state: Tuple[Sequence[int], int], n: int) -> Tuple[List[int], Tuple[Sequence[int], int]]:
        ids, position = state
        tokens = [ids[(position + i) % len(ids)] for i in range(n)]
        return tokens, (ids, (position + n) % len(ids))

    def only_emits(self, state: Tuple[Sequence[int], int], ids: AbstractSet[int]) -> bool:
        """True when every prompt id is in `ids`."""
        return all(token in ids for token in state[0])

    def avoid(self, tokens: List[int], ids: AbstractSet[int]) -> List[int]:
        return _avoid_by_increment(tokens, ids)


class FileTokens:
    """Ids from a file (whitespace-separated integers), cycled; each request
    starts at an offset seeded by (seed, rank, request id)."""

    def __init__(self, ids: Sequence[int], seed: int, rank: int) -> None:
        if not ids:
            raise ValueError("no token ids")
        self.ids = tuple(ids)
        self._distinct = frozenset(self.ids)
        self.seed = seed
        self.rank = rank

    def initial_state(self, request_id: str, prompt_token_ids: Optional[Sequence[int]] = None) -> int:
        return request_seed(self.seed, self.rank, request_id) % len(self.ids)

    def draw(self, state: int, n: int) -> Tuple[List[int], int]:
        ids = self.ids
        tokens = [ids[(state + i) % len(ids)] for i in range(n)]
        return tokens, (state + n) % len(ids)

    def only_emits(self, state: int, ids: AbstractSet[int]) -> bool:
        """True when every id of the file is in `ids`."""
        return self._distinct <= ids if isinstance(ids, (set, frozenset)) else all(t in ids for t in self._distinct)

    def avoid(self, tokens: List[int], ids: AbstractSet[int]) -> List[int]:
        return _avoid_by_increment(tokens, ids)


def _avoid_by_increment(tokens: List[int], ids: AbstractSet[int]) -> List[int]:
    """Echo and file ids: a drawn id in `ids` becomes the next larger id
    that is not (wrapping below 2**32, the largest id a frontend decodes)."""
    out = []
    for token in tokens:
        while token in ids:
            token = (token + 1) % TOKEN_ID_LIMIT
        out.append(token)
    return out


def read_token_file(path: str) -> List[int]:
    """The ids of a token file; ValueError with the reason if it has none or a non-integer."""
    with open(path, encoding="utf-8") as handle:
        words = handle.read().split()
    ids = []
    for index, word in enumerate(words):
        try:
            ids.append(int(word))
        except ValueError:
            raise ValueError(f"{path}: word {index + 1} ({word[:20]!r}) is not an integer token id") from None
        if not 0 <= ids[-1] < TOKEN_ID_LIMIT:
            raise ValueError(f"{path}: word {index + 1} is not a token id in 0..2**32-1")
    if not ids:
        raise ValueError(f"{path} holds no token ids")
    return ids


TokenSource = Union[RandomTokens, EchoTokens, FileTokens]


def make_source(spec: str, vocab_size: int, seed: int, rank: int, id_range: Optional[Tuple[int, int]] = None) -> TokenSource:
    """The source for `--token-source` (random | echo | file:PATH)."""
    if spec == "echo":
        return EchoTokens()
    if spec.startswith("file:"):
        return FileTokens(read_token_file(spec[5:]), seed, rank)
    low, high = id_range if id_range else (0, vocab_size)
    return RandomTokens(vocab_size, seed, rank, low, high)
