"""The frontend watch's pure part (runtime/frontend_link.py): monitor events ->
one transition per outage and per return, counts by kind, the exit timer."""

import pytest
import zmq

from gmock_engine.runtime import frontend_link as fl
from gmock_engine.runtime.frontend_link import FrontendLink

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


# -- connections that get no ACKs ---------------------------------------------------


def _tcp_info(unacked, last_ack_recv_ms, retransmits=0):
    """Bytes as the kernel's struct tcp_info starts (the fields parse_tcp_info reads set)."""
    import struct

    from gmock_engine.runtime.frontend_link import TCP_INFO_FORMAT

    u8 = [1, 0, retransmits, 0, 0, 0, 0, 0]
    u32 = [200000, 0, 1448, 536, unacked, 0, 0, 0, 0, 10, 0, 20, last_ack_recv_ms]
    return struct.pack(TCP_INFO_FORMAT, *u8, *u32) + bytes(160)  # the kernel's struct goes on


def test_tcp_info_fields():
    from gmock_engine.runtime.frontend_link import TcpInfo, parse_tcp_info

    assert parse_tcp_info(_tcp_info(7, 2500, 3)) == TcpInfo(unacked=7, last_ack_recv_ms=2500, retransmits=3)


def test_a_stall_is_told_once_when_it_starts_and_once_when_it_ends():
    from gmock_engine.runtime.frontend_link import LinkStalls, TcpInfo

    stalls = LinkStalls(stall_after_ms=2000)
    ep = "tcp://10.0.0.1:5555"
    # data waiting but ACKed recently, nothing waiting, or data sent just now
    # after a quiet spell (not retransmitted yet): no stall
    assert stalls.observe("output[0]", ep, TcpInfo(4, 300, 1), 100.0) is None
    assert stalls.observe("output[0]", ep, TcpInfo(0, 9000, 0), 101.0) is None
    assert stalls.observe("output[0]", ep, TcpInfo(1, 55000, 0), 101.5) is None
    assert not stalls.stalled
    went = stalls.observe("output[0]", ep, TcpInfo(12, 2500, 3), 102.0)
    assert went is not None and went.stalled and stalls.stalled and stalls.stalls == 1
    assert went.line(1) == (
        "engine 1: no TCP ACK from the frontend for 2.5 s on output[0] (tcp://10.0.0.1:5555; 12 segments "
        "unacknowledged, 3 retransmissions): the network link is down or dropping packets; the connection is kept and TCP retransmits"
    )
    # still no ACK: nothing new; another socket's stall is its own
    assert stalls.observe("output[0]", ep, TcpInfo(12, 5500, 4), 105.0) is None
    assert stalls.observe("input[0]", ep, TcpInfo(1, 3000, 1), 105.0).stalled and stalls.stalls == 2
    back = stalls.observe("output[0]", ep, TcpInfo(0, 10, 0), 110.0)
    assert back is not None and not back.stalled and back.after == pytest.approx(10.5)  # from the last ACK before it
    assert back.line(1) == "engine 1: the link to the frontend carries ACKs again on output[0] after 10.5 s"
    assert stalls.stalled  # input[0] still waits
    # a connection that is gone (None) ends its stall too
    assert not stalls.observe("input[0]", ep, None, 111.0).stalled and not stalls.stalled
