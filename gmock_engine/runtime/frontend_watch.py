"""The engine watches its frontend: socket monitors, heartbeats, the exit timer.

The sockets the handshake makes (transport.join_frontend) come from a
`WatchedContext`: each the engine keeps gets a libzmq socket monitor (an
inproc PAIR that receives the socket's connection events) and, with
--frontend-heartbeat, ZMTP heartbeats. Both are set before the socket
connects: libzmq copies a socket's options into each connection when it is
made, and a monitor attached later would miss the first connection's events.

After the handshake two supervised greenlets per engine watch: one
(`FrontendWatch.run`) reads those monitors and feeds the events to a
`frontend_link.FrontendLink`, which says when the frontend is gone and
when it is back. Each transition is logged once (the "frontend gone"
lines are rate-limited, so a flapping link is summarised); events are
counted by kind for /metrics. A frontend killed outright is noticed at
once: its kernel closes the TCP connections, and every socket reports
"disconnected". A cut network link closes nothing: the heartbeats notice
it (no answer to a PING within the timeout ends the connection), and so
does, without touching the connection, the kernel's view of it: while the
engine runs requests the other (`run_stalls`) reads each connection's
TCP_INFO every STALL_CHECK_S, and data that waits STALL_AFTER_MS for an ACK is a link
that is down (frontend_link.LinkStalls; the peer's kernel ACKs even when
the frontend's process is busy or stopped). The stall and its end are
logged once each; the connection is left to TCP, which delivers what
waited once the link is back.

With --exit-when-frontend-gone SECONDS the watch calls `on_expired` once
the frontend has been gone that long (the App stops the process cleanly
when every engine's frontend is).
"""

from __future__ import annotations

import _socket  # the C sockets: gevent's would set the duplicated FD non-blocking
import ipaddress
import itertools
import os
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import gevent
import gevent.event
import zmq.green as zmq
from zmq.utils.monitor import parse_monitor_message

from gmock_engine.runtime.frontend_link import TCP_INFO_SIZE, FrontendLink, LinkStalls, TcpInfo, event_name, parse_tcp_info
from gmock_engine.utils.logs import Throttle
from gmock_engine.runtime.transport import WAIT_SAFETY_NET_S

#: The heartbeat timeout is this many heartbeat intervals: a connection
#: whose peer answered none of the last PINGs for that long is ended.
HEARTBEAT_TIMEOUT_INTERVALS = 3
#: At most this many "frontend gone" lines per window per engine (then one
#: line saying how many were left out): a flapping link must not flood the log.
GONE_LOGS = 5
GONE_WINDOW_S = 60.0
#: How often the TCP connections toward the frontend are read while the
#: engine has requests (or a stall is under way); never while it is idle.
STALL_CHECK_S = 1.0

#: Numbers the monitors' inproc endpoints. pyzmq's default name is made from
#: the socket's FD, which a new socket can get while the endpoint of a closed
#: one (the handshake DEALER lingers) is still bound: EADDRINUSE.
_MONITOR_IDS = itertools.count()


class WatchedContext:
    """A stand-in for the ZMQ context in transport.join_frontend: `socket`
    makes each socket with a monitor and, when `heartbeat_s` > 0, with ZMTP
    heartbeats (a PING every `heartbeat_s`; the connection ends when no
    traffic comes back within HEARTBEAT_TIMEOUT_INTERVALS of them).

    Except the first: join_frontend makes the handshake DEALER first and
    closes it after READY, and with a monitor on it the frontend at times
    did not see that connection close within seconds (tests/inprocess,
    test_the_handshake_connection_is_closed_once_ready)."""

    def __init__(self, ctx: Any, heartbeat_s: float) -> None:
        self.ctx = ctx
        self.heartbeat_ms = int(round(heartbeat_s * 1000))
        #: every monitored socket made so far, with its monitor PAIR
        self.made: List[Tuple[Any, Any]] = []
        self._first = True

    def socket(self, kind: int) -> Any:
        """A new socket of `kind`, monitored (and heartbeating); the first,
        the handshake DEALER, plain."""
        sock = self.ctx.socket(kind)
        if self._first:
            self._first = False
            return sock
        if self.heartbeat_ms > 0:
            timeout = self.heartbeat_ms * HEARTBEAT_TIMEOUT_INTERVALS
            sock.setsockopt(zmq.HEARTBEAT_IVL, self.heartbeat_ms)
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, timeout)
            # The peer (the frontend's libzmq) ends the connection too when it
            # hears nothing for as long, so an engine that reconnects after an
            # outage is not refused by a ROUTER still holding its identity.
            sock.setsockopt(zmq.HEARTBEAT_TTL, timeout)
            # A reconnect attempt over a link still down is given up after as
            # long, instead of waiting for the kernel's SYN retries (minutes).
            sock.setsockopt(zmq.CONNECT_TIMEOUT, timeout)
        try:
            monitor = sock.get_monitor_socket(addr=f"inproc://gmock-frontend-watch-{next(_MONITOR_IDS)}")
        except BaseException:
            sock.close(linger=0)
            raise
        self.made.append((sock, monitor))
        return sock


