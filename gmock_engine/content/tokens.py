"""Where tokens are made: the one place that picks generated token ids.

Sources (`--token-source`): `random` (default; `--token-id-range` narrows it,
e.g. to ids a tokenizer decodes to clean text), `echo` (the request's own
prompt ids, over and over), `text` (English sentences encoded with the
`--tokenizer`: text that reads like text, `TextTokens`) and `file:PATH`
(ids read from a file, each request starting at its own seeded offset); a
request replayed from a trace (`--replay`, timing/replay.py) has its own,
`RecordedTokens`. Every source has the same
calls: `initial_state(request_id, prompt_token_ids)` and `draw(state, n)`,
and for stop ids (a real engine stops on them, the mock's plan decides the
end): `only_emits(state, ids)` (can the request make no other id?) and
`avoid(tokens, ids)` (move drawn ids off them, staying within the source).

Random, text and file ids come from a pool drawn (or read, or encoded) once:
a request's state is its position in the pool, starting at an offset seeded from (seed, engine
rank, request id), so a run with the same seed and the same request ids
produces the same tokens, whatever the interleaving of requests (the Rust
mock's rule, docs/protocol.md §9.2). Drawing `n` ids is then one list slice,
which is what makes the per-token path cheap: the scheduler's
steady state slices `TokenPool.ids` itself.

The random pool holds RANDOM_POOL_SIZE ids from a 64-bit LCG (Knuth's MMIX
constants) whose top 32 bits are scaled onto [low, high) by multiply-shift,
seeded by `--seed` alone: every engine of a process shares it (~2.5 MB),
and a request repeats its ids only after RANDOM_POOL_SIZE tokens.
"""

from __future__ import annotations

import hashlib
from typing import AbstractSet, Any, List, Optional, Sequence, Tuple, Union

from gmock_engine.wire.types import TOKEN_ID_LIMIT

_MASK64 = (1 << 64) - 1
_LCG_MUL = 6364136223846793005
_LCG_INC = 1442695040888963407


#: blake2b states that have hashed `f"{seed}\0{rank}\0"`, per (seed, rank):
#: a request's seed copies one and adds its id, instead of formatting and
#: hashing the whole string for every ADD.
_seed_prefixes: "dict[Tuple[int, int], Any]" = {}


def request_seed(seed: int, rank: int, request_id: str) -> int:
    """A stable 64-bit seed for one request (Python's hash() is salted per
    process): blake2b of `f"{seed}\0{rank}\0{request_id}"`, 8 bytes."""
    prefix = _seed_prefixes.get((seed, rank))
    if prefix is None:
        if len(_seed_prefixes) >= 4096:
            _seed_prefixes.clear()
        prefix = _seed_prefixes[seed, rank] = hashlib.blake2b(f"{seed}\0{rank}\0".encode(), digest_size=8)
    state = prefix.copy()
    state.update(request_id.encode())
    return int.from_bytes(state.digest(), "little")


#: Ids in the random pool; a request's ids repeat after this many tokens.
RANDOM_POOL_SIZE = 1 << 16
#: The pool list carries its first POOL_PAD ids again at its end, so that a
#: slice of up to POOL_PAD ids from any position in [0, size) never wraps.
POOL_PAD = 64

_random_pools: "dict[Tuple[int, int, int], List[int]]" = {}

#: Stop-free copies of pools (`TokenPool.ids_avoiding`), shared by every
#: engine of the process that draws from the same pool (the random pool is
#: one per seed and range): (id of the pool, stop ids) -> (the pool, its
#: copy). At most this many; the oldest goes first.
AVOIDING_POOLS = 16
#: A pool longer than this (a large token file) gets no stop-free copies:
#: each would cost the pool's size again.
AVOIDING_POOL_LIMIT = 1 << 18

_avoiding_pools: "dict[Tuple[int, frozenset], Tuple[List[int], List[int]]]" = {}


