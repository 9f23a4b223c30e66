"""Scheduler and latency model on a virtual clock (no wall-clock assertions)."""

import pytest

from gmock_engine.timing.latency import LatencyModel
from gmock_engine.wire.inputs import AbortRequests, EngineCoreRequest, UtilityCall
from gmock_engine.wire.types import FinishReason
from engine_steps import Clock, drive, engine_with


def request(rid, max_tokens=4, prompt_len=8, priority=0):
    return EngineCoreRequest(rid, prompt_len, max_tokens, True, priority=priority)


def first_token_times(sent):
    seen = {}
    for t, message in sent:
        for output in message[1]:
            if output[1] and output[0] not in seen:
                seen[output[0]] = t
    return seen


def test_max_num_seqs_keeps_the_rest_waiting_fcfs():
    clock = Clock(1000.0)
    engine = engine_with(clock, max_num_seqs=2)
    for i in range(5):
        engine.apply(request(f"r{i}", max_tokens=3))
    first = engine.step()
    stats = first[0][1][2]
    assert stats["num_running_reqs"] == 2 and stats["num_waiting_reqs"] == 3
    assert [o[0] for o in first[0][1][1]] == ["r0", "r1"]
    sent = [(clock.now, m) for _, m in first] + drive(engine, clock)
    order = sorted(first_token_times(sent), key=lambda rid: list(first_token_times(sent)).index(rid))
    assert order == ["r0", "r1", "r2", "r3", "r4"]
    running = [m[2]["num_running_reqs"] for _, m in sent if m[2] is not None]
    assert max(running) == 2 and running[-1] == 0
    assert engine.ledger.summary().get("finished_length", 0) == 5


def test_priority_policy_admits_lower_priority_values_first():
    clock = Clock(1000.0)
    engine = engine_with(clock, max_num_seqs=1, scheduling_policy="priority")
    for rid, priority in [("late-low", 5), ("urgent", -1), ("mid-a", 2), ("mid-b", 2)]:
        engine.apply(request(rid, max_tokens=1, priority=priority))
    order = list(first_token_times(drive(engine, clock)))
    assert order == ["urgent", "mid-a", "mid-b", "late-low"]


def test_abort_of_a_waiting_request_with_priority_policy():
    clock = Clock(1000.0)
    engine = engine_with(clock, max_num_seqs=1, scheduling_policy="priority")
    engine.apply(request("a", 2))
    engine.apply(request("b", 2, priority=-3))
    [(_, message)] = engine.apply(AbortRequests(["b"]))
    assert message[1][0][5] == FinishReason.ABORT and message[5] == ["b"]
    assert list(first_token_times(drive(engine, clock))) == ["a"]


def test_ttft_prefill_and_itl_on_the_engine_clock():
    clock = Clock(1000.0)
    latency = LatencyModel(itl_ms=10, ttft_ms=100, prefill_ms_per_token=1)
    engine = engine_with(clock, latency=latency)
    engine.apply(EngineCoreRequest("r", 50, 4, True))
    sent = drive(engine, clock)
    stamps = [m[3] for _, m in sent]
    # scheduled at 1000.0; first token after ttft 100 ms + 50 tokens x 1 ms
    assert stamps[0] == pytest.approx(1000.150)
    assert [round(b - a, 6) for a, b in zip(stamps, stamps[1:])] == [0.010] * 3
    events = sent[0][1][1][0][7]
    assert events[1]["timestamp"] == pytest.approx(1000.0)  # SCHEDULED


def test_prefill_lengthens_the_step_for_the_running_batch():
    clock = Clock(0.0)
    engine = engine_with(clock, latency=LatencyModel(itl_ms=10, prefill_ms_per_token=2))
    engine.apply(EngineCoreRequest("old", 0, 100, True))
    engine.step()  # t=0: "old" admitted (no prompt) and emits
    clock.now = engine.next_step_time(0.0)
    assert clock.now == pytest.approx(0.010)
    engine.apply(EngineCoreRequest("new", 30, 5, True))
    engine.step()  # "new" admitted: its 30 prompt tokens cost 60 ms of this step
    assert engine.step_delay == pytest.approx(0.010 + 0.060)


