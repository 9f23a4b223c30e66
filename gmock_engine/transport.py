"""Sockets: joining the frontend's handshake and owning one engine's sockets.

The frontend binds every socket; an engine only connects (PROTOCOL.md §1).
Per engine identity this module connects the handshake DEALER, sends HELLO,
takes INIT, connects one DEALER per input address (sending the ready response
on each) and one PUSH per output address, passes the coordinator gate when
INIT names a coordinator (§2.6), and sends READY (§2.1).

Only `zmq.green` is used: plain pyzmq calls would block the whole gevent hub.
`RCVTIMEO` does nothing on green sockets, so waits use `gevent.Timeout`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

import gevent
import zmq.green as zmq
from loguru import logger

from . import protocol
from .protocol import InitMessage

#: How often a wait for the frontend logs that it is still waiting.
WAIT_LOG_INTERVAL_S = 10.0
#: Linger of the output PUSH sockets at close: long enough for the last
#: outputs to leave, short enough for the 1 s shutdown budget.
OUTPUT_LINGER_MS = 300


@dataclass
class EngineSockets:
    """One engine's connected sockets; list position = client index (§2.4)."""

    rank: int
    handshake: Any
    inputs: List[Any] = field(default_factory=list)
    outputs: List[Any] = field(default_factory=list)
    coordinator_input: Optional[Any] = None
    coordinator_output: Optional[Any] = None

    def close(self, output_linger_ms: int = OUTPUT_LINGER_MS) -> None:
        """Close everything; only the output PUSHes linger (bounded; 0: drop
        what is queued, as a crash does)."""
        for sock in [self.handshake, *self.inputs, self.coordinator_input, self.coordinator_output]:
            if sock is not None:
                sock.close(linger=0)
        for sock in self.outputs:
            sock.close(linger=output_linger_ms)


def recv_waiting(sock: Any, what: str, log: Any) -> List[bytes]:
    """recv_multipart that logs every WAIT_LOG_INTERVAL_S while the frontend is silent."""
    while True:
        frames = None
        with gevent.Timeout(WAIT_LOG_INTERVAL_S, False):
            frames = sock.recv_multipart()
        if frames is not None:
            return frames
        log.info("still waiting for {} from the frontend", what)


def join_frontend(
    ctx: Any,
    rank: int,
    handshake_address: str,
    ready_response: Callable[[InitMessage], Dict[str, Any]],
    ready_message: Callable[[InitMessage], Dict[str, Any]],
) -> "tuple[EngineSockets, InitMessage]":
    """Run the startup handshake for engine `rank` (§2.1) and return its sockets.

    `ready_response(init)` builds the registration map sent on every input
    socket (§2.5); `ready_message(init)` the READY map (§2.7). Raises
    ProtocolError if INIT is malformed (the frontend would not work anyway).
    """
    log = logger.bind(engine=rank)
    identity = protocol.engine_identity(rank)
    handshake = ctx.socket(zmq.DEALER)
    handshake.setsockopt(zmq.IDENTITY, identity)
    handshake.setsockopt(zmq.LINGER, 0)
    handshake.connect(handshake_address)
    sockets = EngineSockets(rank, handshake)
    try:
        handshake.send(protocol.pack(protocol.hello_message()))
        log.debug("HELLO sent to {}", handshake_address)
        init = protocol.decode_init(recv_waiting(handshake, "INIT", log))
        log.debug("INIT {}", init)

        registration = protocol.pack(ready_response(init))
        for address in init.inputs:
            dealer = ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.IDENTITY, identity)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(address)
            # One registration frame per input socket: an API server waits for
            # every engine on its own socket (§2.4).
            dealer.send(registration)
            sockets.inputs.append(dealer)
        for address in init.outputs:
            push = ctx.socket(zmq.PUSH)
            push.connect(address)
            sockets.outputs.append(push)

        if init.has_coordinator:
            # §2.6: subscribe to everything, then wait for the one READY.
            sub = ctx.socket(zmq.XSUB)
            sub.setsockopt(zmq.LINGER, 0)
            sub.connect(init.coordinator_input)
            sub.send(protocol.SUBSCRIBE_ALL)
            push = ctx.socket(zmq.PUSH)
            push.setsockopt(zmq.LINGER, 0)
            push.connect(init.coordinator_output)
            sockets.coordinator_input, sockets.coordinator_output = sub, push
            while True:
                frames = recv_waiting(sub, "the coordinator's READY", log)
                if frames == [protocol.COORDINATOR_READY]:
                    break
                log.warning("coordinator sent {} frame(s) before READY; ignored", len(frames))
            log.debug("coordinator READY received")

        handshake.send(protocol.pack(ready_message(init)))
        log.info(
            "engine {} joined the frontend: {} client(s){}",
            rank,
            len(init.inputs),
            ", with coordinator" if init.has_coordinator else "",
        )
        return sockets, init
    except BaseException:
        sockets.close()
        raise
