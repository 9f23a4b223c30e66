"""The record tap (`python -m gmock_engine record`, docs/record.md) in its own
process, between the fake frontend and (1) an engine of the test's own that
shows every frame it gets and sends, (2) the mock engine in its own process.
§N: section N of docs/protocol.md.
"""

import contextlib
import os
import signal
import subprocess
import sys
import time

import gevent
import msgpack
import pytest
import zmq.green as zmq

from fake_frontend import FakeFrontend, engine_core_request
from gmock_engine.tools.frontend import abort_frames, add_frames, utility_frames
from gmock_engine.timing.trace import read_trace

REPO_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def packed(obj):
    return msgpack.packb(obj, use_bin_type=True)


def unpacked(data):
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def wait_exit(proc, timeout):
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        gevent.sleep(0.02)
    assert proc.poll() is not None, f"process did not exit within {timeout} s"
    return proc.returncode


@contextlib.contextmanager
def process(tmp_path, name, args):
    """`python -m gmock_engine <args>`, output to tmp_path/<name>.log; killed at the end if still running."""
    log = open(tmp_path / f"{name}.log", "w+")
    env = {k: v for k, v in os.environ.items() if not k.startswith("GMOCK_")}
    proc = subprocess.Popen([sys.executable, "-m", "gmock_engine", *args], cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


def stop_tap(tap, tmp_path):
    tap.send_signal(signal.SIGTERM)
    assert wait_exit(tap, 15) == 0, (tmp_path / "tap.log").read_text()[-3000:]


class RawEngine:
    """One engine's side of §2 and §3/§4 with raw frames: what it got, what it sends."""

    def __init__(self, ctx, rank, handshake_address):
        self.rank = rank
        self.identity = rank.to_bytes(2, "little")
        self.hs = ctx.socket(zmq.DEALER)
        self.hs.setsockopt(zmq.IDENTITY, self.identity)
        self.hs.setsockopt(zmq.LINGER, 0)
        self.hs.connect(handshake_address)
        self.ctx = ctx
        self.hello = packed({"status": "HELLO", "local": False, "headless": True})
        self.registration = packed({"max_model_len": 100 + rank, "data_parallel_rank": rank, "dp_stats_address": None})
        self.ready = packed({"status": "READY", "local": False, "headless": True, "num_gpu_blocks": 10 + rank, "dp_stats_address": None})

    def join(self):
        self.hs.send(self.hello)
        self.init = unpacked(self.hs.recv())
        self.inputs, self.outputs = [], []
        for address in self.init["addresses"]["inputs"]:
            dealer = self.ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.IDENTITY, self.identity)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(address)
            dealer.send(self.registration)
            self.inputs.append(dealer)
        for address in self.init["addresses"]["outputs"]:
            push = self.ctx.socket(zmq.PUSH)
            push.setsockopt(zmq.LINGER, 0)
            push.connect(address)
            self.outputs.append(push)
        self.hs.send(self.ready)


