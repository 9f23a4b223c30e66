"""Synthetic logprobs (content/logprobs.py) and their wire form (wire.outputs.logprobs_lists):
decoded here with the frontends' rules (Appendix E), and checked for the
self-consistency a client or an evaluation harness can see.

§N: section N of docs/protocol.md."""

import math
import struct

import msgpack
import pytest

from gmock_engine.content import logprobs, tokens
from gmock_engine.core.engine import EngineCore, EngineSettings
from gmock_engine.content.logprobs import LogprobModel
from gmock_engine.wire.eras import WIRE_LAYOUTS
from gmock_engine.wire.inputs import decode_input, EngineCoreRequest, InvalidRequest
from gmock_engine.wire.outputs import logprobs_lists
from gmock_engine.wire.types import FinishReason
from engine_steps import engine_with, run

SIZES = {"<i4": 4, "int32": 4, "<i8": 8, "int64": 8, "<f4": 4, "float32": 4}
FORMATS = {"<i4": "i", "int32": "i", "<i8": "q", "int64": "q", "<f4": "f", "float32": "f"}


def decode_array(wire, tensor):
    """One [dtype, shape, ext 3] triple, as vllm-rs's decoder reads it."""
    dtype, shape, data = wire
    assert isinstance(data, msgpack.ExtType) and data.code == 3
    allowed = ("int32", "int64", "float32") if tensor else ("<i4", "<i8", "<f4")
    assert dtype in allowed, dtype  # Python looks tensor dtypes up in torch by name
    count = 1
    for n in shape:
        count *= n
    assert len(data.data) == count * SIZES[dtype]  # vllm-rs: byte length must match the shape
    return shape, list(struct.unpack(f"<{count}{FORMATS[dtype]}", data.data))


def decode_lists(wire, tensor=False):
    """A LogprobsLists / LogprobsTensors 4-tuple -> rows of (ids, logprobs), ranks."""
    assert len(wire) == 4 and wire[3] is None  # vllm-rs rejects a non-nil cu_num_generated_tokens
    (rows, cols), ids = decode_array(wire[0], tensor)
    shape, lps = decode_array(wire[1], tensor)
    (nranks,), ranks = decode_array(wire[2], tensor)
    assert shape == [rows, cols] and nranks == rows
    assert all(r >= 1 for r in ranks)  # vllm-rs rejects rank 0
    return [(ids[i * cols : (i + 1) * cols], lps[i * cols : (i + 1) * cols]) for i in range(rows)], ranks


def check_row(ids, lps, rank):
    sampled, top_ids, top_lps = ids[0], ids[1:], lps[1:]
    assert len(set(top_ids)) == len(top_ids)  # distinct alternatives
    assert all(lp <= 0 for lp in lps)
    assert all(a >= b for a, b in zip(top_lps, top_lps[1:]))  # non-increasing
    assert sum(math.exp(lp) for lp in {i: lp for i, lp in zip(ids, lps)}.values()) <= 1.0 + 1e-6
    if rank <= len(top_ids):
        assert top_ids[rank - 1] == sampled and top_lps[rank - 1] == lps[0]  # it sits at its own rank
        assert sampled not in top_ids[: rank - 1] + top_ids[rank:]
    else:
        assert sampled not in top_ids and (not top_lps or lps[0] <= top_lps[-1])


def all_outputs(e):
    """Every EngineCoreOutput until idle, in order (each message packs: engine_steps.run)."""
    return [o for _, message in run(e) for o in message[1]]


@pytest.mark.parametrize("k,chunk", [(0, 1), (1, 1), (5, 1), (20, 4), (3, 3)])
def test_every_row_is_self_consistent_and_matches_the_tokens(k, chunk):
    e = engine_with(output_token_chunk_size=chunk)
    e.apply(EngineCoreRequest("r", 4, 40, True, logprobs=k))
    outputs = all_outputs(e)
    assert sum(len(o[1]) for o in outputs) == 40
    for output in outputs:
        rows, ranks = decode_lists(output[2])
        assert [ids[0] for ids, _ in rows] == output[1]  # column 0: the sampled tokens
        assert all(len(ids) == k + 1 for ids, _ in rows)
        for (ids, lps), rank in zip(rows, ranks):
            check_row(ids, lps, rank)


