"""Synthetic log-probabilities: the one place they are made; pure.

A real engine reports, for each sampled token, its log-probability and rank
and the top-K alternatives (docs/protocol.md §4.3, Appendix E). A mock has no
model, so the numbers are drawn, deterministically per (seed, engine rank,
request id, position), and kept self-consistent the way a frontend, a
client or an evaluation harness can check:

* each position's distribution is geometric over the ranks: the top-1
  token has probability p1 (around `--logprobs-top1`, varying per
  position), rank r has p1 * q**(r-1) with q = 0.8 * (1 - p1), so the
  probabilities of all ranks sum to less than 1;
* the top-K columns hold K distinct ids with non-increasing logprobs <= 0;
* column 0 is the sampled token (the id the token source made): the top-1
  with probability `--logprobs-sampled-top1`, otherwise a lower rank. Its
  logprob is its rank's, and when its rank is within K it appears in the
  top-K at exactly that rank, so rank and logprob agree wherever it sits;
* prompt positions get the same treatment, with the prompt's own id in
  column 0.

Ids come from the token source's range (`alternatives`), so they decode.

A request with no sampling controls that draws from a token pool (the
random source, a token file) takes its rows from a `RowPool`: the rows of
every position of that pool at its k, drawn once by the same model (a block
at a time, on first use) and shared by every request and engine of the
process, so its per-token cost is three byte slices instead of a draw of
every alternative. The rows then depend on
(pool position, k) instead of the request's own stream; since a request's
pool position is seeded per (seed, engine rank, request id), they stay
deterministic per request (docs/protocol.md §9.2).
"""

from __future__ import annotations

import math
import struct
from typing import AbstractSet, Any, List, Optional, Sequence, Tuple

_MASK64 = (1 << 64) - 1
_UNIT = 1.0 / (1 << 53)
_LCG_MUL = 6364136223846793005
_LCG_INC = 1442695040888963407
#: A sampled token that is not the top-1 sits at rank 2 + Geometric(this).
_LOWER_RANK_CONTINUE = 0.5
_MAX_RANK = 1 << 20
_INT32_LIMIT = 1 << 31
#: The top-1 probability of a token forced by logit_bias +100.
_FORCED_P1 = 1.0 - 1e-6
#: The logprob of an alternative the request could not emit (vLLM's API
#: floor for -inf, which JSON cannot carry).
_IMPOSSIBLE = -9999.0
#: Random picks of an alternative before taking the first free id in order.
_PICK_ATTEMPTS = 64
#: RowPools are kept for token pools of at most this many ids (the random
#: pool's 65 536: ~3.7 MB at k = 5, ~11.6 MB at k = 20) and k up to this
#: (vLLM's default max_logprobs); beyond, rows are drawn per token.
ROW_POOL_MAX_SIZE = 1 << 16
ROW_POOL_MAX_K = 20
#: Positions drawn at once when a RowPool first needs them: a block holds
#: the hub for a short while, more with a larger k.
ROW_BLOCK = 256
#: Bytes the RowPools of a process may hold. When a new one would exceed
#: it, those of other token pools or models (before a reload) go first;
#: if that is not enough, the new k is drawn per token (no thrashing).
ROW_POOL_BYTES = 64 << 20


def _level(p1: float) -> Tuple[float, float, List[float]]:
    """log p1, log q = log(0.8 (1 - p1)), and the ladder of logprobs by rank."""
    log_p1, log_q = math.log(p1), math.log(0.8 * (1.0 - p1))
    return log_p1, log_q, [log_p1]


def _next(state: int) -> Tuple[int, float]:
    state = (state * _LCG_MUL + _LCG_INC) & _MASK64
    return state, (state >> 11) * (1.0 / (1 << 53))


