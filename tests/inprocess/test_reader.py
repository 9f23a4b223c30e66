"""transport.Reader: one input socket's loop, on a real zmq.green socket pair."""

import time

import gevent
import gevent.event
import zmq.green as zmq
from loguru import logger

from gmock_engine.runtime import transport
from gmock_engine.wire.eras import DEFAULT_PROTOCOL_VERSION, WIRE_LAYOUTS, Wire
from gmock_engine.wire.inputs import decode_input
from gmock_engine.runtime.links import StageLinks
from gmock_engine.utils.logs import Throttle
from gmock_engine.tools import frontend as frontend_tools


def _reader(put, paced: bool) -> transport.Reader:
    """A Reader as the runtime makes one, its gate open."""
    links = StageLinks()  # its gates open
    links.deliver = put
    links.paced = lambda: paced
    layout = WIRE_LAYOUTS[DEFAULT_PROTOCOL_VERSION]
    return transport.Reader(links, Wire(layout), transport.Incidents(), Throttle(logger))


def _burst_then_peek(paced: bool, count: int = 3 * transport.READ_SLICE + 5):
    """`count` ADDs waiting on the reader's socket at once; returns how many
    the reader had queued when another greenlet, ready from the start, first
    got to run, and how many it queued in all."""
    ctx = zmq.Context()
    sender, receiver = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        receiver.bind("inproc://reader-burst")
        sender.connect("inproc://reader-burst")
        for i in range(count):
            request = frontend_tools.engine_core_request(f"burst-{i}", [1, 2, 3], {"max_tokens": 2})
            sender.send_multipart(frontend_tools.add_frames(request))
        queued = []
        reader = _reader(queued.append, paced)
        gevent.sleep(0.05)  # every frame is in the receiver's pipe
        seen = []
        loop = gevent.spawn(reader.run, receiver, "test", decode_input)
        # another greenlet, run as soon as the reader yields (as a stepper
        # whose timer has fired would be)
        peek = gevent.spawn(lambda: seen.append(len(queued)))
        peek.join(5)
        with gevent.Timeout(5):
            while len(queued) < count:
                gevent.sleep(0.01)
        loop.kill()
        return seen[0], len(queued)
    finally:
        sender.close(0)
        receiver.close(0)
        ctx.term()


def test_paced_a_burst_of_input_gives_the_hub_a_round_every_slice():
    """Paced, the reader lets other greenlets run every READ_SLICE messages
    (a due step is not held up behind a wave of ADDs); unpaced it takes the
    whole burst in at once (the stepper's growing input slice wants it)."""
    count = 3 * transport.READ_SLICE + 5
    first_peek, total = _burst_then_peek(paced=True, count=count)
    assert total == count
    assert first_peek == transport.READ_SLICE, first_peek
    first_peek, total = _burst_then_peek(paced=False, count=count)
    assert total == count and first_peek == count, first_peek


def test_an_idle_reader_looks_again_only_at_the_safety_net(monkeypatch):
    """Parked on a socket that never signals, a reader wakes only every
    WAIT_SAFETY_NET_S (zmq.green's own guard would wake it every 11.6 s;
    256 idle engines woke the process every ~45 ms for it). Shortened here
    to see it happen: it does wake (the net is there) and it does not spin."""
    monkeypatch.setattr(transport, "WAIT_SAFETY_NET_S", 0.1)
    looks = []
    real = transport.readable
    monkeypatch.setattr(transport, "readable", lambda sock: looks.append(1) or real(sock))
    ctx = zmq.Context()
    receiver = ctx.socket(zmq.PAIR)
    try:
        receiver.bind("inproc://reader-idle")
        reader = _reader([].append, False)
        started = time.monotonic()
        loop = gevent.spawn(reader.run, receiver, "test", decode_input)
        gevent.sleep(0.75)
        loop.kill()
        elapsed = time.monotonic() - started
        # one look at the start, then one per 0.1 s (a busy machine may
        # hold the hub up: bounded by the time that really passed)
        assert 3 <= len(looks) <= elapsed / 0.1 + 2, (len(looks), elapsed)
    finally:
        receiver.close(0)
        ctx.term()


def test_every_message_wakes_a_parked_reader():
    """The reader parks on its own io watcher (transport.ReadWaiter), not
    zmq.green's wait, whose FD watcher it stops: every message that arrives
    while it is parked must still wake it, alone, in bursts, or right after
    the reader looked (a lost wake-up would leave a message unread until
    the 120 s safety net)."""
    ctx = zmq.Context()
    sender, receiver = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        receiver.bind("inproc://reader-wakes")
        sender.connect("inproc://reader-wakes")
        queued = []
        reader = _reader(queued.append, False)
        loop = gevent.spawn(reader.run, receiver, "test", decode_input)
        gevent.sleep(0.01)
        assert not receiver._state_event.active  # zmq.green's callback no longer runs per wake-up
        sent = 0
        with gevent.Timeout(10):
            for pause, burst in [(0.0, 1)] * 100 + [(0.002, 1)] * 50 + [(0.001, 5)] * 30 + [(0.0, 3)] * 30:
                for _ in range(burst):
                    request = frontend_tools.engine_core_request(f"wake-{sent}", [1, 2], {"max_tokens": 2})
                    sender.send_multipart(frontend_tools.add_frames(request))
                    sent += 1
                gevent.sleep(pause)
                # each message read before the next wave: none waits for a later one to wake the reader
                deadline = time.monotonic() + 2
                while len(queued) < sent and time.monotonic() < deadline:
                    gevent.sleep(0.0005)
                assert len(queued) == sent, (len(queued), sent)
        assert loop.dead is False
        loop.kill()
        assert [m.request_id for m in queued] == [f"wake-{i}" for i in range(sent)]
    finally:
        sender.close(0)
        receiver.close(0)
        ctx.term()
