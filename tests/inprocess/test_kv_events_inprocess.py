"""KV-cache events over real sockets: one gmock_engine App against the fake
frontend, a ZMQ SUB and a replay DEALER as a router would hold them
(docs/protocol.md Appendix D), the event-plane faults, hostile replay requests.
"""

import contextlib
import json

import gevent
import msgpack
import pytest
import zmq.green as zmq

from fake_frontend import FakeFrontend
from zmq.utils.monitor import recv_monitor_message

from gmock_engine.config.loader import parse_config
from gmock_engine.kv.events import END_SEQ
from gmock_engine.core.prefix_cache import block_hashes
from gmock_engine.runtime.app import App
from gmock_engine.config.settings import from_config
from gmock_engine.tools.procgroup import free_ports

EVENTS = '{"enable_kv_cache_events": true, "endpoint": "tcp://*:0", "replay_endpoint": "tcp://*:0", "topic": "kv@mock"}'
BS = 4
WAIT = 5.0


def socket_of(frontend, kind):
    """A test socket on the frontend's context (closed with it)."""
    sock = frontend.ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    frontend.sockets.append(sock)
    return sock


def scrape(app):
    """What /metrics would say."""
    from prometheus_client import generate_latest

    from gmock_engine.runtime import metrics

    return generate_latest(metrics.registry(app.runners)).decode()


def free_port():
    """A free port outside the kernel's ephemeral range. A port picked inside
    it and released can be handed out again to any socket that binds port 0
    or connects (the fake frontend's, the engine's own) before the engine
    binds it: CI saw the engine's PUB bind fail with EADDRINUSE."""
    return free_ports(1)[0]


@contextlib.contextmanager
def serving(*flags, dp=1, events=EVENTS, before_start=lambda frontend: None):
    frontend = FakeFrontend(dp=dp)
    config = parse_config(
        ["--handshake-address", frontend.handshake_address, "--engine-count", str(dp), "--prefix-caching",
         "--block-size", str(BS), "--kv-events-config", events, *flags], env={},
    )  # fmt: skip
    before_start(frontend)
    app = App(from_config(config), config)
    waiter = gevent.spawn(app.run)
    assert app.started.wait(10)
    frontend.accept_engines()
    assert app.wait_joined(WAIT)
    try:
        yield app, frontend
    finally:
        app.stop()
        assert waiter.get(timeout=WAIT) == 0
        frontend.close()


