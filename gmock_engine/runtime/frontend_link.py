"""Is an engine's frontend there? Socket monitor events -> transitions.

The engine watches every socket it keeps toward its frontend (one input
DEALER and one output PUSH per client, the coordinator's XSUB and PUSH)
with libzmq's socket monitors (frontend_watch.py reads them). This module
turns those events into the engine's view of its frontend, without
sockets, so it is tested without them:

* each socket is *connecting* (made, not yet connected), *up* (connected,
  ZMTP handshake done) or *down* (its connection ended, or a connect
  attempt failed: libzmq retries it by itself);
* the frontend is *gone* from the first socket going down while none was
  down, and *back* once every socket is up again; each of these two
  transitions is reported once (`FrontendLink.event` returns it), however
  many sockets and reconnect retries it spans;
* every event is counted by kind (`counts`, for /metrics).

Pure: neither gevent nor zmq. The event numbers are libzmq's own
(zmq_socket_monitor(3)); a unit test checks them against pyzmq's.
"""

from __future__ import annotations

import struct
from collections import Counter
from dataclasses import dataclass
from typing import Dict, Iterable, Optional

#: libzmq's monitor events (zmq_socket_monitor(3)) by number -> the name
#: they are counted and logged by.
EVENT_NAMES: Dict[int, str] = {
    0x0001: "connected",
    0x0002: "connect_delayed",
    0x0004: "connect_retried",
    0x0008: "listening",
    0x0010: "bind_failed",
    0x0020: "accepted",
    0x0040: "accept_failed",
    0x0080: "closed",
    0x0100: "close_failed",
    0x0200: "disconnected",
    0x0400: "monitor_stopped",
    0x0800: "handshake_failed_no_detail",
    0x1000: "handshake_succeeded",
    0x2000: "handshake_failed_protocol",
    0x4000: "handshake_failed_auth",
}

#: A connection is there once its ZMTP handshake is done (libzmq 4.3
#: reports that; "connected" alone is the TCP connection, before the peer
#: said anything, and comes first).
UP_EVENTS = frozenset({"handshake_succeeded"})
#: The socket has no connection to the frontend after these: it ended
#: (the peer closed it, or a heartbeat timed out), a connect attempt
#: failed (libzmq tries again every reconnect interval), or the peer
#: refused the ZMTP handshake.
DOWN_EVENTS = frozenset(
    {"disconnected", "connect_retried", "handshake_failed_no_detail", "handshake_failed_protocol", "handshake_failed_auth"}
)
#: Counted, as reconnect attempts while the frontend is gone.
RETRY_EVENT = "connect_retried"

CONNECTING, UP, DOWN = "connecting", "up", "down"


def event_name(number: int) -> str:
    """The name a monitor event is counted by (unknown numbers: event_<n>)."""
    return EVENT_NAMES.get(number, f"event_{number}")


@dataclass(frozen=True)
class Transition:
    """The frontend went (`gone`: True) or came back (`gone`: False)."""

    gone: bool
    #: The socket whose event made it (its role, e.g. "output[0]") and address.
    socket: str
    endpoint: str
    #: The event's name ("disconnected", "handshake_succeeded", ...).
    event: str
    #: Back: how long the frontend was gone, seconds (0.0 for gone).
    after: float = 0.0
    #: Back: reconnect attempts that failed meanwhile, over every socket.
    retries: int = 0

    def line(self, rank: int) -> str:
        """The log line of this transition (one per transition)."""
        if self.gone:
            return f"engine {rank}: frontend gone ({self.socket} socket {self.endpoint}: {self.event}); ZMQ reconnects by itself"
        return f"engine {rank}: frontend back after {self.after:.1f} s ({self.retries} reconnect retries)"


class FrontendLink:
    """One engine's view of its frontend, fed with its sockets' monitor
    events (`event`) in the order they happen, with the time of each."""

    def __init__(self, sockets: Iterable[str]) -> None:
        #: socket role -> CONNECTING, UP or DOWN
        self.states: Dict[str, str] = {name: CONNECTING for name in sockets}
        #: monitor events by name, every socket's (what /metrics counts)
        self.counts: Counter = Counter()
        #: when the frontend went (monotonic seconds), None while it is not gone
        self.gone_since: Optional[float] = None
        #: outages so far (transitions to gone)
        self.outages = 0
        self._retries_at_gone = 0

    @property
    def connected(self) -> bool:
        """Every socket has its connection to the frontend."""
        return all(state == UP for state in self.states.values())

    @property
    def gone(self) -> bool:
        """Some socket lost its connection (or never got one) and not every
        socket is back yet."""
        return self.gone_since is not None

    def gone_for(self, now: float) -> float:
        """Seconds the frontend has been gone at `now` (0.0 when it is not)."""
        return 0.0 if self.gone_since is None else max(0.0, now - self.gone_since)

    def event(self, socket: str, number: int, endpoint: str, now: float) -> Optional[Transition]:
        """Take one monitor event of `socket` at `now`; the transition it
        makes, if any (at most one per event)."""
        name = event_name(number)
        self.counts[name] += 1
        if socket not in self.states:
            return None
        if name in UP_EVENTS:
            self.states[socket] = UP
            if self.gone_since is not None and self.connected:
                after = now - self.gone_since
                retries = self.counts[RETRY_EVENT] - self._retries_at_gone
                self.gone_since = None
                return Transition(False, socket, endpoint, name, after, retries)
        elif name in DOWN_EVENTS:
            self.states[socket] = DOWN
            if self.gone_since is None:
                self.gone_since = now
                self.outages += 1
                self._retries_at_gone = self.counts[RETRY_EVENT]
                return Transition(True, socket, endpoint, name)
        return None


