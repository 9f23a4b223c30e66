"""The pure engine: step, finish, determinism, aborts, utilities (no sockets).

§N: section N of docs/protocol.md."""

import pytest

from gmock_engine.core.engine import EngineCore, EngineSettings
from gmock_engine.wire.inputs import AbortRequests, EngineCoreRequest, StartDPWave, UtilityCall
from gmock_engine.wire.outputs import engine_core_output
from gmock_engine.wire.types import FinishReason
from engine_steps import TickClock, engine_with, outputs_of, run, tokens_of


def make(chunk=1, clients=2, seed=0, rank=0, vocab=32000):
    return engine_with(TickClock(), rank=rank, num_clients=clients, output_token_chunk_size=chunk, seed=seed, vocab_size=vocab)


def add(rid, max_tokens=16, client=0, sampling=True, **kw):
    return EngineCoreRequest(
        request_id=rid,
        prompt_len=3,
        max_tokens=max_tokens if sampling else None,
        has_sampling_params=sampling,
        client_index=client,
        **kw,
    )


def finished_of(sent):
    return [r for _, m in sent if len(m) > 5 and m[5] for r in m[5]]


@pytest.mark.parametrize("max_tokens,chunk,sizes", [(3, 1, [1, 1, 1]), (6, 4, [4, 2]), (8, 4, [4, 4]), (1, 5, [1])])
def test_chunks_and_length_finish(max_tokens, chunk, sizes):
    engine = make(chunk=chunk)
    assert engine.apply(add("r", max_tokens)) == []
    sent = run(engine)
    outs = outputs_of(sent, "r")
    assert [len(o[1]) for o in outs] == sizes
    assert all(len(o) == 2 for o in outs[1:-1])  # later running outputs: [id, tokens]
    assert all(len(o) <= 5 or o[5] is None for o in outs[:-1])  # no finish before the last
    assert outs[-1][5] == FinishReason.LENGTH
    assert finished_of(sent) == ["r"]
    assert engine.num_active == 0 and not engine.has_work
    assert engine.ledger.summary().get("finished_length", 0) == 1


def test_tokens_in_vocab_and_deterministic_per_seed():
    def tokens(seed, rank=0, rid="req-1", other=False):
        engine = make(seed=seed, rank=rank, vocab=50)
        engine.apply(add(rid, 200))
        if other:  # interleaving with another request must not change them
            engine.apply(add("zzz", 100))
        return tokens_of(run(engine), rid)

    base = tokens(7)
    assert len(base) == 200 and all(0 <= t < 50 for t in base)
    assert len(set(base)) > 30  # not constant
    assert tokens(7) == base
    assert tokens(7, other=True) == base
    assert tokens(8) != base
    assert tokens(7, rank=1) != base
    assert tokens(7, rid="req-2") != base


def test_one_message_per_client_per_step_with_its_finished_requests():
    engine = make()
    engine.apply(add("a", 2, client=0))
    engine.apply(add("b", 1, client=0))
    engine.apply(add("c", 2, client=1))
    first = engine.step()
    assert sorted(c for c, _ in first) == [0, 1]
    by_client = dict(first)
    assert [o[0] for o in by_client[0][1]] == ["a", "b"]
    assert by_client[0][5] == ["b"] and len(by_client[1]) == 4  # no finished -> 4 elements
    assert by_client[0][0] == 0 and isinstance(by_client[0][3], float)
    second = dict(engine.step())
    assert second[0][5] == ["a"] and second[1][5] == ["c"]
    assert engine.step() == []


def test_max_tokens_zero_nil_sampling_and_duplicate():
    engine = make()
    [(client, msg)] = engine.apply(add("zero", 0, client=1))
    assert client == 1 and msg[1] == [["zero", [], None, None, None, FinishReason.LENGTH]] and msg[5] == ["zero"]

    [(_, msg)] = engine.apply(add("pool", sampling=False))
    assert msg[1][0][5] == FinishReason.ERROR and msg[5] == ["pool"]

    engine.apply(add("dup", 5))
    [(_, msg)] = engine.apply(add("dup", 5))
    assert msg[1][0][5] == FinishReason.ERROR and msg[5] == ["dup"]
    sent = run(engine)
    assert len(tokens_of(sent, "dup")) == 5  # the original goes on