class TokenPool:
    """Ids drawn by slicing a fixed pool; the state is a position in [0, size).

    `ids` is the pool followed by its first POOL_PAD ids, so that
    `ids[pos:pos + n]` for n <= POOL_PAD is the next n ids after `pos`
    (the scheduler's steady state inlines exactly that)."""

    ids: List[int]
    size: int
    seed: int
    rank: int

    def _init_pool(self, padded: List[int], size: int, seed: int, rank: int) -> None:
        """`padded`: the pool's `size` ids and then its first POOL_PAD again
        (shared, never mutated: every draw returns a new list)."""
        self.size = size
        self.ids = padded
        self.seed = seed
        self.rank = rank

    def initial_state(self, request_id: str, prompt_token_ids: Optional[Sequence[int]] = None) -> int:
        """A new request's position: seeded by (seed, rank, request id)."""
        return request_seed(self.seed, self.rank, request_id) % self.size

    def avoid(self, tokens: List[int], ids: AbstractSet[int]) -> List[int]:
        raise NotImplementedError  # each pooled source moves ids its own way

    def ids_avoiding(self, stop_ids: frozenset) -> Optional[List[int]]:
        """`ids` with every id in `stop_ids` moved as `avoid` moves it, so
        that `ids_avoiding(S)[p:p + n] == avoid(ids[p:p + n], S)` at every
        position `p` (n <= POOL_PAD): a request with stop ids draws by a
        slice, as one without does, and makes the same ids as the checked
        draw would (every request of a real frontend names its EOS in
        `_all_stop_token_ids`, so behind one every token would take the
        checked path). Built once per pool and stop set and shared (AVOIDING_POOLS); None for a pool over
        AVOIDING_POOL_LIMIT."""
        pool = self.ids
        if len(pool) > AVOIDING_POOL_LIMIT:
            return None
        key = (id(pool), stop_ids)
        known = _avoiding_pools.get(key)
        if known is not None and known[0] is pool:
            return known[1]
        avoid = self.avoid
        copy = [token if token not in stop_ids else avoid([token], stop_ids)[0] for token in pool]
        if len(_avoiding_pools) >= AVOIDING_POOLS:
            del _avoiding_pools[next(iter(_avoiding_pools))]
        _avoiding_pools[key] = (pool, copy)
        return copy

    def draw(self, state: int, n: int) -> Tuple[List[int], int]:
        """The next `n` ids after position `state`, and the position after them."""
        size = self.size
        if not 0 <= state < size:
            state %= size
        if n <= POOL_PAD:
            end = state + n
            return self.ids[state:end], (end if end < size else end % size)
        ids = self.ids
        tokens: List[int] = []
        left = n
        while left:
            take = min(left, size - state)
            tokens += ids[state : state + take]
            left -= take
            state = (state + take) % size
        return tokens, state


def _padded(ids: Sequence[int]) -> List[int]:
    return list(ids) + [ids[i % len(ids)] for i in range(POOL_PAD)]


def random_pool(seed: int, low: int, span: int) -> List[int]:
    """RANDOM_POOL_SIZE ids in [low, low + span), padded (TokenPool.ids),
    the same for the same arguments (cached: every engine of a process
    shares one)."""
    key = (seed, low, span)
    pool = _random_pools.get(key)
    if pool is None:
        state = request_seed(seed, -1, "token-pool")
        pool = []
        append = pool.append
        for _ in range(RANDOM_POOL_SIZE):
            state = (state * _LCG_MUL + _LCG_INC) & _MASK64
            append(low + (((state >> 32) * span) >> 32))
        pool = _random_pools[key] = _padded(pool)
    return pool


class RandomTokens(TokenPool):
    """Token ids drawn uniformly from [low, high) (default [0, vocab_size))."""

    def __init__(self, vocab_size: int, seed: int, rank: int, low: int = 0, high: Optional[int] = None) -> None:
        high = vocab_size if high is None else high
        if not 0 <= low < high:
            raise ValueError(f"empty token id range [{low}, {high})")
        self.vocab_size = vocab_size
        self.low = low
        self.span = high - low
        self._init_pool(random_pool(seed, low, self.span), RANDOM_POOL_SIZE, seed, rank)

    def only_emits(self, state: int, ids: AbstractSet[int]) -> bool:
        """True when every id of [low, high) is in `ids` (the range, not the
        pool: `avoid` moves ids within the range)."""
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


