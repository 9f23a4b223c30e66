"""One gmock_engine process's runtime against the fake frontend, in one hub.

Real sockets (tcp and ipc), real greenlets; the fake frontend plays the
frontend's side of the handshake and traffic (tests/fake_frontend.py).

§N: section N of docs/protocol.md.
"""

import contextlib
import time

import gevent
import msgpack
import pytest

from fake_frontend import Collected, FakeFrontend
from gmock_engine.config.loader import parse_config
from gmock_engine.wire.eras import WIRE_LAYOUTS
from gmock_engine.wire.types import FinishReason
from gmock_engine.runtime.app import App
from gmock_engine.config.settings import from_config
from gmock_engine.tools import frontend as frontend_tools


def start_app(frontend, *extra):
    config = parse_config(["--handshake-address", frontend.handshake_address, *extra], env={})
    app = App(from_config(config), config)
    waiter = gevent.spawn(app.run)
    assert app.started.wait(10)
    return app, waiter


@contextlib.contextmanager
def serving(frontend, *flags, **accept):
    """gmock_engine's App with `flags`, joined to `frontend`. Afterwards it must
    stop with status 0 and, whatever the test did, its books balance (core/ledger.py)."""
    app, waiter = start_app(frontend, *flags)
    frontend.accept_engines(**accept)
    assert app.wait_joined(5)
    yield app
    app.stop()
    assert waiter.get(timeout=5) == 0
    frontend.close()
    assert all(counts["violations"] == 0 for counts in app.counters().values()), app.counters()


@pytest.fixture
def dp4():
    """4 engines, 2 clients, with a coordinator: the `vllm serve --data-parallel-size 4
    --api-server-count 2` topology."""
    frontend = FakeFrontend(num_clients=2, dp=4, coordinator=True, stats_address="ipc:///tmp/fake-stats")
    flags = ("--engine-count", "4", "--num-gpu-blocks", "1234", "--output-token-chunk-size", "2")
    with serving(frontend, *flags, gate_check=0.3) as app:
        yield frontend, app


def test_handshake_dp4_two_clients_with_coordinator(dp4):
    frontend, app = dp4
    assert set(frontend.hellos) == {0, 1, 2, 3}
    for rank in range(4):
        assert frontend.hellos[rank] == {"status": "HELLO", "local": False, "headless": True}
        ready = frontend.readies[rank]
        assert ready["status"] == "READY" and ready["num_gpu_blocks"] == 1234
        assert ready["dp_stats_address"] == "ipc:///tmp/fake-stats"
        # one registration per input socket, full 0.33 key set, right types
        registrations = frontend.registrations[rank]
        assert len(registrations) == 2
        for reg in registrations:
            assert len(reg) == 28
            assert reg["data_parallel_rank"] == rank and reg["data_parallel_size"] == 4
            assert reg["num_gpu_blocks"] == 1234 and reg["max_model_len"] == 1048576
            assert reg["dtype"] in ("float16", "bfloat16", "float32")
            assert isinstance(reg["instance_id"], str) and reg["supports_lora"] is False
            assert reg["dp_stats_address"] == "ipc:///tmp/fake-stats"
            assert reg["coordinator_input_address"] == frontend.coord_addresses[0]