def test_every_frame_is_relayed_byte_equal_and_traced(tmp_path):
    stats_address = "ipc:///tmp/frontend-stats-not-used"
    frontend = FakeFrontend(num_clients=2, dp=3, stats_address=stats_address)
    ctx = zmq.Context()
    engine_hs = f"ipc://{tmp_path}/tap-hs"
    trace_path = tmp_path / "trace.jsonl"
    args = ["record", "--handshake-address", frontend.handshake_address, "--engine-handshake-address", engine_hs,
            "--engine-count", "2", "--data-parallel-start-rank", "1", "-o", str(trace_path)]  # fmt: skip
    try:
        with process(tmp_path, "tap", args) as tap:
            engines = [RawEngine(ctx, rank, engine_hs) for rank in (1, 2)]
            accept = gevent.spawn(frontend.accept_engines, ranks=[1, 2], timeout=20)
            with gevent.Timeout(20):
                for engine in engines:
                    engine.join()
            accept.get()

            # Handshake: HELLO, READY and registrations unchanged; INIT with the
            # tap's data sockets and everything else the frontend's.
            for engine in engines:
                assert packed(frontend.hellos[engine.rank]) == engine.hello
                assert packed(frontend.readies[engine.rank]) == engine.ready
                assert [packed(r) for r in frontend.registrations[engine.rank]] == [engine.registration] * 2
                addresses = engine.init["addresses"]
                assert len(addresses["inputs"]) == len(addresses["outputs"]) == 2
                assert not set(addresses["inputs"] + addresses["outputs"]) & set(frontend.input_addresses + frontend.output_addresses)
                assert addresses["frontend_stats_publish_address"] == stats_address
                assert addresses["coordinator_input"] is None and engine.init["parallel_config"] == {}

            # Inputs, frontend -> engine, every client and rank, with an aux frame.
            sent = {}
            for engine in engines:
                for client in (0, 1):
                    rid = f"r{engine.rank}-{client}"
                    request = engine_core_request(rid, prompt_token_ids=list(range(3 + client)), sampling_params={"max_tokens": 4}, client_index=client)
                    messages = [add_frames(request) + [b"aux-tensor-bytes"], abort_frames([rid]), utility_frames(client, 7, "is_sleeping", [])]
                    for frames in messages:
                        frontend.send_raw(engine.rank, client, frames)
                    sent[engine.rank, client] = messages
            with gevent.Timeout(10):
                for engine in engines:
                    for client in (0, 1):
                        got = [engine.inputs[client].recv_multipart() for _ in range(3)]
                        assert got == sent[engine.rank, client]

            # Outputs, engine -> frontend: a token batch with stats, a finish, a multi-frame message, the dead sentinel.
            pushed = {0: [], 1: []}
            for engine in engines:
                for client in (0, 1):
                    rid = f"r{engine.rank}-{client}"
                    messages = [
                        [packed([engine.rank, [[rid, [1, 2]]], {"num_running_reqs": 1, "num_waiting_reqs": 0, "kv_cache_usage": 0.5}, 1.0])],
                        [packed([engine.rank, [[rid, [3, 4], None, None, None, 1]], None, 2.0, None, [rid]])],
                        [packed([engine.rank, [], None, 3.0, [7, None, [None, False]]]), b"out-of-band"],
                    ]
                    for frames in messages:
                        engine.outputs[client].send_multipart(frames)
                    pushed[client].extend(messages)
            for engine in engines:
                engine.outputs[0].send(b"ENGINE_CORE_DEAD")
            pushed[0].extend([[b"ENGINE_CORE_DEAD"]] * 2)
            with gevent.Timeout(10):
                for client in (0, 1):
                    got = [frontend.outputs[client].recv_multipart() for _ in pushed[client]]
                    # engines' messages may interleave; each engine's own order is kept
                    assert sorted(got) == sorted(pushed[client])
                    for rank in (1, 2):
                        mine = [m for m in got if m[0] != b"ENGINE_CORE_DEAD" and unpacked(m[0])[0] == rank]
                        assert mine == [m for m in pushed[client] if m[0] != b"ENGINE_CORE_DEAD" and unpacked(m[0])[0] == rank]
            assert frontend.poll_nothing(0) and frontend.poll_nothing(1)
            stop_tap(tap, tmp_path)
    finally:
        ctx.destroy(linger=0)
        frontend.close()

    head, records = read_trace(str(trace_path))
    assert (head["format"], head["version"], head["ranks"], head["record_token_ids"]) == ("gmock-trace", 1, [1, 2], False)
    adds = {(r["rank"], r["client"]): r for r in records if r["kind"] == "add"}
    assert sorted(adds) == [(1, 0), (1, 1), (2, 0), (2, 1)]
    for (rank, client), add in adds.items():
        assert (add["request_id"], add["prompt_len"], add["max_tokens"], add["client_index"]) == (f"r{rank}-{client}", 3 + client, 4, client)
    assert sorted((r["rank"], r["client"], r["method"]) for r in records if r["kind"] == "utility") == [
        (1, 0, "is_sleeping"), (1, 1, "is_sleeping"), (2, 0, "is_sleeping"), (2, 1, "is_sleeping")]  # fmt: skip
    assert len([r for r in records if r["kind"] == "abort"]) == 4
    outputs = [r for r in records if r["kind"] == "output"]
    assert len(outputs) == 12 and all(r["engine_index"] == r["rank"] for r in outputs)
    for rank in (1, 2):
        for client in (0, 1):
            rid = f"r{rank}-{client}"
            mine = [q for r in outputs if (r["rank"], r["client"]) == (rank, client) for q in r["requests"]]
            assert [(q["id"], q["tokens"], q["finish_reason"]) for q in mine] == [(rid, 2, None), (rid, 2, 1)]
    assert sum(1 for r in outputs if r.get("utility_call_id") == 7) == 4
    assert sum(1 for r in outputs if r["stats"] == {"num_running_reqs": 1, "num_waiting_reqs": 0, "kv_cache_usage": 0.5}) == 4
    assert sorted(r["rank"] for r in records if r["kind"] == "dead") == [1, 2]
    assert all(r["t"] > 1e9 for r in records)


