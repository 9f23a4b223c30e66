"""The scheduler against vLLM's (vllm/v1/core/sched/scheduler.py, kv_cache_manager.py,
block_pool.py of 0.32) where the scheduling-fidelity sitting
(benchmarks/scheduling_fidelity.py) found the mock apart from it."""

from gmock_engine.timing.latency import LatencyModel
from gmock_engine.wire.inputs import EngineCoreRequest
from engine_steps import Clock, drive, engine_with

PREEMPTED = 3


def preempted_first(sent):
    """The id of the first request whose output carries a PREEMPTED event."""
    for _, message in sent:
        for output in message[1]:
            events = output[7] if len(output) > 7 and output[7] else ()
            if any(e["type"] == PREEMPTED for e in events):
                return output[0]
    return None


def test_priority_policy_preempts_the_lowest_priority_not_the_newest():
    """vLLM's priority policy, when a running request's next block does not
    fit: `preempted_req = max(self.running, key=lambda r: (r.priority,
    r.arrival_time))`; FCFS pops `self.running[-1]`, the newest. `low`
    (priority 5) runs first alone; `high` (priority 0) joins after it; both
    outgrow 4 blocks of 4 tokens: `low` must make room, not `high`."""
    clock = Clock(0.0)
    engine = engine_with(clock, kv_blocks=4, block_size=4, scheduling_policy="priority", latency=LatencyModel(itl_ms=10))
    engine.apply(EngineCoreRequest("low", 3, 8, True, priority=5))
    sent = [(clock.now, m) for _, m in engine.step()]
    clock.now = engine.next_step_time(clock.now)
    engine.apply(EngineCoreRequest("high", 3, 8, True, priority=0))
    sent += drive(engine, clock)
    assert engine.counters["preemptions"] >= 1
    assert preempted_first(sent) == "low"


def test_fcfs_still_preempts_the_newest():
    """The same two requests under FCFS: the newest admitted (`high`, whose
    priority FCFS ignores) is preempted."""
    clock = Clock(0.0)
    engine = engine_with(clock, kv_blocks=4, block_size=4, latency=LatencyModel(itl_ms=10))
    engine.apply(EngineCoreRequest("low", 3, 8, True, priority=5))
    sent = [(clock.now, m) for _, m in engine.step()]
    clock.now = engine.next_step_time(clock.now)
    engine.apply(EngineCoreRequest("high", 3, 8, True, priority=0))
    sent += drive(engine, clock)
    assert preempted_first(sent) == "high"
