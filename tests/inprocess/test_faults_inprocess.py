"""--fault-* against the fake frontend: what each fault puts on the wire.

Real sockets and greenlets in one hub (as test_engine_inprocess.py). Times
are only checked as lower bounds (a stall lasts at least its duration), so a
slow machine cannot make these fail.
"""

import dataclasses
import time

import gevent
import pytest

from engine_steps import run, tokens_of
from fake_frontend import Collected, FakeFrontend, engine_core_request
from gmock_engine.core.engine import MOCK_FAILURE_MESSAGE, EngineCore
from gmock_engine.faults.specs import UTILITY_FAILURE_MESSAGE
from gmock_engine.tools.frontend import add_frames
from gmock_engine.wire.eras import WIRE_LAYOUTS
from gmock_engine.wire.inputs import decode_input
from gmock_engine.wire.types import FinishReason

from test_engine_inprocess import serving, start_app

#: Where a RequestError goes in an EngineCoreOutput (0.33 layout).
ERROR_POSITION = WIRE_LAYOUTS["0.33"].output_position("error")


@pytest.fixture
def stack(request):
    """A frontend with two engines and a gmock_engine App with the test's
    flags (`@pytest.mark.parametrize("stack", [[flags]], indirect=True)`)."""
    frontend = FakeFrontend(dp=2)
    # injected faults are counted beside the ledger, never as violations
    with serving(frontend, "--engine-count", "2", *request.param) as app:
        yield frontend, app


def read_for(frontend, seconds, client=0):
    """Every message on a client's socket for `seconds`, with arrival times."""
    got = []
    deadline = time.monotonic() + seconds
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return got
        try:
            message = frontend.recv(client, timeout=left)
        except gevent.Timeout:
            return got
        got.append((time.monotonic(), message))


def outputs_of(messages, rid):
    return [o for _, m in messages for o in m[1] if o[0] == rid]


def terminals(messages, rid):
    return [o for o in outputs_of(messages, rid) if len(o) > 5 and o[5] is not None]


@pytest.mark.parametrize("stack", [["--fault-error-mid-stream", "every=2"]], indirect=True)
def test_error_mid_stream(stack):
    frontend, app = stack
    frontend.add(0, "ok", max_tokens=10)
    frontend.add(0, "broken", max_tokens=10)
    collected = frontend.collect(["ok", "broken"])
    assert len(collected.tokens("ok")) == 10 and collected.terminal["ok"] == FinishReason.LENGTH
    assert len(collected.tokens("broken")) == 5 and collected.terminal["broken"] == FinishReason.ERROR
    last = collected.outputs["broken"][-1]
    assert last[ERROR_POSITION] == {"code": "mock_failure", "message": MOCK_FAILURE_MESSAGE, "retryable": False}
    counts = app.counters()[0]
    assert counts["fault_error_mid_stream"] == 1 and counts["finished_error"] == 1 and counts["finished_length"] == 1


@pytest.mark.parametrize("stack", [["--fault-drop-finish", "every=1 ranks=1"]], indirect=True)
def test_drop_finish_on_one_rank(stack):
    frontend, app = stack
    frontend.add(0, "kept", max_tokens=4)
    frontend.add(1, "dropped", max_tokens=4)
    got = read_for(frontend, 0.5)
    assert len(terminals(got, "kept")) == 1
    # the last output (last token + finish reason) never comes; earlier tokens do
    assert [len(o[1]) for o in outputs_of(got, "dropped")] == [1, 1, 1]
    assert terminals(got, "dropped") == []
    assert all("dropped" not in (m[5] if len(m) > 5 and m[5] else ()) for _, m in got)
    counts = app.counters()
    # the engine ended it (nothing active); the ledger kept the books of the real end
    assert counts[1]["fault_drop_finish"] == 1 and counts[1]["finished_length"] == 1 and counts[1]["active"] == 0
    assert "fault_drop_finish" not in counts[0]


@pytest.mark.parametrize("stack", [["--fault-duplicate-finish", "every=1"]], indirect=True)
def test_duplicate_finish(stack):
    frontend, app = stack
    frontend.add(0, "twice", max_tokens=3)
    got = read_for(frontend, 0.5)
    ends = terminals(got, "twice")
    assert len(ends) == 2 and ends[0] == ends[1] and ends[0][5] == FinishReason.LENGTH
    finished = [rid for _, m in got if len(m) > 5 and m[5] for rid in m[5]]
    assert finished == ["twice", "twice"]
    assert app.counters()[0]["fault_duplicate_finish"] == 1