def test_many_positions_stay_consistent_and_ranks_spread():
    model = LogprobModel(top1=0.5, sampled_top1=0.6, low=0, span=1000)
    state, ranks_seen = 1234, []
    for step in range(500):
        width, ids, lps, ranks, state = model.rows(state, [step % 1000], 4)
        rows, ranks = decode_lists(logprobs_lists(1, 5, ids, lps, ranks, ids_width=width))
        check_row(*rows[0], ranks[0])
        ranks_seen += ranks
    share_top1 = ranks_seen.count(1) / len(ranks_seen)
    assert 0.5 < share_top1 < 0.7 and max(ranks_seen) > 5  # about --logprobs-sampled-top1, with a tail


def test_the_options_shape_the_distribution():
    def mean_top1_logprob(top1):
        model, state, total = LogprobModel(top1=top1, sampled_top1=1.0), 7, 0.0
        for _ in range(300):
            _, _, lps, _, state = model.rows(state, [1], 1)
            total += struct.unpack("<2f", lps)[1]
        return total / 300

    assert mean_top1_logprob(0.9) > mean_top1_logprob(0.5) > mean_top1_logprob(0.1)
    for sampled_top1, expected in ((1.0, {1}), (0.0, None)):
        model, state, ranks = LogprobModel(sampled_top1=sampled_top1), 9, set()
        for _ in range(200):
            _, _, _, packed, state = model.rows(state, [3], 2)
            ranks.add(struct.unpack("<q", packed)[0])
        assert ranks == expected if expected else 1 not in ranks


def test_logprobs_are_deterministic_per_seed_rank_and_request():
    def first_rows(seed, rank, rid):
        e = EngineCore(EngineSettings(rank=rank, num_clients=1, seed=seed))
        e.apply(EngineCoreRequest(rid, 4, 5, True, logprobs=3))
        return [decode_lists(o[2]) for o in all_outputs(e)]

    assert first_rows(1, 0, "a") == first_rows(1, 0, "a")
    assert first_rows(1, 0, "a") != first_rows(1, 0, "b") != first_rows(2, 0, "b")
    assert first_rows(1, 0, "a") != first_rows(1, 1, "a")


def test_prompt_logprobs_once_with_the_first_output():
    e = engine_with()
    prompt = [11, 12, 13, 14, 15]
    e.apply(EngineCoreRequest("p", 5, 3, True, prompt_token_ids=prompt, prompt_logprobs=2))
    outputs = all_outputs(e)
    first, later = outputs[0], outputs[1:]
    rows, ranks = decode_lists(first[3], tensor=True)
    assert [ids[0] for ids, _ in rows] == prompt[1:]  # one row per position after the first
    for (ids, lps), rank in zip(rows, ranks):
        check_row(ids, lps, rank)
    assert all(len(o) < 4 or o[3] is None for o in later)
    assert all(len(o) < 3 or o[2] is None for o in outputs)  # no sample logprobs were asked


def test_requests_that_ask_for_nothing_get_nothing():
    e = engine_with()
    e.apply(EngineCoreRequest("plain", 4, 5, True))
    outputs = all_outputs(e)
    assert all(o[2] is None for o in outputs if len(o) > 2) and len(outputs[1]) == 2  # running shape [id, tokens]


def test_ids_beyond_int32_go_as_int64():
    model = LogprobModel(low=2**32 - 100, span=100)
    width, ids, lps, ranks, _ = model.rows(5, [2**32 - 1], 2)
    rows, _ = decode_lists(logprobs_lists(1, 3, ids, lps, ranks, ids_width=width))
    assert width == "i8" and rows[0][0][0] == 2**32 - 1


def test_bad_logprob_counts_are_refused():
    frames = [b"\x00", msgpack.packb(["r", [1], None, {"logprobs": -1}, None] + [None] * 6 + [0])]
    message = decode_input(frames, WIRE_LAYOUTS["0.33"])
    assert isinstance(message, InvalidRequest) and "logprobs -1" in message.reason
    frames = [b"\x00", msgpack.packb(["r", [1], None, {"prompt_logprobs": 5000}, None] + [None] * 6 + [0])]
    assert "prompt_logprobs 5000" in decode_input(frames, WIRE_LAYOUTS["0.33"]).reason
    e = engine_with(vocab_size=10)
    [(_, message)] = e.apply(EngineCoreRequest("big", 4, 5, True, logprobs=10))
    assert message[1][0][5] == FinishReason.ERROR and "only 10 distinct token ids" in message[1][0][18]["message"]


# -- sampling controls: allowed_token_ids, bad words, logit_bias ---------------------