def subscribe(frontend, app, rank=0):
    """A SUB on the endpoint the ready response named (and is it the one bound)."""
    config = frontend.registrations[rank][0]["kv_events_config"]
    assert config["endpoint"] == app.runners[rank].kv_events.config.endpoint
    sub = socket_of(frontend, zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    sub.connect(config["endpoint"])
    # a PUB drops what it sends before the subscription arrived: wait until one
    # does (an idle engine publishes nothing, so probe with a reset)
    with gevent.Timeout(WAIT):
        while True:
            frontend.utility(rank, "reset_prefix_cache", [False, False])
            if sub.poll(50):
                drain(sub)
                return sub


def drain(sub, quiet=0.2):
    """Every message until none came for `quiet` s: [(topic, seq, batch)]."""
    out = []
    while sub.poll(int(quiet * 1000)):
        topic, seq, payload = sub.recv_multipart()
        out.append((topic, int.from_bytes(seq, "big"), msgpack.unpackb(payload)))
    return out


def replay(frontend, app, start, rank=0, timeout=WAIT):
    dealer = socket_of(frontend, zmq.DEALER)
    dealer.connect(frontend.registrations[rank][0]["kv_events_config"]["replay_endpoint"])
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    out = []
    with gevent.Timeout(timeout):
        while True:
            frames = dealer.recv_multipart()
            if frames[2] == END_SEQ:
                assert frames == [b"", b"", END_SEQ, b""]
                break
            empty, topic, seq, payload = frames
            assert (empty, topic) == (b"", b"kv@mock")
            out.append((int.from_bytes(seq, "big"), msgpack.unpackb(payload)))
    return out


def run(frontend, rid, prompt, max_tokens=1, rank=0):
    frontend.add(rank, rid, max_tokens, prompt_token_ids=prompt)
    return frontend.collect([rid]).tokens(rid)


def events_of(messages):
    return [e for _, _, batch in messages for e in batch[1]]


def test_shared_prefixes_make_chains_of_exact_token_ids_and_seqs_count_up():
    with serving() as (app, frontend):
        sub = subscribe(frontend, app)
        shared = list(range(100, 108))
        run(frontend, "a", shared + [1, 2, 3, 4])
        run(frontend, "b", shared + [5, 6, 7, 8, 9])
        messages = drain(sub)
        seqs = [seq for _, seq, _ in messages]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
        assert all(batch[2] == 0 and isinstance(batch[0], float) for _, _, batch in messages)
        a, b = [e for e in events_of(messages) if e["type"] == "BlockStored"]
        ha, hb = block_hashes(shared + [1, 2, 3, 4], BS), block_hashes(shared + [5, 6, 7, 8], BS)
        assert a["token_ids"] == shared + [1, 2, 3, 4] and a["block_hashes"] == list(ha) and a["parent_block_hash"] is None
        # b hit the two shared blocks: only its own block is stored, chained to them
        assert b["token_ids"] == [5, 6, 7, 8] and b["block_hashes"] == [hb[2]] and b["parent_block_hash"] == ha[1]


def test_eviction_removes_exactly_the_evicted_blocks_and_reset_clears():
    with serving("--num-gpu-blocks", "4") as (app, frontend):
        sub = subscribe(frontend, app)
        run(frontend, "a", list(range(8)))  # 2 blocks, cached (its one token's KV is never computed)
        run(frontend, "b", list(range(50, 66)))  # 4 blocks: the 2 never used, then a's tail, then its head
        events = events_of(drain(sub))
        ha = block_hashes(list(range(8)), BS)
        assert [e["type"] for e in events] == ["BlockStored", "BlockRemoved", "BlockRemoved", "BlockStored"]
        assert [e["block_hashes"] for e in events[1:3]] == [[ha[1]], [ha[0]]]
        assert set(app.runners[0].engine.prefix_cache.cached_hashes()) == set(events[3]["block_hashes"])
        call = frontend.utility(0, "reset_prefix_cache", [False, False])
        assert frontend.utility_result(call)[2] == [None, True]
        assert events_of(drain(sub)) == [{"type": "AllBlocksCleared"}]


def test_a_late_subscriber_recovers_what_it_missed_through_replay():
    with serving() as (app, frontend):
        run(frontend, "a", list(range(12)))
        run(frontend, "b", list(range(40, 52)))
        sub = subscribe(frontend, app)  # joins late: its probe reset is the first it sees
        run(frontend, "c", list(range(60, 68)))
        live = drain(sub)
        replayed = replay(frontend, app, 0)
        assert [seq for seq, _ in replayed] == list(range(live[-1][1] + 1))  # every batch so far, in order
        stored = [e["token_ids"] for _, batch in replayed for e in batch[1] if e["type"] == "BlockStored"]
        assert stored[:2] == [list(range(12)), list(range(40, 52))]
        assert replay(frontend, app, live[-1][1]) == [(live[-1][1], live[-1][2])]


def test_malformed_replay_requests_are_ignored_and_the_engine_goes_on():
    with serving() as (app, frontend):
        raw = socket_of(frontend, zmq.DEALER)
        raw.connect(frontend.registrations[0][0]["kv_events_config"]["replay_endpoint"])
        for frames in ([b"x"], [b"", b"123"], [b"", b"12345678", b"more"], [b"not-empty", b"\0" * 8]):
            raw.send_multipart(frames)
        assert not raw.poll(300)  # no answer to any of them
        assert run(frontend, "a", list(range(8)), 2)  # still serving
        assert replay(frontend, app, 0)  # and replaying
        assert app.counters()[0]["kv_events_bad_replay_requests"] == 4
        assert 'gmock_kv_events_total{counter="bad_replay_requests",engine="0"} 4.0' in scrape(app)


@pytest.mark.parametrize(
    "flag, spec",
    [
        ("--fault-kv-drop-batch", "every=2 limit=1"),
        ("--fault-kv-duplicate-batch", "every=2 limit=1"),
        ("--fault-kv-reorder-batches", "every=2 limit=1"),
        ("--fault-kv-reset-seq", "every=3 limit=1"),
        ("--fault-kv-clear-storm", "every=2 limit=1 count=5"),
    ],
)
def test_each_event_plane_fault_is_seen_as_what_it_is(flag, spec):
    kind = flag[len("--fault-"):]
    # Every batch counts for the fault's every=, so no probe may go first: the
    # SUB connects to a known port before the engine binds it (ZMQ reconnects)
    # and the first request goes after its ZMTP handshake with the PUB (its
    # subscription follows the handshake on that connection, before the
    # request's batch, which needs a round trip on another connection first).
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    events = json.dumps({**json.loads(EVENTS), "endpoint": endpoint.replace("127.0.0.1", "*")})
    subs = []

    def connect(frontend):
        sub = socket_of(frontend, zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        subs.append((sub, sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)))
        sub.connect(endpoint)

    with serving(flag, spec, events=events, before_start=connect) as (app, frontend):
        ((sub, monitor),) = subs
        with gevent.Timeout(WAIT):
            assert recv_monitor_message(monitor)["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED
        sub.disable_monitor()
        monitor.close(linger=0)
        for i in range(4):
            run(frontend, f"r{i}", list(range(i * 100, i * 100 + 8)))
        seqs = [seq for _, seq, _ in drain(sub, quiet=0.3)]
        if kind == "kv-drop-batch":
            assert seqs == [0, 2, 3]  # a gap at 1
            assert [s for s, _ in replay(frontend, app, 1)] == [1, 2, 3]  # replay has it
        elif kind == "kv-duplicate-batch":
            assert seqs == [0, 1, 1, 2, 3]
        elif kind == "kv-reorder-batches":
            assert seqs == [0, 2, 1, 3]
        elif kind == "kv-reset-seq":
            assert seqs == [0, 1, 0, 1]  # back to 0: a restarted engine
            assert [s for s, _ in replay(frontend, app, 0)] == [0, 1]  # its replay buffer starts afresh
        else:
            assert seqs == list(range(9))  # 4 batches + 5 of the storm, after the second
        assert app.counters()[0]["fault_" + kind.replace("-", "_")] == 1
        assert f'gmock_faults_injected_total{{engine="0",kind="{kind}"}} 1.0' in scrape(app)


def test_a_stalled_replay_socket_answers_when_the_stall_is_over():
    with serving("--fault-kv-stall-replay", "every=1 limit=1 duration=1s") as (app, frontend):
        run(frontend, "a", list(range(8)))
        dealer = socket_of(frontend, zmq.DEALER)
        dealer.connect(frontend.registrations[0][0]["kv_events_config"]["replay_endpoint"])
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        assert not dealer.poll(300)  # stalled: no answer yet
        assert run(frontend, "b", list(range(20, 28)))  # the engine serves meanwhile
        with gevent.Timeout(WAIT):
            frames = dealer.recv_multipart()
        assert frames[2] == (0).to_bytes(8, "big")
        assert app.counters()[0]["fault_kv_stall_replay"] == 1


def test_every_rank_publishes_on_its_own_socket_with_its_rank():
    with serving(dp=2) as (app, frontend):
        subs = [subscribe(frontend, app, rank) for rank in (0, 1)]
        endpoints = {frontend.registrations[r][0]["kv_events_config"]["endpoint"] for r in (0, 1)}
        assert len(endpoints) == 2
        for rank in (0, 1):
            run(frontend, f"r{rank}", list(range(rank * 10, rank * 10 + 8)), rank=rank)
        for rank, sub in enumerate(subs):
            (stored,) = [e for _, _, b in drain(sub) for e in b[1] if b[2] == rank and e["type"] == "BlockStored"]
            assert stored["token_ids"] == list(range(rank * 10, rank * 10 + 8))