class FileTokens(TokenPool):
    """Ids from a file (whitespace-separated integers), cycled; each request
    starts at an offset seeded by (seed, rank, request id)."""

    def __init__(self, ids: Sequence[int], seed: int, rank: int) -> None:
        if not ids:
            raise ValueError("no token ids")
        self._init_pool(_padded(ids), len(ids), seed, rank)
        self._distinct = frozenset(ids)

    def only_emits(self, state: int, ids: AbstractSet[int]) -> bool:
        """True when every id of the file is in `ids`."""
        return _covers(ids, self._distinct)

    def avoid(self, tokens: List[int], ids: AbstractSet[int]) -> List[int]:
        return _avoid_by_increment(tokens, ids)


#: Tokens in a text pool at most: whole sentences are added while they fit
#: (the logprobs' RowPool limit too, logprobs.ROW_POOL_MAX_SIZE).
TEXT_POOL_SIZE = 1 << 16
#: What a stop id in a text pool becomes (`TextTokens.avoid`): the first of
#: these that the tokenizer makes one token of and that is not a stop id.
TEXT_FILLERS = (" and", " the", ",", " ", ".", " a")

#: (tokenizer file, seed) -> (padded pool, its size, the sentence starts, its distinct ids)
_text_pools: "dict[Tuple[str, int], Tuple[List[int], int, List[int], frozenset]]" = {}
#: tokenizer file -> the ids of each corpus sentence (`sentence_ids`)
_sentence_ids: "dict[str, List[List[int]]]" = {}


def sentence_ids(tokenizer: Any) -> List[List[int]]:
    """The ids of each sentence of corpus.SENTENCES, encoded so that their
    concatenation is how `tokenizer` encodes the sentences joined by spaces:
    " " + sentence where a leading space is its own part of the next word
    (byte-level BPE: GPT-2, Llama 3, Qwen), the bare sentence where the
    tokenizer puts the space there itself (SentencePiece's "▁" prefix).
    Cached per tokenizer file."""
    known = _sentence_ids.get(tokenizer.path)
    if known is not None:
        return known
    from gmock_engine.content.corpus import SENTENCES

    encode = tokenizer.encode
    first, second = SENTENCES[0], SENTENCES[1]
    joined = encode(" " + first + " " + second)
    if joined != encode(" " + first) + encode(" " + second) and encode(first + " " + second) == encode(first) + encode(second):
        pieces = [encode(sentence) for sentence in SENTENCES]
    else:
        pieces = [encode(" " + sentence) for sentence in SENTENCES]
    _sentence_ids[tokenizer.path] = pieces
    return pieces


def text_pool(tokenizer: Any, seed: int) -> Tuple[List[int], int, List[int], frozenset]:
    """(padded ids, size, sentence starts, distinct ids) of the text pool of
    `seed`: the corpus sentences in seeded orders (each pass a new shuffle, LCG-driven),
    whole sentences while they fit TEXT_POOL_SIZE; the same for the same
    tokenizer file and seed (cached: every engine of a process shares it)."""
    key = (tokenizer.path, seed)
    known = _text_pools.get(key)
    if known is not None:
        return known
    pieces = sentence_ids(tokenizer)
    if not any(pieces):
        raise ValueError(f"{tokenizer.path}: the tokenizer makes no ids of the built-in text")
    state = request_seed(seed, -1, "text-pool")
    ids: List[int] = []
    starts: List[int] = []
    last = -1
    while True:
        order = list(range(len(pieces)))
        for i in range(len(order) - 1, 0, -1):  # Fisher-Yates
            state = (state * _LCG_MUL + _LCG_INC) & _MASK64
            j = ((state >> 32) * (i + 1)) >> 32
            order[i], order[j] = order[j], order[i]
        if order[0] == last:  # no sentence twice in a row across two passes
            order[0], order[-1] = order[-1], order[0]
        for index in order:
            piece = pieces[index]
            if len(ids) + len(piece) > TEXT_POOL_SIZE:
                break
            starts.append(len(ids))
            ids += piece
        else:
            last = order[-1]
            continue
        break
    found = _text_pools[key] = (_padded(ids), len(ids), starts, frozenset(ids))
    return found


