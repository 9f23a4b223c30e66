"""content/tokens.py: the one place tokens are made.

§N: section N of docs/protocol.md."""

import collections

import pytest

from gmock_engine.content.tokens import RandomTokens, request_seed


def test_seed_is_stable_and_depends_on_every_part():
    assert request_seed(0, 0, "a") == request_seed(0, 0, "a")
    assert len({request_seed(0, 0, "a"), request_seed(1, 0, "a"), request_seed(0, 1, "a"), request_seed(0, 0, "b")}) == 4


@pytest.mark.parametrize("seed, rank, request_id", [(0, 0, "a"), (7, 3, "cmpl-1f-0"), (-5, -1, "token-pool"), (0, 0, ""), (1, 2, "é\0x")])
def test_seed_is_blake2b_of_seed_rank_and_id_whatever_was_asked_before(seed, rank, request_id):
    # request_seed hashes `seed\0rank\0` once per (seed, rank) and copies that
    # state: the seed stays the hash of the whole string, call after call (a
    # state updated in place instead of copied would move on each call)
    import hashlib

    expected = int.from_bytes(hashlib.blake2b(f"{seed}\0{rank}\0{request_id}".encode(), digest_size=8).digest(), "little")
    for other in ("x", request_id, "y"):
        request_seed(seed, rank, other)
    assert request_seed(seed, rank, request_id) == expected
    assert request_seed(seed, rank, request_id) == expected


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


from gmock_engine.content.tokens import EchoTokens, FileTokens, make_source, read_token_file  # noqa: E402


def test_id_range_limits_random_ids():
    source = make_source("random", 32000, 1, 0, (100, 110))
    tokens, _ = source.draw(source.initial_state("r"), 5000)
    assert set(tokens) == set(range(100, 110))


def test_echo_repeats_the_prompt():
    source = EchoTokens()
    state = source.initial_state("r", [5, 6, 7])
    first, state = source.draw(state, 2)
    second, state = source.draw(state, 4)
    assert first + second == [5, 6, 7, 5, 6, 7]
    assert source.draw(source.initial_state("r", None), 3)[0] == [0, 0, 0]


def test_file_ids_cycle_from_a_seeded_offset(tmp_path):
    path = tmp_path / "ids.txt"
    path.write_text("10 11 12\n13\n")
    source = make_source(f"file:{path}", 32000, 0, 0)
    assert isinstance(source, FileTokens)
    tokens, _ = source.draw(source.initial_state("r"), 8)
    assert set(tokens) == {10, 11, 12, 13}
    assert tokens[4:] == tokens[:4]  # cycles
    assert source.draw(source.initial_state("r"), 8)[0] == tokens  # deterministic


@pytest.mark.parametrize("text,reason", [("", "no token ids"), ("1 x 3", "word 2"), ("4 -1", "not a token id"), ("4294967296", "not a token id")])
def test_bad_token_files(tmp_path, text, reason):
    path = tmp_path / "bad.txt"
    path.write_text(text)
    with pytest.raises(ValueError, match=reason):
        read_token_file(str(path))


from gmock_engine.content.tokens import POOL_PAD, RANDOM_POOL_SIZE  # noqa: E402


def test_the_random_pool_is_drawn_once_per_seed_and_range_and_shared_by_the_engines():
    a, b = RandomTokens(32000, 0, 0), RandomTokens(32000, 0, 7)
    assert a.ids is b.ids and len(a.ids) == RANDOM_POOL_SIZE + POOL_PAD
    assert a.ids[RANDOM_POOL_SIZE:] == a.ids[:POOL_PAD]  # the pad repeats the start
    assert RandomTokens(32000, 1, 0).ids != a.ids  # another seed, another pool
    assert a.initial_state("r") != b.initial_state("r")  # the rank moves the offset (§9.2)
    assert 0 <= a.initial_state("r") < RANDOM_POOL_SIZE


@pytest.mark.parametrize("n", [1, 3, POOL_PAD, POOL_PAD + 1, 3 * RANDOM_POOL_SIZE + 5])
def test_draws_wrap_around_the_pool_end_as_one_sequence(n):
    source = RandomTokens(1000, 4, 0)
    near_end = RANDOM_POOL_SIZE - 2
    tokens, state = source.draw(near_end, n)
    assert len(tokens) == n
    whole = source.ids[:RANDOM_POOL_SIZE]
    assert tokens == [whole[(near_end + i) % RANDOM_POOL_SIZE] for i in range(n)]
    assert state == (near_end + n) % RANDOM_POOL_SIZE
    assert source.draw(state, 1)[0] == [whole[state]]


def test_a_file_shorter_than_the_pad_still_cycles_in_every_slice():
    source = FileTokens([10, 11, 12], seed=0, rank=0)
    tokens, state = source.draw(2, 7)
    assert tokens == [12, 10, 11, 12, 10, 11, 12] and state == 0