def test_batch_size_load_and_time_scale():
    clock = Clock(0.0)
    engine = engine_with(clock, latency=LatencyModel(itl_ms=10, itl_ms_per_request=2, time_scale=0.5))
    for i in range(5):
        engine.apply(EngineCoreRequest(f"r{i}", 0, 100, True))
    engine.step()
    assert engine.step_delay == pytest.approx((10 + 2 * 5) * 0.5 / 1000)


def test_jitter_is_bounded_and_seeded():
    def delays(seed):
        clock = Clock(0.0)
        engine = engine_with(clock, seed=seed, latency=LatencyModel(itl_ms=10, jitter=0.2))
        engine.apply(EngineCoreRequest("r", 0, 50, True))
        out = []
        while engine.has_work:
            engine.step()
            out.append(engine.step_delay)
        return out

    first = delays(1)
    assert all(0.008 <= d <= 0.012 for d in first) and len(set(first)) > 10
    assert delays(1) == first and delays(2) != first


def test_no_busy_steps_while_everything_prefills():
    """Only a long TTFT pending: the next step is when it is ready, not now."""
    clock = Clock(0.0)
    engine = engine_with(clock, latency=LatencyModel(ttft_ms=500))
    engine.apply(EngineCoreRequest("slow", 4, 2, True))
    assert engine.step() == []  # admitted, prefilling, nothing to send
    assert engine.next_step_time(0.0) == pytest.approx(0.5)
    clock.now = 0.5
    drive(engine, clock)
    # t=0 admit; t=0.5 first token; then (itl 0) the second token at once
    assert engine.counters["steps"] == 3 and engine.ledger.summary().get("finished_length", 0) == 1


def test_pause_keeps_waiting_requests_waiting():
    clock = Clock(1000.0)
    engine = engine_with(clock, max_num_seqs=1)
    engine.apply(request("a", 50))
    engine.apply(request("b", 50))
    engine.step()
    engine.apply(UtilityCall(0, 1, "pause_scheduler", ["wait", False]))
    assert engine.scheduler_stats()["num_waiting_reqs"] == 1
    drive(engine, clock)  # "a" runs to its end; "b" is not admitted while paused
    assert "b" in engine.waiting and not engine.active
    engine.apply(UtilityCall(0, 2, "resume_scheduler", []))
    drive(engine, clock)
    assert engine.num_active == 0 and engine.ledger.summary().get("finished_length", 0) == 2


# -- KV blocks, preemption, chunked prefill ----------------------------------------


def outputs_by_request(sent):
    out = {}
    for _, message in sent:
        for output in message[1]:
            out.setdefault(output[0], []).append(output)
    return out


def test_kv_blocks_limit_admission_and_usage():
    clock = Clock(1000.0)
    # 4 blocks of 16 tokens; prompts of 20 tokens need 2 blocks each
    engine = engine_with(clock, kv_blocks=4, block_size=16)
    for i in range(3):
        engine.apply(request(f"r{i}", max_tokens=5, prompt_len=20))
    first = engine.step()
    stats = first[0][1][2]
    assert stats["num_running_reqs"] == 2 and stats["num_waiting_reqs"] == 1
    assert stats["kv_cache_usage"] == pytest.approx(1.0)
    sent = [(clock.now, m) for _, m in first] + drive(engine, clock)
    assert engine.ledger.summary().get("finished_length", 0) == 3 and engine.used_blocks == 0