class LogprobModel:
    """Draws the logprob rows of one engine (see the module docstring)."""

    def __init__(self, top1: float = 0.6, sampled_top1: float = 0.75, low: int = 0, span: int = 32000) -> None:
        if not 0.0 < top1 < 1.0 or not 0.0 <= sampled_top1 <= 1.0:
            raise ValueError("top1 must be in (0, 1) and sampled_top1 in [0, 1]")
        self.top1 = top1
        self.sampled_top1 = sampled_top1
        #: the ids alternatives are drawn from: the token source's range
        self.low = low
        self.span = span
        # Each position's top-1 probability p1 is one of 256 levels around
        # top1 (0.5x..1.5x); per level: log p1, log q, and the logprobs by
        # rank (extended as larger k are asked).
        self._levels = [_level(min(0.98, max(0.02, top1 * (0.5 + (i + 0.5) / 256)))) for i in range(256)]
        self._forced = _level(_FORCED_P1)
        #: (id of a pool's ids, k) -> (those ids, their RowPool or None): `pooled`'s memo
        self._pooled: "dict[Tuple[int, int], Tuple[Any, Optional[RowPool]]]" = {}

    def pooled(self, source: Any, k: int, ids: Optional[List[int]] = None) -> "Optional[RowPool]":
        """The shared RowPool of `source`'s pool at `k` (or of `ids`, a
        stop-free copy of that pool: tokens.TokenPool.ids_avoiding), or None
        where rows are drawn per token: a source without a pool (echo), a
        pool over ROW_POOL_MAX_SIZE ids or with an id beyond int32, k over
        ROW_POOL_MAX_K, or ROW_POOL_BYTES held."""
        base = getattr(source, "ids", None)
        if ids is None:
            ids = base
        key = (id(ids), k)
        memo = self._pooled.get(key)
        if memo is not None and memo[0] is ids:
            return memo[1]
        found = None
        if ids is not None and k <= ROW_POOL_MAX_K and source.size <= ROW_POOL_MAX_SIZE:
            found = _row_pool(self, base, ids, source.size, k)
        if len(self._pooled) >= 64:  # a memo, not a store: the RowPools live in _row_pools
            self._pooled.clear()
        self._pooled[key] = (ids, found)
        return found

    def rows(
        self,
        state: int,
        sampled: Sequence[int],
        k: int,
        pool: Optional[Sequence[int]] = None,
        banned: Optional[AbstractSet[int]] = None,
        forced: bool = False,
    ) -> Tuple[str, bytes, bytes, bytes, int]:
        """The rows for tokens `sampled` with `k` alternatives each: the ids'
        width ("i4", or "i8" when an id does not fit int32), token ids
        [n, k+1], logprobs float32 [n, k+1], ranks int64 [n] (as
        little-endian bytes) and the state after them.

        The sampling controls of the request (request.plan) keep the numbers
        consistent with what it may emit: alternatives come from `pool`
        (allowed_token_ids, or the forced ids of a logit_bias +100) and never
        from `banned`; once the pool is used up, further alternatives are ids
        it could not emit, at -9999 (the finite floor vLLM's API puts on
        -inf); a forced token is the top-1 with a probability of almost 1.
        """
        ids: List[int] = []
        lps: List[float] = []
        ranks: List[int] = []
        low, span, sampled_top1 = self.low, self.span, self.sampled_top1
        limit = len(pool) if pool is not None else _MAX_RANK
        plain = pool is None and banned is None  # the common case: no sampling controls
        for token in sampled:
            # the LCG inline (the per-token path of a request with logprobs)
            state = (state * _LCG_MUL + _LCG_INC) & _MASK64
            log_p1, log_q, ladder = self._forced if forced else self._levels[state >> 56]
            if len(ladder) <= k:
                ladder.extend(log_p1 + r * log_q for r in range(len(ladder), k + 1))
            state = (state * _LCG_MUL + _LCG_INC) & _MASK64
            rank = 1
            if (state >> 11) * _UNIT >= sampled_top1 and not forced and limit > 1:
                rank = 2
                while rank < limit:
                    state = (state * _LCG_MUL + _LCG_INC) & _MASK64
                    if (state >> 11) * _UNIT >= _LOWER_RANK_CONTINUE:
                        break
                    rank += 1
            ids.append(token)
            lps.append(ladder[rank - 1] if rank <= k else log_p1 + (rank - 1) * log_q)
            ranks.append(rank)
            # the top-k: distinct ids, the sampled one at its own rank when it is within k
            chosen = {token}
            if plain:
                for position in range(1, k + 1):
                    if position == rank:
                        ids.append(token)
                        continue
                    while True:  # k + 1 <= span was checked at admission
                        state = (state * _LCG_MUL + _LCG_INC) & _MASK64
                        candidate = low + (((state >> 32) * span) >> 32)
                        if candidate not in chosen:
                            break
                    chosen.add(candidate)
                    ids.append(candidate)
                lps.extend(ladder[:k])
                continue
            impossible = False  # from here on, alternatives the request could not emit
            for position in range(1, k + 1):
                impossible = impossible or position > limit
                if position == rank:
                    ids.append(token)
                else:
                    state, candidate, fits = _alternative(state, chosen, pool, banned, impossible, low, span)
                    impossible = impossible or not fits
                    chosen.add(candidate)
                    ids.append(candidate)
                lps.append(_IMPOSSIBLE if impossible and position != rank else ladder[position - 1])
        n, columns = len(sampled), k + 1
        wide = max(ids) >= _INT32_LIMIT if ids else False  # vLLM's vocabularies fit int32; a mock's may not
        ids_row, lps_row, ranks_row = _structs(n, columns, wide)
        return "i8" if wide else "i4", ids_row.pack(*ids), lps_row.pack(*lps), ranks_row.pack(*ranks), state