@pytest.mark.parametrize("stack", [["--fault-late-finish", "every=1 delay=600ms", "--itl-ms", "5"]], indirect=True)
def test_late_finish_comes_after_the_delay_even_past_an_abort(stack):
    frontend, app = stack
    frontend.add(0, "late", max_tokens=3)
    got = read_for(frontend, 0.3)
    assert len(outputs_of(got, "late")) == 2 and terminals(got, "late") == []
    last_token_at = max(t for t, m in got if any(o[0] == "late" for o in m[1]))
    frontend.abort(0, ["late"])  # the engine has ended it: the abort changes nothing
    got += read_for(frontend, 1.0)
    ends = [(t, o) for t, m in got for o in m[1] if o[0] == "late" and len(o) > 5 and o[5] is not None]
    assert len(ends) == 1 and ends[0][1][5] == FinishReason.LENGTH
    assert ends[0][0] - last_token_at >= 0.5
    assert app.counters()[0]["fault_late_finish"] == 1


@pytest.mark.parametrize("stack", [["--fault-fail-utility", "every=1 method=reset_prefix_cache"]], indirect=True)
def test_fail_utility(stack):
    frontend, app = stack
    call = frontend.utility(1, "reset_prefix_cache", [False, False])
    assert frontend.utility_result(call) == [call, UTILITY_FAILURE_MESSAGE, None]
    call = frontend.utility(1, "is_sleeping")
    assert frontend.utility_result(call) == [call, None, [None, False]]
    assert app.counters()[1]["fault_fail_utility"] == 1 and app.counters()[1]["utility_calls"] == 2


@pytest.mark.parametrize("stack", [["--fault-stall-outputs", "every=2 duration=700ms", "--itl-ms", "10"]], indirect=True)
def test_stall_outputs_then_go_on(stack):
    frontend, app = stack
    frontend.add(0, "long", max_tokens=60)
    got = read_for(frontend, 0.15)
    assert outputs_of(got, "long")
    frontend.add(0, "trigger", max_tokens=2)  # the 2nd request stalls the outputs
    collected = frontend.collect(["long", "trigger"], timeout=10)
    times = [t for t, _ in got]
    gap_start = times[-1] if times else time.monotonic()
    assert len(collected.tokens("long")) + sum(len(o[1]) for o in outputs_of(got, "long")) == 60
    assert len(collected.tokens("trigger")) == 2
    assert time.monotonic() - gap_start >= 0.6
    assert app.counters()[0]["fault_stall_outputs"] == 1


@pytest.mark.parametrize("chunk", [1, 4])
def test_outputs_queued_behind_a_stall_carry_the_tokens_of_their_own_step(chunk):
    """The runtime's engines reuse each steady request's output list from
    step to step (EngineSettings.reuse_outputs), so the stepper encodes every
    message as it makes it. Behind a stall the messages wait in the output
    queue while the steps go on: each must still carry the tokens of its own
    step, the same tokens as an engine that makes new lists. (Encoded only
    when the sender takes them, every queued message would carry the last
    step's token.)"""
    frontend = FakeFrontend(dp=1)
    sampling = {"temperature": 1.0, "max_tokens": 120}
    flags = ["--fault-stall-outputs", "every=1 limit=1 duration=400ms", "--itl-ms", "1", "--output-token-chunk-size", str(chunk)]
    with serving(frontend, *flags) as app:
        added = time.monotonic()
        frontend.add(0, "long", sampling_params=dict(sampling))
        first = frontend.recv(0, timeout=10)
        # the stall began at the ADD: what the steps made meanwhile was queued
        assert time.monotonic() - added >= 0.35
        collected = Collected()
        collected.add(first)
        collected = frontend.collect(["long"], timeout=10, into=collected)
        settings = app.runners[0].engine.settings
        assert settings.reuse_outputs and app.counters()[0]["fault_stall_outputs"] == 1
    assert len(collected.messages) == 120 // chunk
    reference = EngineCore(dataclasses.replace(settings, reuse_outputs=False))
    reference.apply(decode_input(add_frames(engine_core_request("long", sampling_params=dict(sampling))), reference.wire))
    expected = tokens_of(run(reference), "long")
    assert len(expected) == 120 and len(set(expected)) > 100
    assert collected.tokens("long") == expected


