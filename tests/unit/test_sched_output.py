"""The step plan (SchedulerOutput): its own arithmetic, and what
`Scheduler.schedule` plans in simple situations (admission under
max_num_seqs, the token budget with chunked prefill, decodes before
prefills, preemption, rejection), read from the plans an EngineCore's
steps were given."""

from typing import List

import pytest

from gmock_engine.core.request import Request
from gmock_engine.core.sched_output import SchedulerOutput
from gmock_engine.wire.inputs import EngineCoreRequest
from engine_steps import Clock, engine_with


def recorded(engine) -> List[SchedulerOutput]:
    """Every plan the engine's scheduler returns from now on, in order."""
    plans: List[SchedulerOutput] = []
    schedule = engine.scheduler.schedule

    def recording(now):
        plan = schedule(now)
        plans.append(plan)
        return plan

    engine.scheduler.schedule = recording
    return plans


def ids(requests):
    return [r.request_id for r in requests]


def add(engine, rid, prompt_len=8, max_tokens=4):
    engine.apply(EngineCoreRequest(rid, prompt_len, max_tokens, True))


def running_request(engine, rid) -> Request:
    return engine.scheduler.running[rid]


# -- the plan's own arithmetic ------------------------------------------------


def test_an_empty_plan():
    plan = SchedulerOutput()
    assert list(plan.scheduled_new_reqs) == [] and list(plan.preempted_reqs) == []
    assert plan.num_running_reqs == 0 and plan.total_num_scheduled_tokens == 0
    assert plan.finished_req_ids == [] and plan.chunk == 1


def test_total_is_decode_plus_prefill():
    assert SchedulerOutput(num_decode_tokens=3, num_prefill_tokens=40).total_num_scheduled_tokens == 43


def request(rid, max_tokens=4, prompt_len=8):
    return Request(rid, 0, max_tokens, None, prompt_len, 0.0)


def test_finished_req_ids_are_the_rejected_requests_in_order():
    x, y = request("x"), request("y")
    plan = SchedulerOutput(rejected_reqs=[(y, {"code": "a"}), (x, {"code": "b"})])
    assert plan.finished_req_ids == ["y", "x"]


@pytest.mark.parametrize("chunk, max_tokens, produced, expected", [(1, 10, 0, 1), (4, 10, 0, 4), (4, 10, 7, 3), (4, 10, 6, 4), (8, 3, 2, 1)])
def test_num_scheduled_tokens_is_a_chunk_or_what_remains(chunk, max_tokens, produced, expected):
    req = request("r", max_tokens=max_tokens)
    req.num_output_tokens = produced
    assert SchedulerOutput(chunk=chunk).num_scheduled_tokens(req) == expected


def test_repr_names_the_requests():
    req = request("n1")
    text = repr(SchedulerOutput([req], 1, 0, 8, (), [(req, {})]))
    assert "new=['n1']" in text and "running=1" in text and "prefill=8" in text and "finished=['n1']" in text


# -- what Scheduler.schedule plans ---------------------------------------------


def test_admission_under_max_num_seqs_then_decodes():
    engine = engine_with(Clock(), max_num_seqs=2)
    plans = recorded(engine)
    for rid in ("r0", "r1", "r2"):
        add(engine, rid, prompt_len=8, max_tokens=3)
    engine.step()
    first = plans[0]
    assert ids(first.scheduled_new_reqs) == ["r0", "r1"]
    assert first.num_running_reqs == 2
    # nobody was past its prefill before the step: no decode tokens, both prompts prefilled
    assert first.num_decode_tokens == 0 and first.num_prefill_tokens == 16
    assert list(first.preempted_reqs) == [] and first.finished_req_ids == []
    engine.step()
    second = plans[1]
    assert list(second.scheduled_new_reqs) == []  # r2 still waits: the batch is full
    assert second.num_running_reqs == 2 and second.num_decode_tokens == 2 and second.num_prefill_tokens == 0
    assert second.total_num_scheduled_tokens == 2


