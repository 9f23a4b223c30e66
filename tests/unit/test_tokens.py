"""tokens.py: the one place tokens are made."""

import collections

from gmock_engine.tokens import RandomTokens, request_seed


def test_seed_is_stable_and_depends_on_every_part():
    assert request_seed(0, 0, "a") == request_seed(0, 0, "a")
    assert len({request_seed(0, 0, "a"), request_seed(1, 0, "a"), request_seed(0, 1, "a"), request_seed(0, 0, "b")}) == 4


def test_draw_is_uniform_enough_and_resumable():
    source = RandomTokens(vocab_size=10, seed=3, rank=0)
    state = source.initial_state("r")
    all_at_once, _ = source.draw(state, 20000)
    counts = collections.Counter(all_at_once)
    assert set(counts) == set(range(10))
    assert max(counts.values()) < 1.1 * 2000 and min(counts.values()) > 0.9 * 2000
    # drawing in chunks gives the same sequence as drawing at once
    chunks, s = [], state
    for n in (1, 4, 15):
        tokens, s = source.draw(s, n)
        chunks.extend(tokens)
    assert chunks == all_at_once[:20]


def test_vocab_of_one():
    tokens, _ = RandomTokens(1, 0, 0).draw(5, 8)
    assert tokens == [0] * 8