def test_running_out_of_blocks_preempts_the_newest_and_it_recomputes():
    clock = Clock(1000.0)
    # 4 blocks of 4 tokens. a and b: prompt 3 + first token = 1 block each at
    # admission; both grow to 10 slots (3 blocks each: prompt and output but
    # the last token, whose KV is never computed): b must make room
    engine = engine_with(clock, kv_blocks=4, block_size=4)
    engine.apply(request("a", max_tokens=8, prompt_len=3))
    engine.apply(request("b", max_tokens=8, prompt_len=3))
    sent = drive(engine, clock)
    assert engine.counters["preemptions"] >= 1
    outputs = outputs_by_request(sent)
    # every request still gets all of its tokens, exactly once, and ends once
    for rid in ("a", "b"):
        assert sum(len(o[1]) for o in outputs[rid]) == 8
        assert [o[5] for o in outputs[rid] if len(o) > 5 and o[5] is not None] == [FinishReason.LENGTH]
    # the preempted one reports it: PREEMPTED then SCHEDULED on its next output
    events = [e["type"] for o in outputs["b"] if len(o) > 7 and o[7] for e in o[7]]
    assert events[:2] == [1, 2] and 3 in events and events[-1] == 2
    assert events.count(3) == events.count(2) - 1  # each preemption rescheduled once
    assert engine.used_blocks == 0 and engine.num_active == 0


def test_a_request_preempted_in_its_prompt_comes_back_as_a_preempted_one():
    """vLLM counts a resumed request in SchedulerStats' preempted_* (not as a
    new request) whether or not it had a token before (num_preemptions > 0):
    the fit reads those counts to place a resume's cache hits. b's 12-token
    prompt is chunked by a budget of 2; a's third block takes b's room
    while b has no token yet."""
    clock = Clock(0.0)
    engine = engine_with(clock, kv_blocks=6, block_size=4, max_num_batched_tokens=2, prefix_caching=True,
                         latency=LatencyModel(itl_ms=10))
    engine.apply(EngineCoreRequest("a", 3, 12, True, prompt_token_ids=[1, 2, 3]))
    sent = [(clock.now, m) for _, m in engine.step()]
    clock.now = engine.next_step_time(clock.now)
    engine.apply(EngineCoreRequest("b", 12, 2, True, prompt_token_ids=list(range(100, 112))))
    sent += drive(engine, clock)
    events = [e["type"] for o in outputs_by_request(sent)["b"] if len(o) > 7 and o[7] for e in o[7]]
    assert events[:4] == [1, 2, 3, 2]  # preempted before its first token, then resumed
    counted = [m[2]["prefix_cache_stats"] for _, m in sent if m[2] and m[2].get("prefix_cache_stats")]
    assert sum(c["requests"] for c in counted) == 2 and sum(c["preempted_requests"] for c in counted) == 1
    assert sum(c["preempted_queries"] for c in counted) == 12


def test_a_step_holds_the_kv_of_what_it_computes_not_of_the_token_it_samples():
    """vLLM's slots for a step are num_computed_tokens + num_new_tokens: the
    last sampled token's KV is never computed. Prompt 3 and 6 tokens out
    need 8 slots: two blocks of 4, never a third."""
    clock = Clock(0.0)
    engine = engine_with(clock, kv_blocks=2, block_size=4, latency=LatencyModel(itl_ms=10))
    engine.apply(request("a", max_tokens=6, prompt_len=3))
    sent, peak = [], 0
    while engine.has_work:
        sent += [(clock.now, m) for _, m in engine.step()]
        peak = max(peak, engine.used_blocks)
        clock.now = engine.next_step_time(clock.now) or clock.now
    assert sum(len(o[1]) for o in outputs_by_request(sent)["a"]) == 6
    assert engine.counters["preemptions"] == 0 and peak == 2


def test_a_prompt_larger_than_the_cache_fails_instead_of_waiting_forever():
    clock = Clock(1000.0)
    engine = engine_with(clock, kv_blocks=2, block_size=4)
    engine.apply(request("huge", max_tokens=2, prompt_len=100))
    sent = engine.step()
    [output] = sent[0][1][1]
    assert output[5] == FinishReason.ERROR and output[18]["code"] == "kv_cache_too_small"
    assert not engine.has_work