def test_requests_on_every_engine_and_client(dp4):
    frontend, app = dp4
    ids = {}
    for rank in range(4):
        for client in range(2):
            rid = f"req-{rank}-{client}"
            ids[rid] = (rank, client)
            frontend.add(rank, rid, max_tokens=5 + rank, client=client)
    for client in range(2):
        mine = [r for r, (_, c) in ids.items() if c == client]
        collected = frontend.collect(mine, client=client)
        for rid in mine:
            rank = ids[rid][0]
            assert len(collected.tokens(rid)) == 5 + rank
            assert [len(o[1]) for o in collected.outputs[rid]][:-1] == [2] * ((5 + rank - 1) // 2)
            assert collected.terminal[rid] == FinishReason.LENGTH
        assert sorted(collected.finished_requests) == sorted(mine)
        for message in collected.messages:
            assert 4 <= len(message) <= 9 and message[1]  # never empty
            assert all(ids[o[0]][0] == message[0] for o in message[1])  # engine_index = rank
    counts = app.counters()
    assert all(counts[r]["finished_length"] == 2 for r in range(4))
    # every engine told the coordinator its running count, ending at 0 (§6.2)
    last = {}
    with gevent.Timeout(5):
        while len(last) < 4 or any(s["num_running_reqs"] for s in last.values()):
            message = msgpack.unpackb(frontend.coord_pull.recv(), strict_map_key=False)
            assert message[1] == [] and len(message) == 4
            last[message[0]] = message[2]
    assert set(last) == {0, 1, 2, 3}


def test_utility_reply_goes_to_the_callers_client_only(dp4):
    frontend, _ = dp4
    call_id = frontend.utility(2, "get_supported_tasks", client=1, call_id=2**64 - 2)
    assert frontend.utility_result(call_id, client=1) == [2**64 - 2, None, [None, ["generate"]]]
    assert frontend.poll_nothing(client=0) and frontend.poll_nothing(client=1)


def test_bad_frames_are_dropped_and_the_engine_keeps_serving(dp4):
    frontend, app = dp4
    bad = [
        [b"\x09", b"x"],
        [b"\x00", b"\xc1\xc1"],
        [b"\x00"],
        [b"\x00", msgpack.packb(msgpack.ExtType(1, b"pickle"))],
        [b"\x03", msgpack.packb([0, 1])],
    ]
    for frames in bad:
        frontend.send_raw(1, 0, frames)
    # a readable id with a bad value is not a bad frame: that request gets an ERROR
    frontend.send_raw(1, 0, [b"\x00", msgpack.packb(["r", "not-a-list", None, {}, None])])
    frontend.add(1, "after-bad", max_tokens=3)
    collected = frontend.collect(["after-bad", "r"])
    assert len(collected.tokens("after-bad")) == 3
    assert collected.terminal["r"] == FinishReason.ERROR and "r" in collected.finished_requests
    error = collected.outputs["r"][-1][WIRE_LAYOUTS["0.33"].output_position("error")]
    assert error["code"] == "validation_error" and "prompt_token_ids is str" in error["message"]
    assert app.counters()[1]["bad_frames"] == len(bad)


def test_a_message_with_aux_frames_is_read_to_its_last_frame(dp4):
    """[type, payload, aux...] (§3.1): the reader takes every frame of a
    message (each frame's own more flag), so the frames after an ADD's aux
    frames start the next message, not the tail of this one."""
    frontend, app = dp4
    request = frontend_tools.engine_core_request("with-aux", [1, 2, 3], {"max_tokens": 2}, client_index=0)
    frontend.send_raw(2, 0, [*frontend_tools.add_frames(request), b"aux-0" * 100, b"aux-1"])
    frontend.add(2, "next", max_tokens=2)
    collected = frontend.collect(["with-aux", "next"])
    assert len(collected.tokens("with-aux")) == 2 and len(collected.tokens("next")) == 2
    assert app.counters()[2]["bad_frames"] == 0


def test_abort_and_pause_end_streams(dp4):
    frontend, app = dp4
    frontend.add(0, "long-a", max_tokens=10**9, client=0)
    frontend.add(0, "long-b", max_tokens=10**9, client=1)
    frontend.recv(0)
    frontend.abort(0, ["long-a", "never-seen"], client=0)
    collected = frontend.collect(["long-a"], client=0)
    assert collected.terminal["long-a"] == FinishReason.ABORT
    assert "long-a" in collected.finished_requests
    # /pause in abort mode reaches the engine only as the utility call (§3.4)
    call_id = frontend.utility(0, "pause_generation", ["abort", True], client=0)
    collected = frontend.collect(["long-b"], client=1)
    assert collected.terminal["long-b"] == FinishReason.ABORT
    assert frontend.utility_result(call_id, client=0)[1] is None
    assert app.counters()[0]["active"] == 0


def test_coordinator_late_ready_and_start_wave_are_ignored(dp4):
    frontend, app = dp4
    frontend.coord_pub.send(b"READY")
    frontend.coord_pub.send_multipart([b"\x02", msgpack.packb([3, None])])
    frontend.coord_pub.send_multipart([b"\x02", msgpack.packb([4, b"\x00\x00"])])
    frontend.coord_pub.send_multipart([b"\x02", b"\xc1"])  # undecodable: dropped
    frontend.add(3, "after-wave", max_tokens=2)
    assert len(frontend.collect(["after-wave"]).tokens("after-wave")) == 2
    assert app.counters()[3]["bad_frames"] == 1


def test_ipc_handshake_and_data_sockets(tmp_path):
    frontend = FakeFrontend(num_clients=1, dp=2, transport="ipc", ipc_dir=str(tmp_path))
    app, waiter = start_app(frontend, "--engine-count", "2", "--data-parallel-size", "2")
    try:
        frontend.accept_engines()
        assert frontend.handshake_address.startswith("ipc://")
        frontend.add(1, "ipc-req", max_tokens=4)
        assert len(frontend.collect(["ipc-req"]).tokens("ipc-req")) == 4
    finally:
        app.stop()
        assert waiter.get(timeout=5) == 0
        frontend.close()


def test_start_rank_offsets_identities():
    frontend = FakeFrontend(num_clients=1, dp=4)
    app, waiter = start_app(frontend, "--engine-count", "2", "--data-parallel-start-rank", "2")
    try:
        frontend.accept_engines(ranks=[2, 3])
        assert frontend.registrations[3][0]["data_parallel_rank"] == 3
        assert frontend.registrations[3][0]["data_parallel_size"] == 4
        frontend.add(3, "r3", max_tokens=2)
        message = frontend.recv()
        assert message[0] == 3
    finally:
        app.stop()
        assert waiter.get(timeout=5) == 0
        frontend.close()


def test_the_handshake_connection_is_closed_once_ready():
    """Each engine closes its handshake DEALER after READY (as vLLM's engine does):
    both frontends close the handshake ROUTER once all engines are ready, and an
    open DEALER would reconnect to it for ever (~7 refused connections a second
    per engine, across hosts a steady stream of SYNs at the frontend's firewall)."""
    from zmq.utils.monitor import recv_monitor_message
    import zmq.green as zmq

    frontend = FakeFrontend(num_clients=1, dp=2)
    monitor = frontend.handshake.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
    app, waiter = start_app(frontend, "--engine-count", "2")
    try:
        frontend.accept_engines()
        events = []
        with gevent.Timeout(5):
            while events.count(zmq.EVENT_DISCONNECTED) < 2:
                events.append(recv_monitor_message(monitor)["event"])
        assert events.count(zmq.EVENT_ACCEPTED) == 2, events
        assert all(r.sockets.handshake is None for r in app.runners)
        frontend.add(1, "after-close", max_tokens=3)
        assert len(frontend.collect(["after-close"]).tokens("after-close")) == 3
    finally:
        frontend.handshake.disable_monitor()
        monitor.close(linger=0)
        app.stop()
        assert waiter.get(timeout=5) == 0
        frontend.close()


def test_shutdown_is_ordered_and_bounded_with_active_requests():
    frontend = FakeFrontend(num_clients=1, dp=2)
    app, waiter = start_app(frontend, "--engine-count", "2")
    frontend.accept_engines()
    for i in range(200):
        frontend.add(i % 2, f"busy-{i}", max_tokens=10**9)
    frontend.recv()
    started = gevent.get_hub().loop.now()
    app.stop()
    assert waiter.get(timeout=5) == 0
    assert gevent.get_hub().loop.now() - started < 2.0
    assert all(g.dead for g in app.supervisor.group)
    frontend.close()


def test_a_malformed_init_stops_the_process_with_status_1():
    frontend = FakeFrontend(num_clients=1, dp=1)
    app, waiter = start_app(frontend)
    try:
        with gevent.Timeout(5):
            ident, _ = frontend.handshake.recv_multipart()
        frontend.handshake.send_multipart([ident, msgpack.packb({"addresses": {"inputs": []}})])
        assert waiter.get(timeout=5) == 1
        assert "handshake" in app.supervisor.failure and "inputs" in app.supervisor.failure
    finally:
        frontend.close()


def test_a_failing_greenlet_stops_everything(monkeypatch):
    frontend = FakeFrontend(num_clients=1, dp=2)
    app, waiter = start_app(frontend, "--engine-count", "2")
    try:
        frontend.accept_engines()

        def explode(*args):
            raise RuntimeError("boom in add_request")

        # a failing input is contained (next test); failing to answer it is
        # a failure of the engine itself, which stops the process
        monkeypatch.setattr(app.runners[1].engine, "add_request", explode)
        monkeypatch.setattr(app.runners[1].engine, "answer_failure", explode)
        frontend.add(1, "trigger", max_tokens=1)
        assert waiter.get(timeout=5) == 1  # the whole process stops, status 1
        assert "engine-1-stepper" in app.supervisor.failure and "boom" in app.supervisor.failure
        assert all(g.dead for g in app.supervisor.group)
    finally:
        frontend.close()


def test_an_input_that_makes_the_engine_fail_is_answered_and_contained(monkeypatch):
    frontend = FakeFrontend(num_clients=1, dp=1)
    with serving(frontend) as app:
        engine = app.runners[0].engine
        real_add = engine.add_request

        def explode_once(request):
            if request.request_id == "trigger":
                raise RuntimeError("boom in add_request")
            return real_add(request)

        monkeypatch.setattr(engine, "add_request", explode_once)
        frontend.add(0, "trigger", max_tokens=4)
        frontend.add(0, "after", max_tokens=4)
        collected = frontend.collect(["trigger", "after"])
        assert collected.terminal["trigger"] == FinishReason.ERROR and "trigger" in collected.finished_requests
        error = collected.outputs["trigger"][-1][WIRE_LAYOUTS["0.33"].output_position("error")]
        assert error["code"] == "internal_error" and "boom in add_request" in error["message"]
        assert len(collected.tokens("after")) == 4
        counts = app.counters()[0]
        assert counts["contained_failures"] == 1 and counts["violations"] == 0 and counts["active"] == 0


def test_an_output_that_cannot_be_encoded_ends_its_request_only(monkeypatch):
    """The sender's second line of defence: a value the packer refuses (here
    a stop_reason beyond 64 bits, planted past the engine's own checks) ends
    that request with ERROR; its later outputs are held back; others go on."""
    frontend = FakeFrontend(num_clients=1, dp=1)
    with serving(frontend) as app:
        engine = app.runners[0].engine
        real_step = engine.step

        def poisoned_step():
            out = real_step()
            for _, message in out:
                for output in message[1]:
                    if output[0] == "bad" and len(output[1]) and output[1][0] >= 0:
                        output[1][0] = 10**30  # not a msgpack int
            return out

        monkeypatch.setattr(engine, "step", poisoned_step)
        frontend.add(0, "bad", max_tokens=50)
        frontend.add(0, "good", max_tokens=50)
        collected = frontend.collect(["bad", "good"])
        assert collected.terminal["bad"] == FinishReason.ERROR and collected.tokens("bad") == []
        assert collected.finished_requests.count("bad") == 1  # its own end was held back
        assert len(collected.tokens("good")) == 50 and collected.terminal["good"] == FinishReason.LENGTH
        assert frontend.poll_nothing(client=0)
        assert app.counters()[0]["contained_failures"] >= 1


def test_itl_paces_steps_on_the_engine_clock():
    """--itl-ms 20: consecutive steps are never closer than the interval
    (a lower bound: the engine sleeps until each slot; no upper bound is
    asserted on this shared machine)."""
    frontend = FakeFrontend(num_clients=1, dp=1)
    app, waiter = start_app(frontend, "--itl-ms", "20")
    try:
        frontend.accept_engines()
        frontend.add(0, "paced-a", max_tokens=6)
        frontend.add(0, "paced-b", max_tokens=6)
        collected = frontend.collect(["paced-a", "paced-b"])
        stamps = [m[3] for m in collected.messages]
        sizes = [len(m[1]) for m in collected.messages]
        # Both requests advance on the same steps: 6 messages of two outputs,
        # not 12. The reader may step paced-a once before it has read
        # paced-b's ADD (a clean-clone CI run saw that); then paced-a's
        # first and paced-b's last output are alone: 7 messages.
        assert sizes in ([2] * 6, [1] + [2] * 5 + [1]), sizes
        gaps = [b - a for a, b in zip(stamps, stamps[1:])]
        # Timestamps are taken after each step's work, so one gap can be
        # short by the difference of two steps' compute times (µs here).
        assert min(gaps) >= 0.018, gaps
        assert stamps[-1] - stamps[0] >= (len(stamps) - 1) * 0.020 - 0.001, stamps
        call_id = frontend.utility(0, "gmock_stats")
        stats = frontend.utility_result(call_id)[2][1]
        # the first step starts when the work arrives (no slot to be late for)
        assert stats["step_lateness_us"]["total"] == len(stamps) - 1
        assert stats["step_lateness_us"]["count"] == len(stamps) - 1
        assert stats["ledger"]["finished_length"] == 2 and stats["active"] == 0
        # gmock_stats(True): a new window from here (the bench's measured
        # window); `total` still counts every step since the start
        frontend.utility_result(frontend.utility(0, "gmock_stats", [True]))
        frontend.add(0, "paced-c", max_tokens=3)
        frontend.collect(["paced-c"])
        stats = frontend.utility_result(frontend.utility(0, "gmock_stats"))[2][1]
        assert stats["step_lateness_us"]["count"] == 2, stats["step_lateness_us"]
        assert stats["step_lateness_us"]["total"] == len(stamps) - 1 + 2
    finally:
        app.stop()
        assert waiter.get(timeout=5) == 0
        frontend.close()


@pytest.mark.parametrize("mode", ["abort", "finish"])
def test_on_stop_drains_every_stream_then_exits(mode):
    frontend = FakeFrontend(num_clients=2, dp=1)
    extra = ["--on-stop", mode, "--send-dead-on-exit", "--itl-ms", "5"]
    app, waiter = start_app(frontend, *extra)
    try:
        frontend.accept_engines()
        long = 10**9 if mode == "abort" else 40
        for i in range(50):
            frontend.add(0, f"d{i}", max_tokens=long, client=i % 2)
        first = frontend.recv(0)
        # Stop only once all 50 are admitted. An ADD still in the socket when
        # the stop is queued is applied after it and refused with ABORT (as
        # "too-late" below is); the first output alone does not mean the
        # reader has taken the rest (a clean-clone CI run saw d4.. refused).
        with gevent.Timeout(10):
            while app.counters()[0]["active"] < 50:
                gevent.sleep(0.005)
        app.stop()
        late = mode == "finish"  # finishing takes 40 steps of 5 ms: time for a newcomer
        if late:
            gevent.sleep(0.05)
            frontend.add(0, "too-late", max_tokens=5)  # arrives while draining
        for client in range(2):
            mine = [f"d{i}" for i in range(50) if i % 2 == client] + (["too-late"] if client == 0 and late else [])
            collected = Collected()
            if client == 0:
                collected.add(first)
            collected = frontend.collect(mine, client=client, timeout=30, into=collected)
            expected = 2 if mode == "abort" else 1  # ABORT, or LENGTH after all 40 tokens
            assert all(collected.terminal[r] == expected for r in mine if r != "too-late"), collected.terminal
            if mode == "finish":
                assert all(len(collected.tokens(r)) == 40 for r in mine if r != "too-late")
            if client == 0 and late:
                assert collected.terminal["too-late"] == 2  # rejected in shutdown with ABORT
            # then the dead-engine sentinel (§4.1), raw, once per client
            with gevent.Timeout(10):
                while True:
                    frame = frontend.outputs[client].recv()
                    if frame == b"ENGINE_CORE_DEAD":
                        break
        assert waiter.get(timeout=10) == 0
        assert all(c["violations"] == 0 and c["active"] == 0 for c in app.counters().values())
    finally:
        frontend.close()


def test_a_stop_with_the_frontend_gone_and_outputs_backed_up_is_clean_and_says_what_was_lost():
    """The frontend stopped reading: the PUSH is at its high-water mark, the
    sender blocked in send, the output queue full. A stop must still exit 0
    within its budget (not by waking the sender with its socket closing,
    which ends in a ZMQError and exit 1), and --send-dead-on-exit must say that
    ENGINE_CORE_DEAD could not go out rather than drop it silently."""
    from loguru import logger

    lines = []
    sink = logger.add(lambda message: lines.append(str(message)), level="WARNING")
    frontend = FakeFrontend(num_clients=1, dp=1)
    app, waiter = start_app(frontend, "--send-dead-on-exit")
    try:
        frontend.accept_engines()
        assert app.wait_joined(5)
        frontend.outputs[0].close(linger=0)  # nobody reads the engine's outputs any more
        for i in range(8):
            frontend.add(0, f"long-{i}", max_tokens=10**9)
        runner = app.runners[0]
        with gevent.Timeout(20):
            while not runner.links.output_queue.full():
                gevent.sleep(0.05)
        started = time.monotonic()
        app.stop()
        assert waiter.get(timeout=5) == 0
        assert time.monotonic() - started < 2.0  # bounded: the budgets add up to well under a second
        text = "\n".join(lines)
        assert "outputs not flushed" in text and "ENGINE_CORE_DEAD not sent on output[0]" in text
        assert app.supervisor.failure is None
    finally:
        logger.remove(sink)
        frontend.close()


def test_pd_producer_params_and_consumer_wait_over_real_sockets():
    """P/D (kv/transfer.py): a producer's terminal output carries its
    kv_transfer_params at index 8 on the wire; a consumer given them waits
    the transfer time before its first token."""
    params = {"do_remote_decode": True, "remote_engine_id": None, "remote_block_ids": None}
    frontend = FakeFrontend(num_clients=1, dp=1)
    with serving(frontend, "--kv-role", "both", "--kv-transfer-ms-per-token", "100"):
        frontend.add(0, "p", sampling_params={"max_tokens": 9, "extra_args": {"kv_transfer_params": params}})
        produced = frontend.collect(["p"])
        assert len(produced.tokens("p")) == 1 and produced.terminal["p"] == FinishReason.LENGTH
        returned = produced.outputs["p"][-1][8]
        assert returned["do_remote_prefill"] is True and returned["remote_request_id"] == "p"
        t0 = time.monotonic()
        frontend.add(0, "d", sampling_params={"max_tokens": 3, "extra_args": {"kv_transfer_params": returned}})
        consumed = frontend.collect(["d"])
        assert time.monotonic() - t0 >= 0.3  # 3 prompt tokens at 100 ms: a lower bound only
        assert len(consumed.tokens("d")) == 3 and consumed.terminal["d"] == FinishReason.LENGTH


def test_the_input_slice_grows_with_the_running_batch():
    """3000 long ADDs at once: between two steps the stepper takes in at
    most max(INPUT_SLICE, running // INPUT_SLICE_DIVISOR) of them, so the
    intake grows as the batch does and all are running well before
    3000 / INPUT_SLICE steps (at its CPU limit an unpaced engine must not
    leave ADDs queued in front of the scheduler)."""
    from gmock_engine.runtime.runner import INPUT_SLICE, INPUT_SLICE_DIVISOR

    frontend = FakeFrontend(num_clients=1, dp=1)
    with serving(frontend):
        rids = [f"long-{i}" for i in range(3000)]
        for rid in rids:
            frontend.add(0, rid, max_tokens=100_000)
        firsts: list = []
        seen = 0
        with gevent.Timeout(30):
            while seen < len(rids):
                message = frontend.recv(0)
                if message[1]:
                    n = sum(1 for o in message[1] if len(o) > 2)  # first outputs carry events
                    firsts.append(n)
                    seen += n
    running = 0
    for n in firsts:
        if n:
            assert n <= max(INPUT_SLICE, running // INPUT_SLICE_DIVISOR), (n, running)
        running += n
    assert max(firsts) > INPUT_SLICE  # it grew
    assert len(firsts) < len(rids) // INPUT_SLICE  # sooner than fixed slices would


def test_a_flood_of_adds_is_admitted_in_slices_between_steps():
    """2000 ADDs at once: each step admits at most runner.INPUT_SLICE of
    them, so the first ones get their first token while the rest
    are still being taken in, and none is lost."""
    from gmock_engine.runtime.runner import INPUT_SLICE

    frontend = FakeFrontend(num_clients=1, dp=1)
    with serving(frontend):
        rids = [f"flood-{i}" for i in range(2000)]
        for rid in rids:
            frontend.add(0, rid, max_tokens=3)
        collected = frontend.collect(rids)
    firsts = [sum(1 for o in m[1] if len(o) > 2 and o[5] is None) for m in collected.messages]
    assert sum(firsts) == len(rids)
    assert max(firsts) <= INPUT_SLICE, max(firsts)
    assert all(len(collected.tokens(rid)) == 3 for rid in rids)
