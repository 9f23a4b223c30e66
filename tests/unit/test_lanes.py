"""The output processor's lanes (core/lanes.py): the steady state's short path.

A request past its first output joins a lane and leaves it before its last
output at a step fixed when it joined; whatever takes it out earlier
(abort, preemption, a reload) must leave no trace in the lane books, and
its tokens must be the ones the full path would have made."""

import random

import pytest

from gmock_engine.core.engine import EngineCore, EngineSettings
from gmock_engine.content.tokens import EchoTokens, FileTokens, RandomTokens
from gmock_engine.wire.inputs import AbortRequests, EngineCoreRequest
from gmock_engine.wire.types import FinishReason

from engine_steps import outputs_of, run, tokens_of


def add(rid, max_tokens, client=0, stop=()):
    return EngineCoreRequest(rid, 3, max_tokens, True, client_index=client, stop_token_ids=tuple(stop), prompt_token_ids=[1, 2, 3])


def books(engine):
    s = engine.output_processor
    return s.lanes, s._lane_exits, s._full


def expected(rid, n, chunk=1, rank=0):
    source = RandomTokens(32000, 0, rank)
    return source.draw(source.initial_state(rid), n)[0]


def test_a_lane_makes_every_output_but_the_first_and_the_last():
    engine = EngineCore(EngineSettings(rank=0, num_clients=1))
    engine.apply(add("r", 6))
    sent = engine.step()  # first output: the full path
    lanes, exits, full = books(engine)
    assert "r" in lanes[(0, False, None)] and "r" not in full
    assert [r.request_id for step in exits.values() for r in step] == ["r"]
    sent += run(engine)
    outs = outputs_of(sent, "r")
    assert [len(o) for o in outs] == [len(outs[0]), 2, 2, 2, 2, len(outs[-1])]  # lane outputs are [id, tokens]
    assert outs[-1][5] == FinishReason.LENGTH
    assert tokens_of(sent, "r") == expected("r", 6)
    assert books(engine) == ({}, {}, {})


@pytest.mark.parametrize("chunk", [1, 3, 4])
def test_many_requests_of_mixed_lengths_clients_and_stop_ids_end_exact(chunk):
    rng = random.Random(chunk)
    engine = EngineCore(EngineSettings(rank=0, num_clients=2, output_token_chunk_size=chunk))
    lengths, sent = {}, []
    for i in range(60):
        rid = f"r{i}"
        lengths[rid] = rng.randint(1, 40)
        engine.apply(add(rid, lengths[rid], client=i % 2, stop=(5,) if i % 3 == 0 else ()))
        if i % 7 == 0:
            sent += engine.step()  # requests join while others run
    sent += run(engine)
    for rid, n in lengths.items():
        tokens = tokens_of(sent, rid)
        assert len(tokens) == n, rid
        if int(rid[1:]) % 3 == 0:
            assert 5 not in tokens
        else:
            assert tokens == expected(rid, n), rid
        assert [o[5] for o in outputs_of(sent, rid) if len(o) > 5 and o[5] is not None] == [FinishReason.LENGTH]
    assert books(engine) == ({}, {}, {})


def test_an_aborted_lane_member_leaves_no_trace_and_sends_nothing_more():
    engine = EngineCore(EngineSettings(rank=0, num_clients=1))
    engine.apply(add("a", 100))
    engine.apply(add("b", 100))
    sent = engine.step() + engine.step()
    assert set(engine.output_processor.lanes[(0, False, None)]) == {"a", "b"}
    sent += engine.apply(AbortRequests(["a"]))
    assert set(engine.output_processor.lanes[(0, False, None)]) == {"b"}
    assert [r.request_id for step in engine.output_processor._lane_exits.values() for r in step] == ["b"]
    after = run(engine)
    assert outputs_of(after, "a") == []
    assert tokens_of(sent + after, "b") == expected("b", 100)
    assert books(engine) == ({}, {}, {})


def test_preempted_lane_members_come_back_on_the_full_path_and_end_exact():
    # 6 blocks of 16 tokens: three requests of 3 + 40 tokens cannot all grow
    engine = EngineCore(EngineSettings(rank=0, num_clients=1, block_size=16, kv_blocks=6))
    for rid in ("x", "y", "z"):
        engine.apply(add(rid, 40))
    sent = run(engine)
    assert engine.scheduler.counters["preemptions"] > 0
    for rid in ("x", "y", "z"):
        assert tokens_of(sent, rid) == expected(rid, 40), rid
    assert books(engine) == ({}, {}, {})


def test_a_reload_with_a_new_source_takes_running_requests_out_of_their_lanes():
    engine = EngineCore(EngineSettings(rank=0, num_clients=1))
    engine.apply(add("old", 30))
    sent = engine.step() + engine.step()
    assert "old" in engine.output_processor.lanes[(0, False, None)]
    engine.reconfigure(EngineSettings(rank=0, num_clients=1, token_source=EchoTokens()))
    assert engine.output_processor.lanes == {} and "old" in engine.output_processor._full
    engine.apply(add("new", 6))
    sent += run(engine)
    assert tokens_of(sent, "old") == expected("old", 30)  # its own source throughout
    assert tokens_of(sent, "new") == [1, 2, 3, 1, 2, 3]
    assert books(engine) == ({}, {}, {})