@pytest.mark.parametrize("token_ids", [False, True])
def test_mock_engine_behind_the_tap(tmp_path, token_ids):
    frontend = FakeFrontend(num_clients=1, dp=1)
    probe = zmq.Context().socket(zmq.ROUTER)
    port = probe.bind_to_random_port("tcp://127.0.0.1")
    probe.close(linger=0)
    engine_hs = f"tcp://127.0.0.1:{port}"
    trace_path = tmp_path / "trace.jsonl"
    tap_args = ["record", "--handshake-address", frontend.handshake_address, "--engine-handshake-address", engine_hs, "-o", str(trace_path)]
    if token_ids:
        tap_args.append("--record-token-ids")
    lengths = {"a": 5, "b": 7, "c": 1}
    try:
        with process(tmp_path, "tap", tap_args) as tap, process(tmp_path, "engine", ["--handshake-address", engine_hs, "--itl-ms", "5"]) as engine:
            frontend.accept_engines(timeout=60)
            assert frontend.registrations[0][0]["data_parallel_rank"] == 0
            for rid, n in lengths.items():
                frontend.add(0, rid, max_tokens=n)
            collected = frontend.collect(list(lengths), timeout=30)
            for rid, n in lengths.items():
                assert len(collected.tokens(rid)) == n
                assert collected.terminal[rid] == 1  # LENGTH
            engine.send_signal(signal.SIGTERM)
            wait_exit(engine, 30)
            stop_tap(tap, tmp_path)
    finally:
        frontend.close()

    head, records = read_trace(str(trace_path))
    assert head["record_token_ids"] is token_ids
    adds = [r for r in records if r["kind"] == "add"]
    assert {r["request_id"]: r["max_tokens"] for r in adds} == lengths
    assert all(r["prompt_len"] == 3 for r in adds)
    outputs = [r for r in records if r["kind"] == "output"]
    # every message the frontend got is in the trace, in order
    assert [[q["id"] for q in r["requests"]] for r in outputs if r["requests"]] == [[o[0] for o in m[1]] for m in collected.messages if m[1]]
    for rid, n in lengths.items():
        mine = [q for r in outputs for q in r["requests"] if q["id"] == rid]
        assert sum(q["tokens"] for q in mine) == n
        assert [q["finish_reason"] for q in mine][-1] == 1
        if token_ids:
            assert [t for q in mine for t in q["token_ids"]] == collected.tokens(rid)
        else:
            assert all("token_ids" not in q for q in mine)
    assert any(r["stats"] and "num_running_reqs" in r["stats"] for r in outputs)
    assert sorted(set().union(*(r["finished_requests"] or () for r in outputs))) == sorted(lengths)


