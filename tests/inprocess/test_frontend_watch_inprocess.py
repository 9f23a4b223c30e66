"""The engine watches its frontend (runtime/frontend_watch.py), against the fake
frontend in one hub: its sockets closing is noticed within a few seconds (one
log line, the metrics), its coming back too, and --exit-when-frontend-gone
stops the App with status 0 once every engine's frontend is gone that long."""

import os
import signal
import subprocess
import sys
import time

import gevent
import zmq.green as zmq
from loguru import logger

from fake_frontend import FakeFrontend
from gmock_engine.runtime import metrics
from gmock_engine.runtime.app import App
from gmock_engine.config.settings import from_config
from gmock_engine.config.loader import parse_config


def _start(frontend, *flags):
    config = parse_config(["--handshake-address", frontend.handshake_address, "--summary-interval", "0", *flags], env={})
    app = App(from_config(config), config)
    waiter = gevent.spawn(app.run)
    assert app.started.wait(10)
    frontend.accept_engines()
    assert app.wait_joined(5)
    return app, waiter


def _sample(app, name, **labels):
    for family in metrics.registry(app.runners, app).collect():
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return None


def _lines():
    lines = []
    sink = logger.add(lambda message: lines.append(message.record["message"]), level="INFO")
    return lines, sink


def _wait_for(check, timeout, what):
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        gevent.sleep(0.05)


def _kill(frontend):
    """The frontend's sockets close at once, as its kernel closes them when it is killed."""
    for sock in frontend.sockets:
        sock.close(linger=0)


def _come_back(frontend):
    """The frontend binds its sockets again on the same addresses, as after a restart."""
    again = []
    for address, kind in [(a, zmq.ROUTER) for a in frontend.input_addresses] + [(a, zmq.PULL) for a in frontend.output_addresses]:
        sock = frontend.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(address)
        again.append(sock)
    frontend.sockets = again


def test_a_gone_frontend_is_logged_and_counted_and_its_return_too():
    lines, sink = _lines()
    frontend = FakeFrontend(num_clients=2, dp=2)
    app, waiter = _start(frontend, "--engine-count", "2")
    try:
        _wait_for(lambda: _sample(app, "gmock_frontend_connected", engine="1") == 1, 5, "connection")
        addresses = frontend.input_addresses + frontend.output_addresses
        started = time.monotonic()
        _kill(frontend)
        _wait_for(lambda: sum("frontend gone" in line for line in lines) == 2, 3, "'frontend gone' line per engine")
        assert time.monotonic() - started < 3
        gone = [line for line in lines if "frontend gone" in line]
        assert sorted(line.split(":")[0] for line in gone) == ["engine 0", "engine 1"]
        assert all("disconnected" in line and any(a in line for a in addresses) for line in gone), gone
        for rank in ("0", "1"):
            assert _sample(app, "gmock_frontend_connected", engine=rank) == 0
            assert _sample(app, "gmock_frontend_outages_total", engine=rank) == 1
            assert _sample(app, "gmock_frontend_socket_events_total", engine=rank, event="disconnected") >= 1
        # ZMQ retries meanwhile: counted, never logged one by one
        _wait_for(lambda: (_sample(app, "gmock_frontend_socket_events_total", engine="0", event="connect_retried") or 0) >= 2, 5,
                  "reconnect retries")  # fmt: skip
        assert sum("frontend gone" in line for line in lines) == 2

        # the frontend comes back on the same addresses: one "back" line per engine
        _come_back(frontend)
        _wait_for(lambda: sum("frontend back after" in line for line in lines) == 2, 5, "'frontend back' line per engine")
        assert _sample(app, "gmock_frontend_connected", engine="0") == 1
        assert sum("frontend gone" in line for line in lines) == 2
    finally:
        logger.remove(sink)
        app.stop()
        assert waiter.get(timeout=5) == 0
        frontend.close()


def test_exit_when_frontend_gone_stops_with_status_0_after_the_timeout():
    lines, sink = _lines()
    frontend = FakeFrontend(num_clients=1, dp=2)
    app, waiter = _start(frontend, "--engine-count", "2", "--exit-when-frontend-gone", "1")
    try:
        gevent.sleep(1.2)
        assert not waiter.ready()  # connected: nothing to time out
        started = time.monotonic()
        _kill(frontend)
        assert waiter.get(timeout=5) == 0
        took = time.monotonic() - started
        assert 1.0 <= took < 3.0, took
        assert any("--exit-when-frontend-gone" in line for line in lines), lines
    finally:
        logger.remove(sink)
        if not waiter.ready():
            app.stop()
            waiter.join(timeout=5)
        frontend.close()