def test_abort_immediately_sends_only_finished_requests():
    engine = make()
    [(_, msg)] = engine.apply(add("x", 5, abort_immediately=True))
    assert msg[1] == [] and msg[5] == ["x"]
    assert engine.num_active == 0


def test_abort_active_and_unknown_ids():
    engine = make()
    engine.apply(add("a", 100, client=0))
    engine.apply(add("b", 100, client=1))
    engine.step()
    sent = engine.apply(AbortRequests(["a", "unknown", "b"]))
    assert sorted(c for c, _ in sent) == [0, 1]
    for _, msg in sent:
        [out] = msg[1]
        assert out[1] == [] and out[5] == FinishReason.ABORT and msg[5] == [out[0]]
    assert engine.num_active == 0 and engine.ledger.summary().get("finished_abort", 0) == 2
    assert engine.apply(AbortRequests(["a"])) == []  # already gone


def test_client_index_beyond_the_output_sockets_is_dropped():
    engine = make(clients=1)
    assert engine.apply(add("r", 3, client=1)) == []
    assert engine.num_active == 0 and engine.counters["rejected"] == 1
    assert engine.apply(UtilityCall(4, 1, "is_sleeping", [])) == []


def test_start_dp_wave_is_ignored():
    engine = make()
    engine.apply(add("r", 2))
    assert engine.apply(StartDPWave(3, None)) == []
    assert len(tokens_of(run(engine), "r")) == 2


def call(engine, method, *args, client=0, call_id=99):
    return engine.apply(UtilityCall(client, call_id, method, list(args)))


def reply(sent, call_id=99):
    [out] = [m[4] for _, m in sent if len(m) > 4 and m[4] is not None and m[4][0] == call_id]
    return out


@pytest.mark.parametrize(
    "method,args,value",
    [
        ("get_supported_tasks", [], ["generate"]),
        ("is_sleeping", [], False),
        ("is_scheduler_paused", [], False),
        ("reset_prefix_cache", [False, False], True),
        ("reset_mm_cache", [], None),
        ("reset_encoder_cache", [], None),
        ("profile", [True], None),
        ("execute_dummy_batch", [], None),
        ("wake_up", [None], True),
        ("list_loras", [], []),
    ],
)
def test_utility_answers(method, args, value):
    engine = make()
    sent = call(engine, method, *args, client=1, call_id=2**64 - 1)
    assert [c for c, _ in sent] == [1]
    assert reply(sent, 2**64 - 1) == [2**64 - 1, None, [None, value]]
    assert sent[0][1][1] == []  # utility family: no request outputs


def test_gmock_stats_restarts_the_window_only_when_asked():
    """gmock_stats(True) hands the window's figures to the runtime's provider
    with restart_window=True (the bench driver's measured window); any other
    argument fails that call only and restarts nothing."""
    engine = make()
    asked = []
    engine.stats_provider = lambda restart_window=False: asked.append(restart_window) or {"x": 1}
    assert reply(call(engine, "gmock_stats"))[2][1]["x"] == 1
    assert reply(call(engine, "gmock_stats", True))[2][1]["x"] == 1
    answer = reply(call(engine, "gmock_stats", "yes"))
    assert answer[2] is None and "must be a bool" in answer[1]
    assert asked == [False, True]


def test_samples_restart_summarises_the_new_window_only():
    from gmock_engine.utils.stats import Samples

    samples = Samples(size=4)
    for value in (100.0, 200.0, 300.0):
        samples.add(value)
    samples.restart()
    assert samples.summary()["count"] == 0 and samples.summary()["total"] == 3
    for value in (1.0, 2.0, 3.0, 4.0, 5.0):  # past the ring's size: the most recent 4
        samples.add(value)
    summary = samples.summary()
    assert (summary["count"], summary["max"], summary["p50"], summary["total"]) == (4, 5.0, 3.0, 8)


def test_unknown_utility_fails_with_its_name():
    sent = call(make(), "frobnicate")
    answer = reply(sent)
    assert answer[2] is None and "frobnicate" in answer[1]


