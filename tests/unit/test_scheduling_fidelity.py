"""The scheduler against vLLM's (vllm/v1/core/sched/scheduler.py, kv_cache_manager.py,
block_pool.py of 0.32) where the scheduling-fidelity sitting
(benchmarks/scheduling_fidelity.py) found the mock apart from it."""

import pytest

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


def test_a_step_late_by_less_than_its_time_keeps_the_cadence():
    """The emulated GPU (benchmarks/emulated_gpu/ Pacer) times a step from
    the previous one's due end when the host was late by less than a step,
    as a GPU's queued steps run back to back: a wake-up 3 ms late in a 12 ms
    step counts from when it was due, so the next step is not 3 ms late too;
    one a whole step late (a stall) counts from its actual start."""
    from gmock_engine.runtime.steptimer import cadence_base

    assert cadence_base(10.003, 10.0, 0.012) == 10.0
    assert cadence_base(10.0, 10.0, 0.012) == 10.0
    assert cadence_base(10.020, 10.0, 0.012) == 10.020  # later than its own time: no catching up
    assert cadence_base(10.003, None, 0.012) == 10.003  # woken from idle: nothing was due
    # a steady 2 ms late wake-up: the steps still come every 12 ms
    due, starts = 0.0, []
    for _ in range(5):
        now = due + 0.002
        starts.append(now)
        due = cadence_base(now, due, 0.012) + 0.012
    assert [round(b - a, 6) for a, b in zip(starts, starts[1:])] == [0.012] * 4


def test_the_slow_profile_is_the_reference_times_three():
    """benchmarks/emulated_gpu/profiles/slow.ini is what its header and the docs say:
    reference.ini with every time three times as long, at every batch, chunk and context."""
    import os

    from gmock_engine.timing.profile import read_profile

    here = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "emulated_gpu", "profiles")
    slow, reference = (read_profile(os.path.join(here, name)) for name in ("slow.ini", "reference.ini"))
    for batch in (1, 3, 8, 20, 128, 200):
        for tokens, reqs in ((0, 0), (64, 1), (512, 2)):
            for context in (0, 4096, 30000):
                args = (batch, tokens, tokens * (128 + tokens / 2), context, reqs)
                assert slow.predict_ms(*args) == pytest.approx(3 * reference.predict_ms(*args), rel=1e-9), args
