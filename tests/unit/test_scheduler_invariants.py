"""Scheduler invariants held through EngineCore's public surface only (apply,
step, the outputs and their events, used_blocks, kv_cache_usage, num_active,
active / waiting, fail_all): they must hold whatever shape the scheduler's
inside takes.

* No admission in a step that preempted (vLLM's `schedule()` schedules
  waiting requests only `if not preempted_reqs`), across requests: with the
  priority policy a higher-priority newcomer must not take the blocks a
  preemption just freed in that same step.
* Every way of ending all requests at once (pause or sleep in abort mode, a
  draining abort, fail_all) frees every KV block: a later request is
  admitted, not left waiting at usage 1.0.
"""

import pytest

from gmock_engine.core.engine import Drain
from gmock_engine.wire.inputs import EngineCoreRequest, UtilityCall
from gmock_engine.wire.types import EngineCoreEventType, FinishReason
from engine_steps import TickClock, engine_with, outputs_of, run

SCHEDULED, PREEMPTED = EngineCoreEventType.SCHEDULED, EngineCoreEventType.PREEMPTED


def engine(**settings):
    return engine_with(TickClock(), block_size=16, **settings)


def events_of(sent, rid):
    """(type, timestamp) of every event request `rid` was sent, in order."""
    return [(e["type"], e["timestamp"]) for o in outputs_of(sent, rid) if len(o) > 7 and o[7] for e in o[7]]


# -- no admission in a preempting step, across requests ----------------------------


def preempting_scenario(**settings):
    """3 blocks of 16. "a" (16-token prompt: 1 block) and "b" (31 tokens: 2
    blocks) fill them at step 1. At step 2 "a" computes the KV of its first
    token, which needs a second block: "b" (the newest) is preempted, which
    frees two, "a" takes one. "hi" (priority -1, one block) arrives before
    step 2: it fits in the other but must wait for step 3."""
    e = engine(kv_blocks=3, scheduling_policy="priority", **settings)
    e.apply(EngineCoreRequest("a", 16, 6, True, priority=0))
    e.apply(EngineCoreRequest("b", 31, 6, True, priority=0))
    sent = e.step()
    assert set(e.active) == {"a", "b"} and e.used_blocks == 3
    e.apply(EngineCoreRequest("hi", 1, 2, True, priority=-1))
    return e, sent


def test_a_higher_priority_request_is_not_admitted_in_the_step_that_preempted():
    e, sent = preempting_scenario()
    sent += e.step()
    assert e.counters["preemptions"] == 1  # the pressure is real
    assert set(e.active) == {"a"}
    assert set(e.waiting) == {"b", "hi"}  # "hi" fits, but waits a step
    sent += e.step()
    assert "hi" in e.active  # the very next step admits it (before "b": priority)
    sent += run(e)
    assert e.used_blocks == 0 and e.num_active == 0
    assert {rid: sum(len(o[1]) for o in outputs_of(sent, rid)) for rid in ("a", "b", "hi")} == {"a": 6, "b": 6, "hi": 2}


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_no_request_is_scheduled_at_the_time_another_was_preempted(async_scheduling):
    """The same on the wire: every event of every request, compared across
    them. An engine that schedules a step ahead decides the step after the
    one that woke it at once, at the time it admitted "a" and "b"; its
    events carry when it decided, so there the preemption has that time."""
    e, sent = preempting_scenario(async_scheduling=async_scheduling)
    sent += run(e)
    events = {rid: events_of(sent, rid) for rid in ("a", "b", "hi")}
    preempted = {t for kind, t in events["b"] if kind == PREEMPTED}
    assert preempted, events
    scheduled = {(rid, t) for rid, evs in events.items() for kind, t in evs if kind == SCHEDULED}
    if async_scheduling:
        woke = {t for rid, t in scheduled if rid == "a"}
        assert preempted == woke, events
        scheduled -= {(rid, t) for rid, t in scheduled if rid in ("a", "b") and t in woke}
    assert not {(rid, t) for rid, t in scheduled if t in preempted}, events


# -- every KV block free after an abort (or failure) of all -------------------------


def call(e, method, *args, call_id=7):
    return e.apply(UtilityCall(0, call_id, method, list(args)))


def loaded_engine():
    """4 blocks of 16, all held: two running requests of 2 blocks each, and
    one waiting for blocks."""
    e = engine(kv_blocks=4)
    e.apply(EngineCoreRequest("r0", 20, 1000, True))
    e.apply(EngineCoreRequest("r1", 20, 1000, True))
    e.apply(EngineCoreRequest("w", 20, 1000, True))
    e.step()
    assert e.used_blocks == 4 and set(e.active) == {"r0", "r1"} and set(e.waiting) == {"w"}
    assert e.kv_cache_usage == 1.0
    return e


def terminal_reasons(sent):
    return {o[0]: o[5] for _, m in sent for o in m[1] if len(o) > 5 and o[5] is not None}


def assert_all_free(e):
    assert e.num_active == 0
    assert e.used_blocks == 0 and e.kv_tokens == 0 and e.kv_cache_usage == 0.0


def assert_a_later_request_runs(e):
    e.apply(EngineCoreRequest("later", 60, 3, True))  # 4 blocks: the whole cache
    e.step()
    assert "later" in e.active and not e.waiting
    sent = run(e)
    assert terminal_reasons(sent) == {"later": FinishReason.LENGTH}
    assert_all_free(e)


@pytest.mark.parametrize("method,args,resume", [
    ("pause_generation", ["abort", True], ("resume_scheduler",)),
    ("pause_scheduler", ["abort", True], ("resume_scheduler",)),
    ("sleep", [1, "abort"], ("wake_up", None)),
])
def test_pause_or_sleep_in_abort_mode_frees_every_block(method, args, resume):
    e = loaded_engine()
    sent = call(e, method, *args)
    assert terminal_reasons(sent) == {"r0": FinishReason.ABORT, "r1": FinishReason.ABORT, "w": FinishReason.ABORT}
    assert_all_free(e)
    call(e, resume[0], *resume[1:], call_id=8)
    assert_a_later_request_runs(e)


def test_a_draining_abort_frees_every_block():
    e = loaded_engine()
    sent = e.apply(Drain(finish=False))
    assert terminal_reasons(sent) == {"r0": FinishReason.ABORT, "r1": FinishReason.ABORT, "w": FinishReason.ABORT}
    assert_all_free(e)
    # shutting down: a newcomer is answered at once (ABORT) and holds nothing
    assert terminal_reasons(e.apply(EngineCoreRequest("late", 60, 3, True))) == {"late": FinishReason.ABORT}
    assert_all_free(e)


def test_fail_all_frees_every_block():
    e = loaded_engine()
    sent = e.fail_all("a step failed")
    assert terminal_reasons(sent) == {"r0": FinishReason.ERROR, "r1": FinishReason.ERROR, "w": FinishReason.ERROR}
    assert_all_free(e)
    assert_a_later_request_runs(e)