def tokens_and_rows(request, **settings):
    e = engine_with(**settings)
    e.apply(request)
    outputs = all_outputs(e)
    tokens = [t for o in outputs for t in o[1]]
    rows = [r for o in outputs if len(o) > 2 and o[2] for r in zip(*decode_lists(o[2]))]
    return tokens, rows, outputs


def test_allowed_token_ids_are_the_only_ids_drawn_and_the_alternatives_come_from_them():
    allowed = (1, 2, 3)
    tokens, rows, _ = tokens_and_rows(EngineCoreRequest("a", 4, 200, True, allowed_token_ids=allowed, logprobs=5))
    assert len(tokens) == 200 and set(tokens) == set(allowed)  # all three show up, nothing else
    for (ids, lps), rank in rows:
        check_row(ids, lps, rank)
        top = ids[1:]
        assert set(top[:3]) == set(allowed) and all(lp == -9999.0 for lp in lps[4:])  # the rest: impossible ids
        assert not set(top[3:]) & set(allowed)


def test_allowed_ids_without_the_stop_ids_and_eos():
    tokens, _, outputs = tokens_and_rows(
        EngineCoreRequest("a", 4, 50, True, allowed_token_ids=(5, 6, 7), stop_token_ids=(6,), eos_token_id=7, all_stop_token_ids=(7,))
    )
    assert set(tokens) == {5} and outputs[-1][5] == FinishReason.LENGTH
    tokens, _, outputs = tokens_and_rows(EngineCoreRequest("b", 4, 50, True, allowed_token_ids=(6, 7), stop_token_ids=(6,), eos_token_id=7))
    assert len(tokens) == 1 and outputs[-1][5] == FinishReason.STOP  # every allowed id stops: the first token stops


def test_logit_bias_minus_100_and_bad_words_ban_and_plus_100_forces():
    tokens, _, _ = tokens_and_rows(
        EngineCoreRequest("b", 4, 500, True, logit_bias={i: -100.0 for i in range(5)}, bad_words_token_ids=((8, 9), (7,))),
        vocab_size=12,
    )
    assert set(tokens) == {5, 6, 8, 10, 11}  # 0-4 biased away, 7 and the last id of (8, 9) banned
    tokens, rows, _ = tokens_and_rows(EngineCoreRequest("f", 4, 20, True, logit_bias={17: 100.0, 3: 5.0}, logprobs=2))
    assert set(tokens) == {17}
    for (ids, lps), rank in rows:
        assert rank == 1 and ids[0] == ids[1] == 17 and lps[0] > -1e-5  # almost certain
        check_row(ids, lps, rank)


def test_a_bias_on_every_id_cancels_out():
    tokens, _, _ = tokens_and_rows(EngineCoreRequest("c", 4, 300, True, logit_bias={i: -100.0 for i in range(20)}), vocab_size=20)
    assert len(tokens) == 300 and len(set(tokens)) > 10  # as vLLM: equal biases change nothing


def test_banned_ids_never_appear_among_the_alternatives():
    _, rows, _ = tokens_and_rows(EngineCoreRequest("d", 4, 100, True, logit_bias={i: -100.0 for i in range(40)}, logprobs=10), vocab_size=60)
    for (ids, lps), rank in rows:
        check_row(ids, lps, rank)
        assert not set(ids) & set(range(40))


# -- pre-drawn rows (logprobs.RowPool) -----------------------------------------------


def pool_rows(pool, position, n):
    ids, lps, ranks = pool.take(position, pool.ids[position : position + n])
    return decode_lists(logprobs_lists(n, pool.k + 1, bytes(ids), bytes(lps), bytes(ranks)))


def test_pooled_rows_are_consistent_at_every_position_and_the_tail_repeats_the_head():
    source = tokens.RandomTokens(300, seed=3, rank=0)
    model = LogprobModel(low=0, span=300)
    pool = model.pooled(source, 4)
    assert pool is not None and pool is model.pooled(source, 4)
    size = source.size
    for position in (0, 255, 256, 4000, size - 3, size - 1):  # block edges, the wrap into the padded tail
        rows, ranks = pool_rows(pool, position, 4)
        assert [ids[0] for ids, _ in rows] == source.ids[position : position + 4]
        for (ids, lps), rank in zip(rows, ranks):
            check_row(ids, lps, rank)
    # the tail's rows are the head's, so a wrapped request reads what it would at 0, 1, ...
    assert pool_rows(pool, size - 1, 3)[0][1:] == pool_rows(pool, 0, 2)[0]
    assert pool.take(5, [source.ids[5] + 1]) is None  # not the pool's ids there: drawn instead