def test_a_lane_slices_a_pool_smaller_than_its_chunk_cyclically():
    source = FileTokens([10, 11, 12], seed=0, rank=0)
    engine = EngineCore(EngineSettings(rank=0, num_clients=1, output_token_chunk_size=4, token_source=source))
    engine.apply(add("r", 400))  # ~100 lane outputs: a position that creeps past the pad shows
    sent = run(engine)
    start = source.initial_state("r")
    assert tokens_of(sent, "r") == [[10, 11, 12][(start + i) % 3] for i in range(400)]


# -- stop ids: every request of a real frontend names its EOS (_all_stop_token_ids)


def _stops_in(rid, n, picks):
    """Ids that the request's unchecked draw really makes (so avoiding them shows)."""
    drawn = expected(rid, n)
    return frozenset(drawn[i] for i in picks)


def test_the_second_request_with_a_stop_set_slices_a_stop_free_pool_and_makes_the_checked_ids():
    stops = _stops_in("b", 300, (7, 100)) | _stops_in("a", 300, (20,))
    engine = EngineCore(EngineSettings(rank=0, num_clients=1))
    engine.apply(add("a", 300, stop=sorted(stops)))
    sent = engine.step()
    engine.apply(add("b", 300, stop=sorted(stops)))
    sent += engine.step() + engine.step()
    lanes = engine.output_processor.lanes
    assert set(lanes[(0, True, None)]) == {"a"}  # the set's first request: the checked loop
    assert set(lanes[(0, stops, None)]) == {"b"}  # its second: the set's own pool
    sent += run(engine)
    source = RandomTokens(32000, 0, 0)
    for rid in ("a", "b"):
        tokens = tokens_of(sent, rid)
        assert tokens == source.avoid(expected(rid, 300), stops), rid
        assert stops.isdisjoint(tokens)
    assert books(engine) == ({}, {}, {})


@pytest.mark.parametrize("chunk", [1, 4])
def test_a_stop_set_pool_gives_the_checked_ids_at_any_chunk_and_position(chunk):
    engine = EngineCore(EngineSettings(rank=0, num_clients=2, output_token_chunk_size=chunk))
    source = RandomTokens(32000, 0, 0)
    # ids the lane outputs of three of the measured requests would make
    stops = _stops_in("s0", 200, (50,)) | _stops_in("s5", 200, (120,)) | _stops_in("s11", 200, (10,))
    for i in range(12):  # across both clients, joining at different steps
        engine.apply(add(f"r{i}", 200, client=i % 2, stop=sorted(stops)))
        engine.step()
    run(engine)  # (the steps above sent the first outputs; start again, now with the pool built)
    sent = []
    for i in range(12):
        engine.apply(add(f"s{i}", 200, client=i % 2, stop=sorted(stops)))
        sent += engine.step()
    assert any(key[1] == stops for key in engine.output_processor.lanes)
    sent += run(engine)
    for i in range(12):
        assert tokens_of(sent, f"s{i}") == source.avoid(expected(f"s{i}", 200), stops)


def test_ids_avoiding_is_the_avoided_slice_at_every_position_and_is_shared():
    for source in (RandomTokens(32000, 5, 0, low=100, high=140), FileTokens([7, 8, 9, 7, 10, 11], seed=0, rank=0)):
        stops = frozenset({7, 120, 139})
        pool = source.ids_avoiding(stops)
        assert source.ids_avoiding(stops) is pool  # built once
        for position in range(source.size):
            for n in (1, 3, 64):
                assert pool[position : position + n] == source.avoid(source.ids[position : position + n], stops)
        assert stops.isdisjoint(pool)


def test_no_stop_free_pool_beyond_the_limits_and_the_checked_loop_is_right(monkeypatch):
    import gmock_engine.core.lanes as lanes_module
    import gmock_engine.content.tokens as tokens_module

    monkeypatch.setattr(tokens_module, "AVOIDING_POOL_LIMIT", 10)
    assert RandomTokens(32000, 0, 0).ids_avoiding(frozenset({1})) is None  # a pool too long to copy
    monkeypatch.undo()
    monkeypatch.setattr(lanes_module, "LANE_POOLS", 1)
    engine = EngineCore(EngineSettings(rank=0, num_clients=1))
    first, second = _stops_in("x", 100, (5,)), _stops_in("y2", 100, (9,))
    sent = []
    for rid, stops in (("x", first), ("x2", first), ("y", second), ("y2", second)):
        engine.apply(add(rid, 100, stop=sorted(stops)))
        sent += engine.step()
    assert set(engine.output_processor._lane_pools) == {first}  # one set at most
    assert "y2" in engine.output_processor.lanes[(0, True, None)]
    sent += run(engine)
    source = RandomTokens(32000, 0, 0)
    for rid, stops in (("x", first), ("x2", first), ("y", second), ("y2", second)):
        assert tokens_of(sent, rid) == source.avoid(expected(rid, 100), stops), rid


def test_a_reload_with_a_new_source_drops_the_stop_free_pools():
    engine = EngineCore(EngineSettings(rank=0, num_clients=1))
    for rid in ("a", "b"):
        engine.apply(add(rid, 50, stop=(5,)))
        engine.step()
    assert engine.output_processor._lane_pools
    engine.reconfigure(EngineSettings(rank=0, num_clients=1, token_source=FileTokens([1, 2, 5, 3], seed=0, rank=0)))
    assert engine.output_processor._lane_pools == {} and engine.output_processor.lanes == {}
    engine.apply(add("c", 20, stop=(5,)))
    assert 5 not in tokens_of(run(engine), "c")
