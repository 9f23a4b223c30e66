"""The frontend watch's pure part (frontend_link.py): monitor events ->
one transition per outage and per return, counts by kind, the exit timer."""

import zmq

from gmock_engine import frontend_link as fl
from gmock_engine.frontend_link import FrontendLink

OUT = "tcp://10.0.0.1:5001"
IN = "tcp://10.0.0.1:5000"
UP, DOWN, RETRY = zmq.EVENT_HANDSHAKE_SUCCEEDED, zmq.EVENT_DISCONNECTED, zmq.EVENT_CONNECT_RETRIED


def joined(*sockets):
    link = FrontendLink(sockets)
    for name in sockets:
        assert link.event(name, zmq.EVENT_CONNECT_DELAYED, IN, 0.0) is None
        assert link.event(name, zmq.EVENT_CONNECTED, IN, 0.0) is None
        assert link.event(name, UP, IN, 0.0) is None  # connecting -> up is no transition
    assert link.connected and not link.gone
    return link


def test_the_event_numbers_are_libzmqs():
    for number, name in fl.EVENT_NAMES.items():
        assert getattr(zmq, "EVENT_" + name.upper()) == number
    assert fl.event_name(0x10000) == "event_65536"


def test_connecting_is_neither_connected_nor_gone():
    link = FrontendLink(["input[0]", "output[0]"])
    link.event("input[0]", UP, IN, 0.0)
    assert not link.connected and not link.gone and link.gone_for(5.0) == 0.0


def test_one_gone_line_per_outage_however_many_sockets_and_retries():
    link = joined("input[0]", "output[0]")
    gone = link.event("output[0]", DOWN, OUT, 10.0)
    assert gone == fl.Transition(True, "output[0]", OUT, "disconnected")
    assert gone.line(2) == f"engine 2: frontend gone (output[0] socket {OUT}: disconnected); ZMQ reconnects by itself"
    # the other socket, and the retries of both: no second transition
    assert link.event("input[0]", DOWN, IN, 10.1) is None
    for at in (10.2, 10.3, 10.4):
        assert link.event("input[0]", RETRY, IN, at) is None
        assert link.event("output[0]", RETRY, OUT, at) is None
    assert link.gone and not link.connected and link.gone_for(12.5) == 2.5
    # one socket back is not the frontend back
    assert link.event("input[0]", UP, IN, 13.0) is None
    back = link.event("output[0]", UP, OUT, 13.5)
    assert back == fl.Transition(False, "output[0]", OUT, "handshake_succeeded", 3.5, 6)
    assert back.line(2) == "engine 2: frontend back after 3.5 s (6 reconnect retries)"
    assert link.connected and not link.gone and link.outages == 1
    assert link.counts["disconnected"] == 2 and link.counts["connect_retried"] == 6 and link.counts["connected"] == 2


def test_a_second_outage_counts_its_own_retries():
    link = joined("output[0]")
    link.event("output[0]", DOWN, OUT, 1.0)
    link.event("output[0]", RETRY, OUT, 1.1)
    link.event("output[0]", UP, OUT, 2.0)
    assert link.event("output[0]", DOWN, OUT, 5.0).gone
    back = link.event("output[0]", UP, OUT, 5.5)
    assert (back.after, back.retries, link.outages) == (0.5, 0, 2)


def test_a_failed_first_connect_or_handshake_is_gone():
    link = FrontendLink(["input[0]"])
    assert link.event("input[0]", RETRY, IN, 1.0).event == "connect_retried"
    link = FrontendLink(["input[0]"])
    assert link.event("input[0]", zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, IN, 1.0).gone


def test_closed_and_unknown_sockets_are_only_counted():
    link = joined("input[0]")
    assert link.event("input[0]", zmq.EVENT_CLOSED, IN, 1.0) is None
    assert link.event("handshake", DOWN, IN, 1.0) is None
    assert not link.gone and link.counts["closed"] == 1 and link.counts["disconnected"] == 1


def test_expired_needs_every_watched_engine_gone_long_enough():
    a, b = joined("output[0]"), joined("output[0]")
    assert not fl.expired([], 1.0, 100.0)
    assert not fl.expired([None], 1.0, 100.0)  # none joined: nothing to time out
    a.event("output[0]", DOWN, OUT, 10.0)
    assert fl.expired([a, None], 5.0, 15.0) and not fl.expired([a], 5.0, 14.9)
    assert not fl.expired([a, b], 5.0, 100.0)  # b still has its frontend
    b.event("output[0]", DOWN, OUT, 12.0)
    assert not fl.expired([a, b], 5.0, 16.9) and fl.expired([a, b], 5.0, 17.0)
    b.event("output[0]", UP, OUT, 18.0)
    assert not fl.expired([a, b], 5.0, 100.0)
