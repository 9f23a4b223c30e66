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


def _sched_module():
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
    import scheduling_fidelity

    return scheduling_fidelity


class _Frontend:
    """A fake frontend's /v1/completions: stamps each request's arrival and
    counts those in flight (each answered after `hold` s)."""

    def __init__(self, hold=0.0):
        import http.server
        import json
        import threading
        import time

        self.seen, self.in_flight, self.most = [], 0, 0
        lock, outer = threading.Lock(), self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - the handler's name
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                with lock:
                    outer.seen.append((time.monotonic(), self.path, body))
                    outer.in_flight += 1
                    outer.most = max(outer.most, outer.in_flight)
                time.sleep(hold)
                with lock:
                    outer.in_flight -= 1
                data = json.dumps({"choices": [{"text": "x"}]}).encode()
                self.send_response(200)
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.base_url = f"http://127.0.0.1:{self.server.server_address[1]}"


def test_the_harness_sends_a_poisson_stream_at_its_offsets_from_the_workload_s_start():
    """The priority workload's priority-0 stream (scheduling_fidelity.Harnessed): the same
    seeded offsets, from its delay on, and prompts in every run; each request POSTed to
    the frontend's /v1/completions at its offset from the start the harness gives."""
    import time

    sf = _sched_module()
    stream = sf.Harnessed("p0", 6, 16, 4, 0, rate=5.0, delay=0.3)
    assert stream.offsets() == sf.Harnessed("p0", 6, 16, 4, 0, rate=5.0, delay=0.3).offsets() and stream.offsets()[0] == 0.3
    assert stream.offsets() != sf.Harnessed("p0", 6, 16, 4, 0, rate=5.0, delay=0.3, seed=501).offsets()
    assert all(b > a for a, b in zip(stream.offsets(), stream.offsets()[1:]))
    assert all(len(p) == 16 and all(1000 <= t < 31000 for t in p) for p in stream.prompts_ids())
    frontend = _Frontend()
    try:
        start = time.monotonic()
        result = sf.send_harnessed(frontend, stream, start, timeout=10.0)
    finally:
        frontend.server.shutdown()
    assert result["completed"] == 6 and result["failed"] == 0
    by_prompt = {tuple(body["prompt"]): (t - start, path, body) for t, path, body in frontend.seen}
    for offset, prompt in zip(stream.offsets(), stream.prompts_ids()):
        at, path, body = by_prompt[tuple(prompt)]
        assert path == "/v1/completions" and body["priority"] == 0 and body["ignore_eos"] and body["max_tokens"] == 4
        assert offset - 0.005 <= at <= offset + 0.25, (offset, at)


def test_the_harness_closed_loop_keeps_its_clients_busy_and_no_more():
    """The priority-1 stream: `concurrency` clients from the delay on, each sending its
    next request when its last one was answered: never more in flight, every prompt once."""
    import time

    sf = _sched_module()
    stream = sf.Harnessed("p1", 12, 8, 4, 1, concurrency=3, delay=0.2)
    frontend = _Frontend(hold=0.05)
    try:
        start = time.monotonic()
        result = sf.send_harnessed(frontend, stream, start, timeout=10.0)
    finally:
        frontend.server.shutdown()
    assert result["completed"] == 12 and result["failed"] == 0
    assert frontend.most == 3
    assert sorted(tuple(b["prompt"]) for _, _, b in frontend.seen) == sorted(tuple(p) for p in stream.prompts_ids())
    assert min(t for t, _, _ in frontend.seen) - start >= 0.2 - 0.005
    assert all(b["priority"] == 1 for _, _, b in frontend.seen)