@pytest.mark.parametrize("method", ["pause_generation", "pause_scheduler", "sleep"])
def test_pause_and_sleep_in_abort_mode_end_every_stream(method):
    engine = make()
    engine.apply(add("a", 100, client=0))
    engine.apply(add("b", 100, client=1))
    engine.step()
    args = [1, "abort"] if method == "sleep" else ["abort", True]
    sent = call(engine, method, *args)
    aborted = {o[0]: o[5] for _, m in sent for o in m[1]}
    assert aborted == {"a": FinishReason.ABORT, "b": FinishReason.ABORT}
    assert sorted(finished_of(sent)) == ["a", "b"]
    assert reply(sent)[1] is None  # answered, once
    assert engine.num_active == 0
    assert reply(call(engine, "is_scheduler_paused", call_id=5), 5)[2][1] is True
    assert reply(call(engine, "is_sleeping", call_id=6), 6)[2][1] is True


def test_paused_generation_rejects_adds_until_resume():
    engine = make()
    call(engine, "pause_generation", "abort", True)
    [(_, msg)] = engine.apply(add("new", 3))
    out = msg[1][0]
    assert out[5] == FinishReason.ERROR and out[18]["code"] == "engine_paused" and out[18]["retryable"] is True
    call(engine, "resume_scheduler")
    engine.apply(add("after", 3))
    assert len(tokens_of(run(engine), "after")) == 3


def test_pause_scheduler_holds_new_requests_until_resume():
    engine = make()
    call(engine, "pause_scheduler", "abort", True)
    assert engine.apply(add("held", 3)) == []
    assert not engine.has_work and engine.num_active == 1
    call(engine, "resume_scheduler")
    assert len(tokens_of(run(engine), "held")) == 3


def test_keep_mode_freezes_and_resume_continues():
    engine = make()
    engine.apply(add("k", 4))
    engine.step()
    sent = call(engine, "pause_generation", "keep", False)
    assert reply(sent)[2] == [None, None]
    assert not engine.has_work and engine.step() == []
    assert engine.next_step_time(1.0) is None  # no step due while frozen: the stepper sleeps
    assert engine.apply(add("new", 2)) == []  # keep mode holds, does not reject
    call(engine, "resume_scheduler")
    assert engine.next_step_time(1.0) == 1.0  # unpaced: due at once
    sent = run(engine)
    assert len(tokens_of(sent, "k")) == 3 and len(tokens_of(sent, "new")) == 2


def test_wait_mode_answers_when_drained():
    engine = make()
    engine.apply(add("w", 3))
    first = engine.step()  # admitted and running
    sent = call(engine, "pause_generation", "wait", True)
    assert sent == []  # not answered yet: a request is still running
    sent = first + run(engine)
    assert len(tokens_of(sent, "w")) == 3
    assert reply(sent)[2] == [None, None]
    [(_, msg)] = engine.apply(add("late", 3))  # wait mode rejects new ADDs
    assert msg[1][0][5] == FinishReason.ERROR


def test_sleep_then_wake_up_resumes():
    engine = make()
    call(engine, "sleep", 1)
    assert engine.apply(add("s", 2)) == []  # held while asleep
    assert reply(call(engine, "is_sleeping", call_id=3), 3)[2][1] is True
    assert reply(call(engine, "wake_up", ["kv_cache"], call_id=4), 4)[2][1] is True
    assert reply(call(engine, "is_sleeping", call_id=5), 5)[2][1] is False
    assert len(tokens_of(run(engine), "s")) == 2


def test_invalid_pause_mode_fails_the_call():
    engine = make()
    engine.apply(add("r", 5))
    answer = reply(call(engine, "pause_generation", "sideways"))
    assert "sideways" in answer[1] and engine.num_active == 1


RS_FE_REQUIRED_STATS = {
    "num_running_reqs",
    "num_waiting_reqs",
    "step_counter",
    "current_wave",
    "kv_cache_usage",
    "prefix_cache_stats",
    "kv_cache_eviction_events",
}