def test_exit_when_frontend_gone_fires_again_for_a_second_outage():
    """The timer re-arms when the frontend comes back: an outage that the
    process sat out (here the App is not told of the first one) does not use
    up --exit-when-frontend-gone, and the next outage stops the process."""
    lines, sink = _lines()
    frontend = FakeFrontend(num_clients=1, dp=2)
    app, waiter = _start(frontend, "--engine-count", "2", "--exit-when-frontend-gone", "0.3")
    told = []
    forward = []

    def spy(runner, on_expired):
        def expired():
            told.append(runner.rank)
            if forward:
                on_expired()

        return expired

    for runner in app.runners:
        runner.watch.on_expired = spy(runner, runner.watch.on_expired)
    try:
        _wait_for(lambda: _sample(app, "gmock_frontend_connected", engine="1") == 1, 5, "connection")
        _kill(frontend)
        _wait_for(lambda: sorted(told) == [0, 1], 5, "expiry of both engines")
        gevent.sleep(0.5)
        assert sorted(told) == [0, 1] and not waiter.ready()  # once per outage, and the App was not told
        _come_back(frontend)
        _wait_for(lambda: sum("frontend back after" in line for line in lines) == 2, 5, "'frontend back' line per engine")
        forward.append(True)
        _kill(frontend)
        assert waiter.get(timeout=5) == 0
        # the first engine to tell the App stops it (every frontend has been gone that long)
        assert len(told) >= 3 and set(told[2:]) <= {0, 1}, told
        assert any("--exit-when-frontend-gone" in line for line in lines), lines
    finally:
        logger.remove(sink)
        if not waiter.ready():
            app.stop()
            waiter.join(timeout=5)
        frontend.close()


def test_heartbeats_are_set_and_leave_a_libzmq_frontend_alone():
    lines, sink = _lines()
    frontend = FakeFrontend(num_clients=1, dp=1)
    app, waiter = _start(frontend, "--frontend-heartbeat", "0.1")
    try:
        sockets = app.runners[0].sockets
        for sock in [*sockets.inputs, *sockets.outputs]:
            assert sock.getsockopt(zmq.HEARTBEAT_IVL) == 100 and sock.getsockopt(zmq.HEARTBEAT_TIMEOUT) == 300
        gevent.sleep(1.0)  # ten PINGs, each answered by the fake frontend's libzmq
        frontend.add(0, "r1", max_tokens=3)
        assert frontend.collect(["r1"]).tokens("r1")
        assert not any("frontend gone" in line for line in lines), lines
        assert _sample(app, "gmock_frontend_connected", engine="0") == 1
    finally:
        logger.remove(sink)
        app.stop()
        assert waiter.get(timeout=5) == 0
        frontend.close()


#: The fake frontend in a process of its own, so that it can be stopped (SIGSTOP):
#: then it answers nothing, not even a PING, as over a cut link.
FRONTEND_PROCESS = """
import sys
sys.path.insert(0, {tests!r})
import gevent
from fake_frontend import FakeFrontend
frontend = FakeFrontend()
print(frontend.handshake_address, flush=True)
frontend.accept_engines(timeout=20)
gevent.sleep(30)
"""


def test_heartbeats_notice_a_frontend_that_answers_nothing_and_its_return():
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    # stdlib subprocess: gevent's would install its SIGCHLD reaper in this
    # process, and reap the children of later tests behind their Popen's back.
    proc = subprocess.Popen([sys.executable, "-c", FRONTEND_PROCESS.format(tests=tests)], stdout=subprocess.PIPE, text=True)
    lines, sink = _lines()
    app = waiter = None
    try:
        address = proc.stdout.readline().strip()  # blocks the hub, but nothing runs in it yet
        argv = ["--handshake-address", address, "--summary-interval", "0", "--frontend-heartbeat", "0.2"]
        config = parse_config(argv, env={})
        app = App(from_config(config), config)
        waiter = gevent.spawn(app.run)
        assert app.started.wait(10)
        assert app.wait_joined(10)
        gevent.sleep(1.0)  # answered PINGs: nothing happens
        assert not any("frontend gone" in line for line in lines), lines
        os.kill(proc.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        _wait_for(lambda: any("frontend gone" in line for line in lines), 3, "'frontend gone' line")
        assert 0.3 <= time.monotonic() - stopped < 3  # the heartbeat timeout (0.6 s), give or take one interval
        assert _sample(app, "gmock_frontend_connected", engine="0") == 0
        os.kill(proc.pid, signal.SIGCONT)
        _wait_for(lambda: any("frontend back after" in line for line in lines), 5, "'frontend back' line")
        assert sum("frontend gone" in line for line in lines) == 1
    finally:
        logger.remove(sink)
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.wait()
        if app is not None:
            app.stop()
            assert waiter.get(timeout=5) == 0


def test_read_tcp_info_reads_a_connection_and_only_the_one_named():
    """The kernel's view of a live TCP connection (nothing unacknowledged on
    loopback), and None for an FD that is not a connection to that endpoint
    (another port, or closed: libzmq may have closed it)."""
    import socket as plain

    from gmock_engine.runtime.frontend_watch import read_tcp_info

    server = plain.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    client = plain.create_connection(("127.0.0.1", port))
    peer, _ = server.accept()
    try:
        client.sendall(b"x" * 1000)
        assert peer.recv(1000)
        info = read_tcp_info(client.fileno(), f"tcp://127.0.0.1:{port}")
        assert info is not None and info.unacked == 0 and info.last_ack_recv_ms < 5000
        assert read_tcp_info(client.fileno(), f"tcp://localhost:{port}") is not None  # a name: the port decides
        assert read_tcp_info(client.fileno(), f"tcp://127.0.0.1:{port + 1}") is None
        assert read_tcp_info(client.fileno(), f"tcp://127.0.0.2:{port}") is None
        fd = client.fileno()
        client.close()
        assert read_tcp_info(fd, f"tcp://127.0.0.1:{port}") is None
    finally:
        for s in (client, peer, server):
            s.close()
