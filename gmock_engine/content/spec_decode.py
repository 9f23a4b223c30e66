"""Speculative decoding, as a verifier's outcome: pure (vLLM:
`vllm/v1/spec_decode/metrics.py` SpecDecodingStats, filled by
`Scheduler.update_from_output`).

No draft model runs here: each step, a decoding request is proposed
min(K, remaining - 1) draft tokens (`--spec-tokens` K; a draft past the
request's planned end could never be emitted) and the verifier accepts
them position by position: draft i with its rate (`--spec-acceptance`)
only if every earlier one was, as rejection sampling does. The request
emits 1 + accepted tokens (the bonus or corrected token, then the accepted
drafts), so its last output and finish stay where request.plan put them.

The draws are a splitmix64 sequence per request, seeded from (seed, rank,
request id): a request's outcome does not depend on what else runs.
`take_stats` gives the SpecDecodingStats map of the drafts since the last
call (§7.1), None when there were none (vLLM's make_spec_decoding_stats
makes none for a step without drafts).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

from gmock_engine.content.tokens import request_seed

_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
#: mixed into the request seed so the acceptance draws are not the token draws
_SALT = 0x5BEC0DE5DEC0DE


def _mix(z: int) -> int:
    """splitmix64's output function."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


class SpecDecode:
    """The verifier of one engine: per-request acceptance draws and the
    SpecDecodingStats counts since the last stats message."""

    def __init__(self, acceptance: Sequence[float], seed: int = 0, rank: int = 0) -> None:
        if not acceptance:
            raise ValueError("speculative decoding needs at least one draft position")
        #: K, vLLM's num_spec_tokens
        self.num_spec_tokens = len(acceptance)
        self.set_acceptance(acceptance)
        self.seed = seed
        self.rank = rank
        #: counts already sent in SpecDecodingStats: drafts, draft tokens, accepted tokens, accepted per position
        self._sent = [0, 0, 0, [0] * self.num_spec_tokens]
        self._reset()

    def set_acceptance(self, acceptance: Sequence[float]) -> None:
        """The per-position rates from the next step on (a reload); K stays."""
        if len(acceptance) != self.num_spec_tokens:
            raise ValueError(f"{len(acceptance)} acceptance rates for {self.num_spec_tokens} draft positions")
        self.acceptance = tuple(float(a) for a in acceptance)
        # draft i is accepted when the 64-bit draw is below rate_i * 2**64
        self._thresholds = tuple(min(int(a * (1 << 64)), 1 << 64) for a in self.acceptance)

    def _reset(self) -> None:
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos: List[int] = [0] * self.num_spec_tokens
        self.draft_per_pos: List[int] = [0] * self.num_spec_tokens

    def next_count(self, request: Any, remaining: int) -> int:
        """Tokens `request` emits this step (1 to remaining): 1 plus the
        drafts the verifier accepts; counted for the stats."""
        drafts = self.num_spec_tokens if self.num_spec_tokens < remaining else remaining - 1
        if drafts <= 0:
            return remaining if remaining < 1 else 1
        state = request.spec_state
        if state is None:
            state = request_seed(self.seed, self.rank, request.request_id) ^ _SALT
        accepted = 0
        thresholds = self._thresholds
        if request.spec_rate is not None:  # vllm_xargs mock_spec_acceptance
            thresholds = (min(int(request.spec_rate * (1 << 64)), 1 << 64),) * self.num_spec_tokens
        while accepted < drafts:
            state = (state + _GOLDEN) & _MASK
            if _mix(state) >= thresholds[accepted]:
                break
            accepted += 1
        request.spec_state = state
        self.num_drafts += 1
        self.num_draft_tokens += drafts
        self.num_accepted_tokens += accepted
        for i in range(accepted):
            self.accepted_per_pos[i] += 1
        for i in range(drafts):
            self.draft_per_pos[i] += 1
        return 1 + accepted

    def take_stats(self) -> Optional[Dict[str, Any]]:
        """The SpecDecodingStats map of the drafts since the last call
        (None: no drafts), then zeroed: the frontends add each message's
        counts to their counters."""
        if not self.num_drafts:
            return None
        sent = self._sent
        sent[0] += self.num_drafts
        sent[1] += self.num_draft_tokens
        sent[2] += self.num_accepted_tokens
        sent[3] = [a + b for a, b in zip(sent[3], self.accepted_per_pos)]
        stats = spec_decoding_stats(
            self.num_spec_tokens,
            self.num_drafts,
            self.num_draft_tokens,
            self.num_accepted_tokens,
            self.accepted_per_pos,
            self.draft_per_pos,
        )
        self._reset()
        return stats


    def totals(self) -> Dict[str, Any]:
        """Every draft since the start (sent or not): the engine's own
        counts, which the frontends' counters reach once stats are sent."""
        sent = self._sent
        return {
            "num_drafts": sent[0] + self.num_drafts,
            "num_draft_tokens": sent[1] + self.num_draft_tokens,
            "num_accepted_tokens": sent[2] + self.num_accepted_tokens,
            "num_accepted_tokens_per_pos": [a + b for a, b in zip(sent[3], self.accepted_per_pos)],
        }


def spec_decoding_stats(
    num_spec_tokens: int,
    num_drafts: int,
    num_draft_tokens: int,
    num_accepted_tokens: int,
    accepted_per_pos: List[int],
    draft_per_pos: List[int],
) -> Dict[str, Any]:
    """vLLM's SpecDecodingStats as the Python frontend decodes it (a
    dataclass: a map by field name; num_spec_tokens has no default;
    num_draft_tokens_per_pos is newer, skipped by frontends without it)."""
    return {
        "num_spec_tokens": num_spec_tokens,
        "num_drafts": num_drafts,
        "num_draft_tokens": num_draft_tokens,
        "num_accepted_tokens": num_accepted_tokens,
        "num_accepted_tokens_per_pos": list(accepted_per_pos),
        "num_draft_tokens_per_pos": list(draft_per_pos),
    }


def acceptance_rates(spec_tokens: int, rates: Sequence[float]) -> tuple:
    """The K per-position rates of --spec-tokens K and --spec-acceptance
    (one rate: the same for every position); () when K is 0. ValueError
    when the count is neither K nor 1."""
    if not spec_tokens:
        return ()
    if len(rates) == 1:
        return tuple(rates) * spec_tokens
    if len(rates) != spec_tokens:
        raise ValueError(f"{len(rates)} acceptance rates for {spec_tokens} draft positions: give {spec_tokens} or 1")
    return tuple(rates)


def expected_tokens_per_step(acceptance: Sequence[float]) -> float:
    """1 + the expected accepted drafts of a step with all K proposed:
    Σ_i Π_{j≤i} rate_j."""
    total, survive = 1.0, 1.0
    for rate in acceptance:
        survive *= rate
        total += survive
    return total
