"""runtime/fault_injection.py: what the fault layer answers the runtime, without sockets.

The runtime's hands (spawn, the output queue, the crash) are fakes that
record what they were asked; nothing here waits on the hub.
"""

import time

import pytest
from loguru import logger

from gmock_engine.runtime import fault_injection
from gmock_engine.core.engine import COORDINATOR
from gmock_engine.runtime.fault_injection import NO_OUTPUTS, FaultInjector, NoFaults
from gmock_engine.faults.specs import UTILITY_FAILURE_MESSAGE, parse_spec
from gmock_engine.wire.inputs import EngineCoreRequest, UtilityCall
from gmock_engine.wire.outputs import engine_core_output, engine_core_outputs, scheduler_stats
from gmock_engine.wire.types import FinishReason


class Hands:
    """What the runtime hands the fault layer, recording each use."""

    def __init__(self):
        self.spawned = []
        self.queued = []
        self.vanished = 0

    def spawn(self, name, func, *args):
        self.spawned.append((name, func, args))

    def put(self, item):
        self.queued.append(item)

    def vanish(self):
        self.vanished += 1
        raise SystemExit("vanished")  # the real one raises GreenletExit and does not return


class FakeEngine:
    def fail_utility(self, call, failure):
        return [(call.client_index, ["reply", call.call_id, failure])]


def injector(*specs, rank=0):
    hands = Hands()
    parsed = [parse_spec(kind, text) for kind, text in specs]
    layer, _ = fault_injection.build(parsed, 0, fault_injection.RuntimeHooks(rank, logger, hands.spawn, hands.put, hands.vanish))
    layer.joined(FakeEngine(), 0.0)
    return layer, hands


def request(rid, max_tokens=10, **extra_args):
    return EngineCoreRequest(request_id=rid, prompt_len=3, max_tokens=max_tokens, has_sampling_params=True, extra_args=extra_args)


def outputs(*outs, finished=None):
    return engine_core_outputs(0, list(outs), 1.0, finished)


def test_no_fault_for_a_rank_is_the_null_object_of_pass_throughs():
    layer, hands = injector(("crash", "every=1 ranks=1"), rank=0)
    assert isinstance(layer, NoFaults) and not layer.hung
    assert layer.joined(FakeEngine(), 0.0) is None  # no timer to spawn
    message = request("a")
    assert layer.on_input(message) == (message, NO_OUTPUTS) and layer.on_input(message)[0] is message
    batch = [(0, outputs(["a", [1]]))]
    assert layer.on_outputs(batch) is batch  # the same list: no work per output
    assert layer.next_step_at(1.0, 1.5) == 1.5 and layer.next_step_at(1.0, None) is None
    assert layer.flowing.is_set() and layer.outputs_flowing.is_set()
    assert layer.faults.summary() == {} and hands.spawned == []
    assert isinstance(injector(("crash", "every=1 ranks=1"), rank=1)[0], FaultInjector)


def test_a_wire_fault_marks_the_request_and_rewrites_only_its_end():
    layer, hands = injector(("late-finish", "every=1 delay=1.5s"))
    assert layer.on_input(request("b")) == (request("b"), NO_OUTPUTS)
    running = [(0, outputs(["b", [1]]))]
    assert layer.on_outputs(running) == running  # not its end yet: passed as it is
    stats = [(COORDINATOR, engine_core_outputs(0, [], 1.0, None, scheduler_stats(1, 0, 0.1, 5)))]
    end = engine_core_output("b", [7], FinishReason.LENGTH)
    assert layer.on_outputs([(0, outputs(end, finished=["b"])), *stats]) == stats  # held back; the stats pass
    ((name, put_later, (delay, item)),) = hands.spawned
    assert name == "engine-0-late-finish" and delay == 1.5 and item == (0, outputs(end, finished=["b"]))
    assert layer.marked == {} and layer.faults.summary() == {"fault_late_finish": 1}


def test_error_mid_stream_plants_the_engines_own_scenario():
    layer, _ = injector(("error-mid-stream", "every=1"))
    changed, out = layer.on_input(request("e", max_tokens=10))
    assert changed.extra_args == {"mock_fail_after": 5} and out == NO_OUTPUTS
    sooner, _ = layer.on_input(request("f", max_tokens=10, mock_fail_after=2))
    assert sooner.extra_args == {"mock_fail_after": 2}  # the request's own comes sooner


def test_a_failed_utility_call_is_answered_and_not_applied():
    layer, _ = injector(("fail-utility", "every=1"))
    call = UtilityCall(client_index=1, call_id=7, method="reset_prefix_cache", args=[])
    assert layer.on_input(call) == (None, [(1, ["reply", 7, UTILITY_FAILURE_MESSAGE])])
    stats = UtilityCall(client_index=1, call_id=8, method="gmock_stats", args=[])
    assert layer.on_input(stats) == (stats, NO_OUTPUTS)


def test_hang_and_stall_close_the_gates_and_a_timer_opens_them():
    layer, hands = injector(("hang", "every=1 duration=1s"))
    layer.on_input(request("h"))
    assert layer.hung and not layer.flowing.is_set() and not layer.outputs_flowing.is_set()
    ((name, _, args),) = hands.spawned
    assert name == "engine-0-hang-end" and args == (1.0, True)
    stall, hands = injector(("stall-outputs", "every=1 duration=2s"))
    stall.on_input(request("s"))
    assert not stall.hung and stall.flowing.is_set() and not stall.outputs_flowing.is_set()
    assert [(n, a) for n, _, a in hands.spawned] == [("engine-0-stall-end", (2.0, False))]


def test_slow_steps_stretch_the_step_period():
    layer, _ = injector(("slow-steps", "every=1 factor=4"))
    assert layer.next_step_at(100.0, 100.01) == 100.01  # not fired yet
    layer.on_input(request("s"))
    started = time.monotonic()  # the layer compares with the engine clock
    # the model asked for 1 000 s (longer than the step took): four times that
    assert layer.next_step_at(started, started + 1000.0) == pytest.approx(started + 4000.0)
    # the step took longer than the model asked: four times what it took
    assert layer.next_step_at(started - 10.0, started - 9.0) >= started + 30.0
    assert layer.next_step_at(started, None) is None  # idle: nothing to stretch


def test_crash_hands_over_to_the_runtime_and_timed_faults_get_a_timer():
    layer, hands = injector(("crash", "every=1"))
    with pytest.raises(SystemExit):
        layer.on_input(request("c"))
    assert hands.vanished == 1
    timed, _ = injector(("crash", "at=5s"))
    assert timed.joined(FakeEngine(), 0.0) is not None