def test_scheduler_stats_follow_running_and_drop_to_zero():
    engine = EngineCore(EngineSettings(rank=2, num_clients=2, num_gpu_blocks=10, block_size=16), clock=TickClock())
    engine.apply(add("a", 3, client=1))
    engine.apply(add("b", 2, client=0))
    first = engine.step()
    stats = [m[2] for _, m in first if m[2] is not None]
    assert len(stats) == 1  # on one client's message per step (§4.1)
    assert first[0][1][2] is stats[0]
    assert RS_FE_REQUIRED_STATS <= set(stats[0])
    assert set(stats[0]["prefix_cache_stats"]) >= {"reset", "requests", "queries", "hits", "preempted_requests", "preempted_queries", "preempted_hits"}
    assert stats[0]["num_running_reqs"] == 2 and stats[0]["num_waiting_reqs"] == 0
    # KV: (3 + 1) + (3 + 1) tokens of 160
    assert stats[0]["kv_cache_usage"] == pytest.approx(8 / 160)
    sent = run(engine)
    last = [m[2] for _, m in sent if m[2] is not None][-1]
    assert last["num_running_reqs"] == 0 and last["kv_cache_usage"] == 0.0
    assert engine.kv_tokens == 0


def test_stats_also_go_to_the_coordinator():
    engine = EngineCore(EngineSettings(rank=1, num_clients=1, has_coordinator=True), clock=TickClock())
    engine.apply(add("a", 2))
    sent = engine.step()
    coordinator = [m for c, m in sent if c == -1]
    assert len(coordinator) == 1
    assert coordinator[0][0] == 1 and coordinator[0][1] == [] and coordinator[0][2]["num_running_reqs"] == 1
    assert len(coordinator[0]) == 4  # stats only: no outputs, no utility (§6.2)


def test_requests_added_while_paused_count_as_waiting_and_aborts_free_kv():
    engine = make()
    engine.apply(add("run", 100))
    engine.step()
    call(engine, "pause_generation", "keep", False)
    engine.apply(add("wait", 5))
    assert engine.scheduler_stats()["num_waiting_reqs"] == 1
    assert engine.scheduler_stats()["num_running_reqs"] == 1
    engine.apply(AbortRequests(["run", "wait"]))
    assert engine.kv_tokens == 0 and engine.num_active == 0


def test_first_output_carries_queued_scheduled_events_and_prefill_stats():
    engine = make()
    engine.apply(EngineCoreRequest(request_id="e", prompt_len=42, max_tokens=3, has_sampling_params=True))
    sent = run(engine)
    first, second = outputs_of(sent, "e")[:2]
    events = first[7]
    assert [e["type"] for e in events] == [1, 2]  # QUEUED, SCHEDULED
    queued, scheduled = events[0]["timestamp"], events[1]["timestamp"]
    message_ts = [m[3] for _, m in sent if m[1] and m[1][0][0] == "e"][0]
    assert 0 < queued <= scheduled <= message_ts  # one clock, in order (§4.5)
    assert first[11]["num_prompt_tokens"] == 42 and first[11]["num_computed_tokens"] == 42
    assert len(first) == 12  # ends with prefill_stats: nothing past index 11
    assert len(second) == 2


def test_a_one_token_request_gets_events_and_finish_in_one_output():
    engine = make()
    engine.apply(add("one", 1))
    [out] = outputs_of(run(engine), "one")
    assert out[5] == FinishReason.LENGTH and [e["type"] for e in out[7]] == [1, 2]


def test_echo_source_through_the_engine():
    from gmock_engine.content.tokens import EchoTokens

    engine = EngineCore(EngineSettings(rank=0, num_clients=1, token_source=EchoTokens()), clock=TickClock())
    engine.apply(EngineCoreRequest("e", 3, 5, True, prompt_token_ids=[7, 8, 9]))
    assert tokens_of(run(engine), "e") == [7, 8, 9, 7, 8]


def test_running_outputs_have_the_protocol_shape():
    engine = make()
    engine.apply(add("shape", 4))
    outputs = outputs_of(run(engine), "shape")
    for output in outputs[1:-1]:
        assert output == engine_core_output("shape", output[1])