def test_pooled_rows_do_not_depend_on_the_order_blocks_are_drawn():
    source = tokens.RandomTokens(1000, seed=1, rank=0)
    forward = LogprobModel(low=0, span=1000).pooled(source, 3)
    logprobs._row_pools.clear()
    backward = LogprobModel(low=0, span=1000).pooled(source, 3)
    assert forward is not backward
    positions = [10, 300, 700, 5000]
    first = [pool_rows(forward, p, 2) for p in positions]
    second = [pool_rows(backward, p, 2) for p in reversed(positions)][::-1]
    assert first == second


def test_row_pools_are_shared_and_bounded_and_a_stale_one_makes_room(monkeypatch):
    logprobs._row_pools.clear()
    source = tokens.RandomTokens(500, seed=0, rank=0)
    other_engine = tokens.RandomTokens(500, seed=0, rank=1)  # the same pool: one RowPool for both
    assert LogprobModel(span=500).pooled(source, 2) is LogprobModel(span=500).pooled(other_engine, 2)
    # room for three RowPools at k 2
    monkeypatch.setattr(logprobs, "ROW_POOL_BYTES", 3 * logprobs.RowPool.bytes_for(len(source.ids), 2))
    model = LogprobModel(span=500)
    copy = source.ids_avoiding(frozenset({source.ids[0]}))  # a stop-free copy: rows of its own
    assert model.pooled(source, 2, copy) not in (None, model.pooled(source, 2))
    assert model.pooled(source, 1) is not None
    assert model.pooled(source, 3) is None  # full: k 3 is drawn per token, no pool of this source evicted
    assert model.pooled(source, 2) is not None and model.pooled(source, 2, copy) is not None
    reloaded = tokens.RandomTokens(500, seed=7, rank=0)  # a reload's new pool: the stale ones make room
    assert LogprobModel(span=500).pooled(reloaded, 2) is not None
    assert list(logprobs._row_pools.values())[-1][0] is reloaded.ids and len(logprobs._row_pools) == 1
    assert logprobs._row_pool_bytes() <= logprobs.ROW_POOL_BYTES
    assert model.pooled(source, logprobs.ROW_POOL_MAX_K + 1) is None
    assert model.pooled(tokens.EchoTokens(), 2) is None
    wide = tokens.RandomTokens(2**32, seed=0, rank=0, low=2**32 - 100)
    assert LogprobModel(low=2**32 - 100, span=100).pooled(wide, 2) is None  # an id beyond int32: drawn as int64
    logprobs._row_pools.clear()


def test_an_engine_takes_pooled_rows_and_draws_those_the_pool_does_not_hold(monkeypatch):
    logprobs._row_pools.clear()
    drawn = []
    rows = LogprobModel.rows

    def counting(self, state, sampled, k, *args, **kwargs):
        drawn.append(len(sampled))
        return rows(self, state, sampled, k, *args, **kwargs)

    monkeypatch.setattr(LogprobModel, "rows", counting)
    e = engine_with(output_token_chunk_size=2)
    e.apply(EngineCoreRequest("r", 4, 40, True, logprobs=3))
    outputs = all_outputs(e)
    # the pool's blocks (ROW_BLOCK positions each) and nothing per token
    assert drawn and all(n == logprobs.ROW_BLOCK for n in drawn)
    # the EOS planned as its last token is not the pool's id there: that chunk is drawn
    drawn.clear()
    e.apply(EngineCoreRequest("s", 4, 40, True, logprobs=3, eos_token_id=1, all_stop_token_ids=(1,), extra_args={"mock_output_len": 9}))
    stopped = all_outputs(e)
    assert stopped[-1][5] == FinishReason.STOP and stopped[-1][1][-1] == 1
    # its last chunk (chunk 2, 9 tokens: the EOS alone) drawn; before it, at most a block of its offset
    assert drawn[-1] == 1 and all(n == logprobs.ROW_BLOCK for n in drawn[:-1])
    outputs += stopped
    for output in outputs:
        got, ranks = decode_lists(output[2])
        assert [ids[0] for ids, _ in got] == output[1]
        for (ids, lps), rank in zip(got, ranks):
            check_row(ids, lps, rank)