class RowPool:
    """The logprob rows of every position of one token pool at one k, as
    `LogprobModel.rows` draws them with that position's id sampled: token
    ids int32 [k+1], logprobs float32 [k+1] and rank int64 per position, in
    three buffers laid out as the pool (its POOL_PAD tail too, so a slice
    never wraps). Blocks of ROW_BLOCK positions are drawn on first use,
    each from a state seeded by (k, block): the same rows whatever the
    order of use."""

    def __init__(self, model: LogprobModel, ids: List[int], size: int, k: int) -> None:
        self.model = model
        self.ids = ids  # the pool, padded (tokens.TokenPool.ids); shared, never mutated
        self.size = size
        self.k = k
        #: bytes a row takes in `row_ids` and `row_lps` (`row_ranks`: 8)
        self.stride = 4 * (k + 1)
        #: The rows by position (only those `ensure` drew hold them).
        self.row_ids = bytearray(len(ids) * self.stride)
        self.row_lps = bytearray(len(ids) * self.stride)
        self.row_ranks = bytearray(len(ids) * 8)
        self._built = bytearray(-(-size // ROW_BLOCK))
        self.nbytes = self.bytes_for(len(ids), k)

    @staticmethod
    def bytes_for(positions: int, k: int) -> int:
        """What the buffers of a RowPool of `positions` rows at `k` take."""
        return positions * (8 * (k + 1) + 8)

    def take(self, position: int, tokens: List[int]) -> Optional[Tuple[bytearray, bytearray, bytearray]]:
        """The rows (ids, logprobs, ranks: little-endian buffers) of `tokens` sampled from
        pool position `position` on; None when they are not the pool's ids
        there (moved off a stop id, a planned last token, a long chunk):
        those are drawn per token."""
        end = position + len(tokens)
        ids = self.ids
        if not 0 <= position < self.size or end > len(ids) or ids[position:end] != tokens:
            return None
        built = self._built
        if not (built[position // ROW_BLOCK] and built[(min(end, self.size) - 1) // ROW_BLOCK]) or end > self.size:
            self.ensure(position, end)
        stride = self.stride
        # slices of the buffers: copies, so a later block leaves them as they are
        return (
            self.row_ids[position * stride : end * stride],
            self.row_lps[position * stride : end * stride],
            self.row_ranks[position * 8 : end * 8],
        )

    def ensure(self, position: int, end: int) -> None:
        """Draw the blocks that rows `position` to `end` (exclusive, at most
        the padded pool's length) are read from."""
        built, size = self._built, self.size
        for block in range(position // ROW_BLOCK, (min(end, size) - 1) // ROW_BLOCK + 1):
            if not built[block]:
                self._build(block)
        if end > size and not built[0]:  # the tail repeats the pool's first positions
            self._build(0)

    def _build(self, block: int) -> None:
        start, size, stride = block * ROW_BLOCK, self.size, self.stride
        stop = min(size, start + ROW_BLOCK)
        state = (block * 0x9E3779B97F4A7C15 + self.k * 0xBF58476D1CE4E5B9 + 1) & _MASK64
        _, row_ids, row_lps, row_ranks, _ = self.model.rows(state, self.ids[start:stop], self.k)
        ids, lps, ranks = self.row_ids, self.row_lps, self.row_ranks
        ids[start * stride : stop * stride] = row_ids
        lps[start * stride : stop * stride] = row_lps
        ranks[start * 8 : stop * 8] = row_ranks
        for tail in range(size, len(self.ids)):  # the padded tail: copies of the rows it repeats
            source = (tail - size) % size
            if start <= source < stop:
                ids[tail * stride : (tail + 1) * stride] = ids[source * stride : (source + 1) * stride]
                lps[tail * stride : (tail + 1) * stride] = lps[source * stride : (source + 1) * stride]
                ranks[tail * 8 : (tail + 1) * 8] = ranks[source * 8 : (source + 1) * 8]
        self._built[block] = 1


#: The RowPools of a process, by token pool and model: (id of the pool's
#: ids, the model's parameters) -> (those ids, {(id of the ids the rows
#: are for: the pool's or a stop-free copy's, k) -> (those ids, RowPool or
#: None)}). None: rows drawn per token (an id beyond int32, no room).
_row_pools: "dict[Tuple[Any, ...], Tuple[List[int], dict]]" = {}


def _row_pool(model: LogprobModel, base: List[int], ids: List[int], size: int, k: int) -> Optional[RowPool]:
    group_key = (id(base), (model.top1, model.sampled_top1, model.low, model.span))
    group = _row_pools.get(group_key)
    if group is None or group[0] is not base:  # new, or the id of a pool that is gone
        group = _row_pools[group_key] = (base, {})
    pools = group[1]
    entry = pools.get((id(ids), k))
    if entry is not None and entry[0] is ids:
        return entry[1]
    found = None
    if max(ids) < _INT32_LIMIT:
        need = RowPool.bytes_for(len(ids), k)
        for other in list(_row_pools):
            if _row_pool_bytes() + need <= ROW_POOL_BYTES:
                break
            if other != group_key:  # another token pool's or model's: stale after a reload
                del _row_pools[other]
        if _row_pool_bytes() + need <= ROW_POOL_BYTES:
            found = RowPool(model, ids, size, k)
    pools[(id(ids), k)] = (ids, found)
    return found


def _row_pool_bytes() -> int:
    return sum(pool.nbytes for _, pools in _row_pools.values() for _, pool in pools.values() if pool is not None)


#: (tokens, columns, wide) -> the three packers of `LogprobModel.rows`: made
#: once per shape instead of a format string per call (which would be a
#: sizeable part of what a logprobs output costs). Shapes are few (the chunk size and the
#: k asked); the cache starts afresh beyond _STRUCTS_KEPT of them.
_struct_cache: "dict[Tuple[int, int, bool], Tuple[struct.Struct, struct.Struct, struct.Struct]]" = {}
_STRUCTS_KEPT = 256


def _structs(n: int, columns: int, wide: bool) -> Tuple[struct.Struct, struct.Struct, struct.Struct]:
    key = (n, columns, wide)
    found = _struct_cache.get(key)
    if found is None:
        if len(_struct_cache) >= _STRUCTS_KEPT:
            _struct_cache.clear()
        found = _struct_cache[key] = (
            struct.Struct(f"<{n * columns}{'q' if wide else 'i'}"),
            struct.Struct(f"<{n * columns}f"),
            struct.Struct(f"<{n}q"),
        )
    return found


def _alternative(
    state: int,
    chosen: AbstractSet[int],
    pool: Optional[Sequence[int]],
    banned: Optional[AbstractSet[int]],
    impossible: bool,
    low: int,
    span: int,
) -> Tuple[int, int, bool]:
    """One more distinct alternative: from the pool (or the range) and not
    banned, or, when `impossible`, an id the request could not emit. Random
    picks first; in a crowded range (few ids left), the first id in order
    that is not taken yet, marked as not fitting (its logprob is then the
    floor). Returns the state, the id and whether it fits."""
    from_pool = pool is not None and not impossible
    for _ in range(_PICK_ATTEMPTS):
        state, u = _next(state)
        candidate = pool[int(u * len(pool))] if from_pool else low + int(u * span)
        if candidate in chosen:
            continue
        if impossible:
            if pool is None or candidate not in pool:
                return state, candidate, False
        elif banned is None or candidate not in banned:
            return state, candidate, True
    # k + 1 <= span was checked at admission, so an id that is not taken exists
    for candidate in range(low, low + span):
        if candidate not in chosen:
            return state, candidate, False
    raise ValueError("no distinct alternative left")  # unreachable after the admission check