def socket_roles(sockets: Any) -> Dict[int, str]:
    """id(socket) -> its role ("input[0]", "output[1]", "coordinator_input",
    "coordinator_output") for the sockets an engine keeps (transport.EngineSockets)."""
    roles = {id(sock): f"input[{index}]" for index, sock in enumerate(sockets.inputs)}
    roles.update({id(sock): f"output[{index}]" for index, sock in enumerate(sockets.outputs)})
    for name in ("coordinator_input", "coordinator_output"):
        sock = getattr(sockets, name)
        if sock is not None:
            roles[id(sock)] = name
    return roles


class FrontendWatch:
    """One engine's watch of its frontend: `context` for the handshake,
    `attach` once it is done, `run` in a supervised greenlet, `close` at
    shutdown (after that greenlet was stopped, before the sockets close:
    their closing would otherwise read as the frontend going)."""

    def __init__(
        self,
        rank: int,
        log: Any,
        heartbeat_s: float,
        exit_after: Optional[float],
        on_expired: Callable[[], None],
        clock: Callable[[], float] = time.monotonic,
        busy: Callable[[], bool] = lambda: False,
    ) -> None:
        self.rank = rank
        self.log = log
        self.heartbeat_s = heartbeat_s
        #: --exit-when-frontend-gone (None or 0: off)
        self.exit_after = exit_after or None
        self.on_expired = on_expired
        self.clock = clock
        self.throttle = Throttle(log, GONE_LOGS, GONE_WINDOW_S, clock)
        self.watched: Optional[WatchedContext] = None
        #: None until `attach`: the engine has not joined its frontend
        self.link: Optional[FrontendLink] = None
        #: monitor PAIR -> the role of its socket
        self._monitors: List[Tuple[Any, str]] = []
        #: this outage's "gone" line was written (so its "back" line is too)
        self._said_gone = False
        self._expiry_told = False
        #: whether the engine has requests (the connections are read only then)
        self.busy = busy
        self.stalls = LinkStalls()
        #: socket role -> (the FD of its TCP connection, the endpoint), from its monitor's "connected"
        self._connections: Dict[str, Tuple[int, str]] = {}
        #: set by the stepper (`wake`) when work starts: `run_stalls` reads the connections again
        self._work = gevent.event.Event()

    def context(self, ctx: Any) -> WatchedContext:
        """The context the handshake makes the engine's sockets with."""
        self.watched = WatchedContext(ctx, self.heartbeat_s)
        return self.watched

    def attach(self, sockets: Any) -> None:
        """The handshake is done: watch the sockets the engine keeps (a
        monitor of any other socket is closed unread)."""
        roles = socket_roles(sockets)
        assert self.watched is not None
        monitored = {id(sock) for sock, _ in self.watched.made}
        if not roles.keys() <= monitored:  # join_frontend made a kept socket first
            raise RuntimeError("a socket toward the frontend has no monitor: the handshake DEALER is no longer made first")
        for sock, monitor in self.watched.made:
            role = roles.get(id(sock))
            if role is None:
                monitor.close(linger=0)
            else:
                self._monitors.append((monitor, role))
        self.watched.made = [(sock, monitor) for sock, monitor in self.watched.made if id(sock) in roles]
        self.link = FrontendLink(role for _, role in self._monitors)

    def wake(self) -> None:
        """The engine got work after being idle: read the connections from
        now on (called by the stepper; never blocks)."""
        self._work.set()

    def run_stalls(self) -> None:
        """Read the connections' TCP_INFO every STALL_CHECK_S while the
        engine has work or a stall is under way; otherwise wait for `wake`
        (a gevent sleep, not a poll with a timeout: zmq.green's Poller keeps
        memory for every timed poll)."""
        while True:
            if not (self._connections and (self.stalls.stalled or self.busy())):
                self._work.clear()
                if not self.busy():
                    self._work.wait()
                    continue
            self.check_stalls()
            gevent.sleep(STALL_CHECK_S)

    def run(self) -> None:
        """Read the monitors until killed: every event to the link, each
        transition logged once; the exit timer while the frontend is gone."""
        poller = zmq.Poller()
        # zmq.green's Poller looks again every 1.33 s even when nothing
        # signalled (its guard against a lost edge); an idle engine waits for
        # its monitors for ever, so its guard is the readers' (transport.py).
        poller._gevent_bug_timeout = WAIT_SAFETY_NET_S
        for monitor, _ in self._monitors:
            poller.register(monitor, zmq.POLLIN)
        roles = dict((id(monitor), role) for monitor, role in self._monitors)
        while True:
            timeout_ms = None
            if self.exit_after is not None and self.link.gone and not self._expiry_told:
                left = self.exit_after - self.link.gone_for(self.clock())
                timeout_ms = max(0, int(left * 1000) + 1)
            for monitor, _ in poller.poll(timeout_ms):
                self._read(monitor, roles[id(monitor)])
            self._check_expiry()

    def check_stalls(self) -> None:
        """Read every connection's TCP_INFO; each stall and its end logged once."""
        now = self.clock()
        for role, (fd, endpoint) in list(self._connections.items()):
            transition = self.stalls.observe(role, endpoint, read_tcp_info(fd, endpoint), now)
            if transition is not None:
                (self.log.warning if transition.stalled else self.log.info)("{}", transition.line(self.rank))

    def _read(self, monitor: Any, role: str) -> None:
        """Every event queued on one monitor (its FD is edge-triggered: read
        until none is left)."""
        while True:
            try:
                frames = monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            message = parse_monitor_message(frames)
            endpoint = message["endpoint"]
            if isinstance(endpoint, bytes):
                endpoint = endpoint.decode("utf-8", "replace")
            name = event_name(message["event"])
            if name == "connected" and endpoint.startswith("tcp://"):
                self._connections[role] = (int(message["value"]), endpoint)  # the event's value is the connection's FD
            elif name in ("disconnected", "closed"):
                self._connections.pop(role, None)
            self.take(role, message["event"], endpoint)

    def take(self, role: str, event: int, endpoint: str) -> None:
        """One monitor event: counted, and its transition (if any) logged."""
        assert self.link is not None
        transition = self.link.event(role, event, endpoint, self.clock())
        if transition is None:
            return
        if transition.gone:
            self._expiry_told = False
            self._said_gone = self.throttle.warning("frontend gone", "{}", transition.line(self.rank))
        elif self._said_gone:
            self.log.info("{}", transition.line(self.rank))

    def _check_expiry(self) -> None:
        link = self.link
        if self.exit_after is None or link is None or not link.gone or self._expiry_told:
            return
        if link.gone_for(self.clock()) >= self.exit_after:
            self._expiry_told = True
            self.on_expired()

    def close(self) -> None:
        """Stop every monitor and close its PAIR (the context cannot end
        while one is open); again: nothing."""
        watched, self.watched = self.watched, None
        self._connections = {}
        if watched is not None:
            for sock, monitor in watched.made:
                if not sock.closed:
                    try:
                        sock.disable_monitor()
                    except zmq.ZMQError:  # the socket is going anyway
                        pass
                monitor.close(linger=0)
        self._monitors = []


def read_tcp_info(fd: int, endpoint: str) -> Optional[TcpInfo]:
    """TCP_INFO of the connection on `fd`, or None when `fd` is no longer a
    TCP connection to `endpoint` (libzmq closed it, and the number may be
    another file's by now). The FD is duplicated for the read and the
    duplicate closed at once: holding one would keep a connection libzmq
    closed open."""
    host, _, port = endpoint[len("tcp://") :].rpartition(":")
    host = host.strip("[]")
    try:
        dup = _socket.socket(fileno=os.dup(fd))
    except OSError:
        return None
    try:
        peer = dup.getpeername()
        if dup.type != _socket.SOCK_STREAM or str(peer[1]) != port or (_is_ip(host) and peer[0] != host):
            return None
        return parse_tcp_info(dup.getsockopt(_socket.IPPROTO_TCP, _socket.TCP_INFO, TCP_INFO_SIZE))
    except (OSError, ValueError, TypeError, IndexError):
        return None
    finally:
        dup.close()


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False  # a name (the peer's address is what it resolved to): the port must do
    return True