def test_chunk_size_sets_decode_tokens_and_num_scheduled_tokens():
    engine = engine_with(Clock(), output_token_chunk_size=3)
    plans = recorded(engine)
    add(engine, "a", prompt_len=5, max_tokens=20)
    engine.step()
    engine.step()
    plan = plans[1]
    assert plan.chunk == 3 and plan.num_decode_tokens == 3
    req = running_request(engine, "a")
    req.num_output_tokens = 18
    assert plan.num_scheduled_tokens(req) == 2


def test_chunked_prefill_within_the_token_budget():
    engine = engine_with(Clock(), max_num_batched_tokens=10)
    plans = recorded(engine)
    add(engine, "long", prompt_len=25, max_tokens=2)
    while engine.has_work:
        engine.step()
    summary = [(ids(p.scheduled_new_reqs), p.num_running_reqs, p.num_decode_tokens, p.num_prefill_tokens) for p in plans]
    # 25 prompt tokens in chunks of the budget; decodes only once the prompt is in
    assert summary[:3] == [(["long"], 1, 0, 10), ([], 1, 0, 10), ([], 1, 0, 5)]
    assert sum(p.num_prefill_tokens for p in plans) == 25
    assert all(p.num_decode_tokens == 1 and p.num_prefill_tokens == 0 for p in plans[3:])
    assert all(p.total_num_scheduled_tokens <= 10 for p in plans)


def test_decodes_take_the_budget_before_a_new_prefill():
    engine = engine_with(Clock(), max_num_batched_tokens=10)
    plans = recorded(engine)
    add(engine, "a", prompt_len=4, max_tokens=10)
    engine.step()
    add(engine, "b", prompt_len=30, max_tokens=2)
    engine.step()
    plan = plans[1]
    assert ids(plan.scheduled_new_reqs) == ["b"] and plan.num_running_reqs == 2
    assert plan.num_decode_tokens == 1 and plan.num_prefill_tokens == 9
    assert plan.total_num_scheduled_tokens == 10


def test_no_budget_prefills_whole_prompts():
    engine = engine_with(Clock())
    plans = recorded(engine)
    add(engine, "a", prompt_len=3000)
    add(engine, "b", prompt_len=7)
    engine.step()
    assert ids(plans[0].scheduled_new_reqs) == ["a", "b"] and plans[0].num_prefill_tokens == 3007


def test_preemption_plans_no_admission():
    # 4 blocks of 4 tokens; a and b grow to need 3 blocks each (10 slots: prompt
    # and output but the last token): b (the newest) is
    # preempted. c (priority first, held back by max_num_seqs) would fit in what
    # b frees, but nothing is admitted in a step that preempted
    engine = engine_with(Clock(), kv_blocks=4, block_size=4, max_num_seqs=2, scheduling_policy="priority")
    plans = recorded(engine)
    add(engine, "a", prompt_len=3, max_tokens=8)
    add(engine, "b", prompt_len=3, max_tokens=8)
    engine.step()
    engine.apply(EngineCoreRequest("c", 1, 1, True, priority=-1))
    for _ in range(100):
        if not engine.has_work:
            break
        engine.step()
    preempting = [p for p in plans if p.preempted_reqs]
    assert preempting, plans
    first = preempting[0]
    assert ids(first.preempted_reqs) == ["b"]
    assert list(first.scheduled_new_reqs) == []
    assert first.num_running_reqs == 1
    after = plans[plans.index(first) + 1]
    assert ids(after.scheduled_new_reqs)[:1] == ["c"]  # admitted in the next step
    # b comes back later, as a new request of a plan
    assert any("b" in ids(p.scheduled_new_reqs) for p in plans[plans.index(first) + 1:])


def test_a_prompt_that_can_never_fit_is_rejected_in_the_plan():
    engine = engine_with(Clock(), kv_blocks=2, block_size=4)
    plans = recorded(engine)
    add(engine, "huge", prompt_len=100, max_tokens=2)
    engine.step()
    [plan] = plans
    assert plan.finished_req_ids == ["huge"] and list(plan.scheduled_new_reqs) == []
    assert plan.num_running_reqs == 0 and plan.total_num_scheduled_tokens == 0
    [(request, error)] = plan.rejected_reqs
    assert request.request_id == "huge" and error["code"] == "kv_cache_too_small"