def expired(links: Iterable[Optional[FrontendLink]], limit: float, now: float) -> bool:
    """--exit-when-frontend-gone: True when every watched engine's frontend
    has been gone for `limit` seconds or more (None: an engine not watched,
    i.e. not joined or crashed, does not count); False when none is watched."""
    watched = [link for link in links if link is not None]
    return bool(watched) and all(link.gone and link.gone_for(now) >= limit for link in watched)


# -- a connection that stopped getting ACKs: a link down under load --------------

#: The fields of the kernel's struct tcp_info (linux/tcp.h) read here: eight
#: u8 (state, ca_state, retransmits, probes, backoff, options, wscale,
#: flags), then u32s from rto to last_ack_recv.
TCP_INFO_FORMAT = "=8B13I"
TCP_INFO_SIZE = struct.calcsize(TCP_INFO_FORMAT)
#: No ACK for this long while data waits for one and TCP has retransmitted
#: it: the link is down (or drops every packet). ACKs come from the peer's
#: kernel, not from the frontend's process, so a frontend that is busy or
#: stopped still ACKs. The retransmission tells a stall from data sent a
#: moment ago after a long quiet spell (its ACK is on its way, and the last
#: one came long ago).
STALL_AFTER_MS = 2000


@dataclass(frozen=True)
class TcpInfo:
    """What the kernel says of one TCP connection (getsockopt TCP_INFO)."""

    #: segments sent and not yet acknowledged
    unacked: int
    #: ms since the last ACK came from the peer
    last_ack_recv_ms: int
    #: retransmissions by timeout of the oldest unacknowledged segment (0 once it is ACKed)
    retransmits: int


def parse_tcp_info(data: bytes) -> TcpInfo:
    """The fields TcpInfo keeps, from getsockopt(IPPROTO_TCP, TCP_INFO)'s bytes."""
    fields = struct.unpack_from(TCP_INFO_FORMAT, data)
    return TcpInfo(unacked=fields[12], last_ack_recv_ms=fields[20], retransmits=fields[2])


@dataclass(frozen=True)
class StallTransition:
    """A connection toward the frontend stopped getting ACKs (`stalled`:
    True) or got them again (`stalled`: False)."""

    stalled: bool
    socket: str
    endpoint: str
    info: TcpInfo
    #: back: how long the connection was stalled, seconds
    after: float = 0.0

    def line(self, rank: int) -> str:
        """The log line of this transition (one per transition)."""
        if self.stalled:
            return (
                f"engine {rank}: no TCP ACK from the frontend for {self.info.last_ack_recv_ms / 1000:.1f} s on {self.socket} "
                f"({self.endpoint}; {self.info.unacked} segments unacknowledged, {self.info.retransmits} retransmissions): "
                "the network link is down or dropping packets; the connection is kept and TCP retransmits"
            )
        return f"engine {rank}: the link to the frontend carries ACKs again on {self.socket} after {self.after:.1f} s"


class LinkStalls:
    """Which connections toward the frontend stopped getting ACKs, from
    their TCP_INFO read now and then (`observe`); a stall is told once when
    it starts and once when it ends. A link that is down while nothing is
    sent is not seen: nothing waits for an ACK, and nothing is lost."""

    def __init__(self, stall_after_ms: int = STALL_AFTER_MS) -> None:
        self.stall_after_ms = stall_after_ms
        #: socket role -> when its stall was seen to start (monotonic seconds)
        self.since: Dict[str, float] = {}
        #: stalls so far
        self.stalls = 0

    @property
    def stalled(self) -> bool:
        """Some connection toward the frontend gets no ACKs now."""
        return bool(self.since)

    def observe(self, socket: str, endpoint: str, info: Optional[TcpInfo], now: float) -> Optional[StallTransition]:
        """Take one reading of `socket`'s connection (None: it has none
        now); the transition it makes, if any."""
        waiting = info is not None and info.unacked > 0 and info.retransmits > 0 and info.last_ack_recv_ms >= self.stall_after_ms
        if waiting and socket not in self.since:
            # the stall began when the last ACK came
            assert info is not None
            self.since[socket] = now - info.last_ack_recv_ms / 1000.0
            self.stalls += 1
            return StallTransition(True, socket, endpoint, info)
        if not waiting and socket in self.since:
            began = self.since.pop(socket)
            return StallTransition(False, socket, endpoint, info or TcpInfo(0, 0, 0), now - began)
        return None