def test_chunked_prefill_within_the_token_budget():
    clock = Clock(0.0)
    engine = engine_with(clock, max_num_batched_tokens=10, latency=LatencyModel(itl_ms=10, prefill_ms_per_token=1))
    engine.apply(EngineCoreRequest("long", 25, 3, True))
    delays, firsts = [], []
    while engine.has_work:
        started = clock.now
        for _, message in engine.step():
            firsts += [o for o in message[1] if o[1]]
        delays.append(engine.step_delay)
        clock.now = engine.next_step_time(started) or clock.now
    # 25 prompt tokens in chunks of 10, 10, 5; the first token with the last chunk
    assert [round(d, 3) for d in delays[:3]] == [0.02, 0.02, 0.015]
    assert len(firsts) == 3 and firsts[0][11]["num_prompt_tokens"] == 25


def test_decodes_take_the_budget_before_new_prefills():
    clock = Clock(1000.0)
    engine = engine_with(clock, max_num_batched_tokens=4)
    for i in range(3):
        engine.apply(request(f"d{i}", max_tokens=50, prompt_len=1))
    engine.step()  # three 1-token prompts admitted and decoding
    engine.apply(request("p", max_tokens=2, prompt_len=8))
    engine.step()  # 3 decodes + 1 prompt token of "p"
    assert engine.active["p"].prefill_left == 7
    engine.step()
    assert engine.active["p"].prefill_left == 6


def test_xargs_ttft_delays_one_request_without_pacing_the_engine():
    clock = Clock(0.0)
    engine = engine_with(clock)  # unpaced
    engine.apply(EngineCoreRequest("fast", 4, 3, True))
    engine.apply(EngineCoreRequest("slow", 4, 3, True, extra_args={"mock_ttft_ms": 250}))
    sent = drive(engine, clock)
    firsts = first_token_times(sent)
    assert firsts["fast"] == pytest.approx(0.0) and firsts["slow"] == pytest.approx(0.25)
    # while only "slow" waited, the engine slept until it was due: no busy steps
    assert engine.counters["steps"] == 6  # 3 for "fast" at t=0, 3 for "slow" from t=0.25


