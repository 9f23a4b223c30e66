"""Synthetic log-probabilities: the one place they are made; pure.

A real engine reports, for each sampled token, its log-probability and rank
and the top-K alternatives (PROTOCOL.md §4.3, Appendix E). A mock has no
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
"""

from __future__ import annotations

import math
import struct
from typing import AbstractSet, List, Optional, Sequence, Tuple

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


#: (tokens, columns, wide) -> the three packers of `LogprobModel.rows`: made
#: once per shape instead of a format string per call (~0.5 us of the ~7 us
#: a logprobs output costs, issue 17). Shapes are few (the chunk size and the
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