class TextTokens(TokenPool):
    """Ids of text that reads like text (`--token-source text`): the pool is
    the built-in corpus (corpus.py) in a seeded order, encoded once with the
    served model's tokenizer (`--tokenizer`), so that any slice of it
    decodes to clean text which the tokenizer encodes back to (nearly) the
    same ids, and a client that counts tokens by re-tokenizing counts what
    was generated. Each request starts at a sentence, seeded by (seed, rank,
    request id)."""

    def __init__(self, tokenizer: Any, seed: int, rank: int) -> None:
        padded, size, starts, distinct = text_pool(tokenizer, seed)
        self._init_pool(padded, size, seed, rank)
        self._starts = starts
        self._distinct = distinct
        fillers = []
        for text in TEXT_FILLERS:
            encoded = tokenizer.encode(text)
            if len(encoded) == 1 and encoded[0] not in fillers:
                fillers.append(encoded[0])
        self._fillers = tuple(fillers)

    def initial_state(self, request_id: str, prompt_token_ids: Optional[Sequence[int]] = None) -> int:
        """A new request's position: a sentence start, seeded by (seed, rank, request id)."""
        starts = self._starts
        return starts[request_seed(self.seed, self.rank, request_id) % len(starts)]

    def only_emits(self, state: int, ids: AbstractSet[int]) -> bool:
        """True when every id of the pool is in `ids`."""
        return _covers(ids, self._distinct)

    def avoid(self, tokens: List[int], ids: AbstractSet[int]) -> List[int]:
        """Each drawn id in `ids` becomes a filler word or punctuation
        (TEXT_FILLERS) that is not, so the text stays text; the next id that
        is not when every filler is a stop id."""
        filler = next((f for f in self._fillers if f not in ids), None)
        if filler is None:
            return _avoid_by_increment(tokens, ids)
        return [filler if token in ids else token for token in tokens]


class RecordedTokens:
    """A replayed request's own source (timing/replay.py, --replay): the ids a
    recorded run emitted for it, in order, then `fallback`'s (the engine's
    source) for any token past the recording. The state is (position in the
    recording, the fallback's state). No `ids` pool: its rows of logprobs
    are drawn per token (logprobs.LogprobModel.pooled)."""

    __slots__ = ("recorded", "fallback")

    def __init__(self, recorded: Sequence[int], fallback: "TokenSource") -> None:
        self.recorded = recorded
        self.fallback = fallback

    def initial_state(self, request_id: str, prompt_token_ids: Optional[Sequence[int]] = None) -> Tuple[int, Any]:
        return (0, self.fallback.initial_state(request_id, prompt_token_ids))

    def draw(self, state: Tuple[int, Any], n: int) -> Tuple[List[int], Tuple[int, Any]]:
        position, rest = state
        tokens = list(self.recorded[position : position + n])
        if len(tokens) < n:
            more, rest = self.fallback.draw(rest, n - len(tokens))
            tokens += more
        return tokens, (position + len(tokens), rest)

    def only_emits(self, state: Tuple[int, Any], ids: AbstractSet[int]) -> bool:
        return self.fallback.only_emits(state[1], ids)

    def avoid(self, tokens: List[int], ids: AbstractSet[int]) -> List[int]:
        return self.fallback.avoid(tokens, ids)


def _covers(ids: AbstractSet[int], distinct: frozenset) -> bool:
    """Whether `ids` holds every id of `distinct` (a file's or a text pool's ids)."""
    return distinct <= ids if isinstance(ids, (set, frozenset)) else all(t in ids for t in distinct)


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


TokenSource = Union[RandomTokens, EchoTokens, FileTokens, TextTokens, RecordedTokens]


def make_source(
    spec: str, vocab_size: int, seed: int, rank: int, id_range: Optional[Tuple[int, int]] = None, tokenizer: Optional[str] = None
) -> TokenSource:
    """The source for `--token-source` (random | echo | text | file:PATH);
    `tokenizer`: the --tokenizer path, which `text` needs (ValueError without)."""
    if spec == "echo":
        return EchoTokens()
    if spec == "text":
        if tokenizer is None:
            raise ValueError("--token-source text needs --tokenizer PATH (the served model's tokenizer)")
        from gmock_engine.content.tokenizer import load_tokenizer

        return TextTokens(load_tokenizer(tokenizer), seed, rank)
    if spec.startswith("file:"):
        return FileTokens(read_token_file(spec[5:]), seed, rank)
    low, high = id_range if id_range else (0, vocab_size)
    return RandomTokens(vocab_size, seed, rank, low, high)