@pytest.mark.parametrize("stack", [["--fault-hang", "every=2 duration=800ms ranks=0"]], indirect=True)
def test_hang_then_go_on(stack):
    frontend, app = stack
    frontend.add(0, "first", max_tokens=3)
    frontend.collect(["first"])
    frontend.add(0, "hangs", max_tokens=3)  # the 2nd request hangs engine 0
    started = time.monotonic()
    gevent.sleep(0.1)
    call = frontend.utility(0, "gmock_stats")
    other = frontend.utility(1, "is_sleeping")  # engine 1 is not hung
    assert frontend.utility_result(other) == [other, None, [None, False]]
    # the utility call sent during the hang is answered after it, then the request goes on
    stats = frontend.utility_result(call, timeout=10)[2][1]
    assert time.monotonic() - started >= 0.7
    assert stats["faults"] == {"fault_hang": 1}
    collected = frontend.collect(["hangs"], timeout=10)
    assert len(collected.tokens("hangs")) == 3


@pytest.mark.parametrize("stack", [["--fault-hang", "at=300ms ranks=1"]], indirect=True)
def test_hang_for_ever_keeps_the_sockets_open(stack):
    frontend, app = stack
    gevent.sleep(0.5)
    frontend.add(1, "never", max_tokens=2)
    frontend.add(0, "served", max_tokens=2)
    got = read_for(frontend, 0.8)
    assert len(terminals(got, "served")) == 1 and outputs_of(got, "never") == []
    assert app.counters()[1]["fault_hang"] == 1


@pytest.mark.parametrize("stack", [["--fault-slow-steps", "every=1 factor=6", "--itl-ms", "10"]], indirect=True)
def test_slow_steps(stack):
    frontend, app = stack
    started = time.monotonic()
    frontend.add(0, "slow", max_tokens=10)
    frontend.add(1, "slow-too", max_tokens=10)
    frontend.collect(["slow", "slow-too"], timeout=10)
    # ten 10 ms steps, each 6x as long: at least ~0.5 s (0.1 s unslowed)
    assert time.monotonic() - started >= 0.5
    assert app.counters()[0]["fault_slow_steps"] == 1


@pytest.mark.parametrize("stack", [["--fault-crash", "every=1 ranks=1"]], indirect=True)
def test_crash_of_one_engine_leaves_the_other_serving(stack):
    frontend, app = stack
    frontend.add(1, "lost", max_tokens=3)
    gevent.sleep(0.3)
    frontend.add(0, "served", max_tokens=3)
    got = read_for(frontend, 0.6)
    assert len(terminals(got, "served")) == 1 and outputs_of(got, "lost") == []
    crashed = app.runners[1]
    assert crashed.crashed and all(g.dead for g in [*crashed.readers, crashed.stepper, crashed.sender])
    assert app.counters()[1]["fault_crash"] == 1


@pytest.mark.parametrize("fault", [["--fault-crash", "every=1 ranks=1"], ["--fault-hang", "every=1 ranks=1"]])
def test_drain_does_not_wait_for_a_crashed_or_hung_engine(fault):
    frontend = FakeFrontend(dp=2)
    app, waiter = start_app(frontend, "--engine-count", "2", "--on-stop", "finish", "--drain-timeout", "30", *fault)
    frontend.accept_engines()
    assert app.wait_joined(5)
    frontend.add(1, "stuck", max_tokens=10**6)  # crashes / hangs engine 1 with a request in it
    frontend.add(0, "served", max_tokens=10**6)
    frontend.recv(0)
    gevent.sleep(0.2)
    app.stop()
    # --on-stop finish waits for engine 0's stream (ended here by the client);
    # engine 1 cannot drain and is not waited for (else: --drain-timeout, 30 s)
    frontend.abort(0, ["served"])
    started = time.monotonic()
    assert waiter.get(timeout=10) == 0
    assert time.monotonic() - started < 5
    frontend.close()