def test_an_engine_outside_the_ranks_is_not_relayed(tmp_path):
    frontend = FakeFrontend(num_clients=1, dp=1)
    ctx = zmq.Context()
    engine_hs = f"ipc://{tmp_path}/tap-hs"
    args = ["record", "--handshake-address", frontend.handshake_address, "--engine-handshake-address", engine_hs, "-o", str(tmp_path / "t.jsonl")]
    try:
        with process(tmp_path, "tap", args) as tap:
            stranger = RawEngine(ctx, 5, engine_hs)
            stranger.hs.send(stranger.hello)
            with gevent.Timeout(10):
                while "not one of ranks [0]: ignored" not in (tmp_path / "tap.log").read_text():
                    gevent.sleep(0.05)
            with pytest.raises(gevent.Timeout), gevent.Timeout(0.5):
                frontend.handshake.recv_multipart()
            engine = RawEngine(ctx, 0, engine_hs)
            accept = gevent.spawn(frontend.accept_engines, timeout=10)
            with gevent.Timeout(10):
                engine.join()
            accept.get()
            assert list(frontend.hellos) == [0]
            stop_tap(tap, tmp_path)
    finally:
        ctx.destroy(linger=0)
        frontend.close()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--engine-handshake-address", "tcp://127.0.0.1:1"], "--handshake-address"),
        (["--handshake-address", "127.0.0.1:1", "--engine-handshake-address", "tcp://127.0.0.1:1"], "is not tcp://host:port or ipc:///path (from command line)"),
        (["--handshake-address", "tcp://127.0.0.1:1", "--engine-handshake-address", "tcp://127.0.0.1:2", "--engine-count", "0"], "--engine-count/--data-parallel-size-local: 0 is less than 1 (from command line)"),
    ],
)
def test_bad_arguments_exit_2_with_a_message(tmp_path, args, message):
    with process(tmp_path, "tap", ["record", *args]) as tap:
        assert wait_exit(tap, 30) == 2
    assert message in (tmp_path / "tap.log").read_text()


def test_binder_addresses():
    from gmock_engine.tools.record import Binder

    class Sock:
        def bind(self, address):
            self.bound = address

        def bind_to_random_port(self, address):
            self.bound = address
            return 4242

    sock = Sock()
    assert Binder("ipc:///tmp/x/hs").bind(sock, "r0-c0-in") == "ipc:///tmp/x/hs-r0-c0-in-1" == sock.bound
    assert Binder("tcp://10.1.2.3:9").bind(sock, "a") == "tcp://10.1.2.3:4242" and sock.bound == "tcp://10.1.2.3"
    assert Binder("tcp://0.0.0.0:9").bind(sock, "a") == "tcp://127.0.0.1:4242" and sock.bound == "tcp://0.0.0.0"
    assert Binder("tcp://*:9", advertise_host="h.example").bind(sock, "a") == "tcp://h.example:4242"


def test_the_frontend_handshake_dealer_closes_after_ready(tmp_path):
    """In process, plain pyzmq: the tap's Tap.run in a thread, the test playing both sides."""
    import threading

    import zmq as plain_zmq

    from gmock_engine.tools.record import Tap

    ctx = plain_zmq.Context()
    fe_hs = ctx.socket(plain_zmq.ROUTER)
    fe_hs.bind(f"ipc://{tmp_path}/fe-hs")
    writer = ctx.socket(plain_zmq.PULL)
    writer.bind(f"ipc://{tmp_path}/trace")
    tap = Tap(f"ipc://{tmp_path}/fe-hs", f"ipc://{tmp_path}/tap-hs", [0], f"ipc://{tmp_path}/trace")
    thread = threading.Thread(target=tap.run)
    thread.start()
    engine = ctx.socket(plain_zmq.DEALER)
    engine.setsockopt(plain_zmq.IDENTITY, b"\x00\x00")
    engine.connect(f"ipc://{tmp_path}/tap-hs")
    try:
        engine.send(packed({"status": "HELLO"}))
        assert fe_hs.poll(5000)
        ident, _ = fe_hs.recv_multipart()
        fe_hs.send_multipart([ident, packed({"addresses": {"inputs": [f"ipc://{tmp_path}/in"], "outputs": [f"ipc://{tmp_path}/out"]}})])
        assert engine.poll(5000)
        engine.recv()
        assert list(tap.frontend_hs) == [0]
        engine.send(packed({"status": "READY"}))
        assert fe_hs.poll(5000)
        assert unpacked(fe_hs.recv_multipart()[1])["status"] == "READY"
        deadline = time.monotonic() + 5
        while tap.frontend_hs and time.monotonic() < deadline:
            time.sleep(0.01)
        assert tap.frontend_hs == {} and tap.ready == {0}
        assert all(role != "frontend_hs" for role, _, _ in tap.roles.values())
    finally:
        tap.stop()
        thread.join(5)
        tap.close()
        for sock in (fe_hs, writer, engine):
            sock.close(linger=0)
        ctx.term()