def test_no_busy_steps_while_the_queue_waits_for_blocks_and_the_batch_prefills():
    clock = Clock(0.0)
    engine = engine_with(clock, kv_blocks=2, block_size=4)
    engine.apply(EngineCoreRequest("slow", 7, 2, True, extra_args={"mock_ttft_ms": 300}))  # 7 + its first token: both blocks
    engine.apply(EngineCoreRequest("next", 4, 2, True))  # must wait for a block
    engine.step()
    assert engine.next_step_time(0.0) == pytest.approx(0.3)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_async_scheduling_admits_what_came_while_the_batch_ran_a_step_later(async_scheduling):
    """vLLM's async scheduling plans step k+1 while step k runs: a request
    that comes during step k is scheduled when step k ends, into step k+2.
    Without it, into step k+1. Either way its QUEUED and SCHEDULED events
    are the end of step k (vLLM's engine core takes its input between
    steps), and a request that finds the engine idle is scheduled at once."""
    clock = Clock(0.0)
    latency = LatencyModel(itl_ms=10, prefill_ms_per_token=0.5)
    engine = engine_with(clock, latency=latency, async_scheduling=async_scheduling)
    engine.apply(EngineCoreRequest("old", 8, 100, True))
    sent = []
    while clock.now < 0.06:
        started = clock.now
        sent += [(clock.now, m) for _, m in engine.step()]
        due = engine.next_step_time(started)
        if started < 0.016 < due:  # "new" comes during the step 0.014-0.024
            clock.now = 0.016
            engine.apply(EngineCoreRequest("new", 20, 3, True))
        clock.now = due
    firsts = first_token_times(sent)
    events = {o[0]: o[7] for _, m in sent for o in m[1] if len(o) > 7 and o[7]}
    assert firsts["old"] == pytest.approx(0.014)  # 10 ms + 8 prompt tokens x 0.5 ms
    assert events["old"][1]["timestamp"] == pytest.approx(0.0)  # SCHEDULED at its arrival
    assert events["new"][0]["timestamp"] == pytest.approx(0.024)  # QUEUED when the step it came in ended
    assert events["new"][1]["timestamp"] == pytest.approx(0.024)  # SCHEDULED
    # prefilled (10 ms + 20 x 0.5 ms) in the step from 0.024, or, async, from 0.034
    assert firsts["new"] == pytest.approx(0.054 if async_scheduling else 0.044)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_request_that_ends_frees_its_slot_for_the_step_scheduled_at_its_last_output(async_scheduling):
    """vLLM without async scheduling takes a finished request out of the
    batch (`update_from_output`) before it schedules the next step: the
    waiting request gets the slot at the boundary of the last output and is
    prefilled in the step from there. With async scheduling the step from
    there was planned before that output: the freed slot is decided on at
    the same boundary, for the step after it."""
    clock = Clock(0.0)
    latency = LatencyModel(itl_ms=10, prefill_ms_per_token=0.5)
    engine = engine_with(clock, max_num_seqs=2, latency=latency, async_scheduling=async_scheduling)
    engine.apply(EngineCoreRequest("a", 8, 3, True))
    engine.apply(EngineCoreRequest("long", 8, 20, True))
    engine.apply(EngineCoreRequest("b", 8, 2, True))
    sent = drive(engine, clock)
    last_of_a = max(t for t, m in sent for o in m[1] if o[0] == "a")
    assert last_of_a == pytest.approx(0.038)  # 10 ms + 16 prompt tokens x 0.5 ms, then two steps of 10 ms
    events = {o[0]: o[7] for _, m in sent for o in m[1] if len(o) > 7 and o[7]}
    assert events["b"][1]["timestamp"] == pytest.approx(0.038)  # SCHEDULED
    # its prefill step: 10 ms + 8 x 0.5 ms, from the boundary or, async, a step of 10 ms later
    assert first_token_times(sent)["b"] == pytest.approx(0.062 if async_scheduling else 0.052)


def test_the_tokens_of_requests_that_end_are_not_taken_from_the_next_steps_budget():
    clock = Clock(1000.0)
    engine = engine_with(clock, max_num_batched_tokens=4)
    engine.apply(request("ends", max_tokens=2, prompt_len=1))
    for i in range(2):
        engine.apply(request(f"d{i}", max_tokens=50, prompt_len=1))
    engine.step()  # three 1-token prompts admitted, their first tokens
    engine.apply(request("p", max_tokens=2, prompt_len=8))
    sent = engine.step()  # the last output of "ends"; then 2 decodes + 2 prompt tokens of "p"
    assert sent[0][1][5] == ["ends"]
    assert engine.active["p"].prefill_left == 6


def test_a_request_that_ends_frees_its_kv_blocks_for_the_step_scheduled_at_its_last_output():
    clock = Clock(0.0)
    # 4 blocks of 16 tokens; prompts of 20 tokens and their first token need 2 blocks each
    engine = engine_with(clock, kv_blocks=4, block_size=16, latency=LatencyModel(itl_ms=10))
    for i in range(3):
        engine.apply(request(f"r{i}", max_tokens=3, prompt_len=20))
    sent = drive(engine, clock)
    ends = {o[0]: t for t, m in sent for o in m[1] if len(o) > 5 and o[5] is not None}
    events = {o[0]: o[7] for _, m in sent for o in m[1] if len(o) > 7 and o[7]}
    assert events["r2"][1]["timestamp"] == pytest.approx(ends["r0"])
    assert engine.used_blocks == 0
