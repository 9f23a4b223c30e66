"""Sockets: joining the frontend's handshake, one engine's sockets and the
loops that own them.

The frontend binds every socket; an engine only connects (docs/protocol.md §1).
Per engine identity this module connects the handshake DEALER, sends HELLO,
takes INIT, connects one DEALER per input address (sending the ready response
on each) and one PUSH per output address, passes the coordinator gate when
INIT names a coordinator (§2.6), sends READY (§2.1) and closes the
handshake DEALER (the frontend closes its end once every engine is ready).

Then exactly one greenlet owns each socket direction (runner.py spawns
them): a `Reader` loop per input socket (frames -> decoded messages ->
`deliver`) and one `Sender` loop for all output sockets (`take_output` ->
packed messages -> `outputs[client_index]`). They talk to the stepper only
through the engine's `links.StageLinks` (two bounded queues and the `wake`
event), and they stop at the gates the fault layer closes there
(fault_injection.py: hang, stall).

Every wait is a `zmq.green` one: a plain pyzmq call that waits would block
the whole gevent hub. `RCVTIMEO` does nothing on green sockets, so waits use
`gevent.Timeout`. What cannot wait (NOBLOCK) goes to libzmq directly
(`recv_noblock`, `send_noblock`, `readable`): a green call costs more per
message (its EVENTS check and enum flag arithmetic after every call), and
that is most of what a step of a few tokens costs. That
is safe because each socket direction has one greenlet: nobody else waits on
the socket for the state check a direct call skips, and the owner waits
with a wait on the socket's FD (`ReadWaiter`, or the green send on EAGAIN).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

import gevent
import zmq.green as zmq
from loguru import logger
from zmq.backend import Socket as _BackendSocket

from gmock_engine.wire.eras import Wire
from gmock_engine.wire.handshake import COORDINATOR_WAIT_HINT, decode_init, hello_message, init_address_problem, InitMessage
from gmock_engine.wire.outputs import pack, salvage, without_requests, Packer
from gmock_engine.wire.types import COORDINATOR_READY, ENGINE_CORE_DEAD, SUBSCRIBE_ALL, engine_identity, ProtocolError
from gmock_engine.runtime.links import StageLinks
from gmock_engine.utils.logs import Throttle

#: How often a wait for the frontend logs that it is still waiting.
WAIT_LOG_INTERVAL_S = 10.0
#: Linger of the output PUSH sockets at close: long enough for the last
#: outputs to leave, short enough for the 1 s shutdown budget.
OUTPUT_LINGER_MS = 300
#: Linger of the handshake DEALER, closed once READY is sent (as vLLM's
#: engine does, with 5 s): READY goes out over the connection INIT came on.
HANDSHAKE_LINGER_MS = 1000
#: Requests the sender answered with ERROR (an output would not encode) and
#: whose later outputs it still holds back; bounded, as they end by themselves.
MAX_CUT_REQUESTS = 4096

#: A reader parked on an idle socket looks again after this long even if
#: the socket never signalled (zmq.green's guard against a lost edge: 11.6 s).
WAIT_SAFETY_NET_S = 120.0
#: Messages a reader takes in a row before it lets the hub run a round
#: (a round costs little next to decoding this many ADDs).
READ_SLICE = 16

#: Put on the output queue to end the `Sender` after what is queued before it.
STOP = object()

_recv = _BackendSocket.recv
_send = _BackendSocket.send
_get = _BackendSocket.get
_NOBLOCK = int(zmq.NOBLOCK)
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)
_FD = int(zmq.FD)


def recv_noblock(sock: Any) -> List[bytes]:
    """The frames of the next message on `sock`, straight from libzmq, or
    zmq.Again when there is none (never waits).

    Each frame is taken as a zmq.Frame and copied out, its `more` flag read
    from the message itself (zmq_msg_more): a socket option read costs
    more in pyzmq, which looks every option up in its enum first."""
    frame = _recv(sock, _NOBLOCK, False)
    frames = [frame.bytes]
    while frame.more:
        frame = _recv(sock, _NOBLOCK, False)
        frames.append(frame.bytes)
    return frames


def readable(sock: Any) -> bool:
    """A message waits on `sock`: libzmq's ZMQ_EVENTS read straight (no
    EAGAIN exception to build, no green state check)."""
    return bool(_get(sock, _EVENTS) & _POLLIN)


class ReadWaiter:
    """The wait of the one loop that reads `sock` from now on (a `Reader`),
    at the least the hub can do: a libev io watcher on the socket's FD,
    started for each wait and stopped after it (gevent's own `Hub.wait`,
    a compiled Waiter), and one repeating timer, started once, as the
    safety net against a lost edge (WAIT_SAFETY_NET_S).

    The FD is edge-triggered: reading ZMQ_EVENTS (`readable`) re-arms it,
    so a caller that reads it before each wait misses nothing that arrives
    after that look; a wait may return with nothing there: look again.
    zmq.green's own wait costs more for each message that arrives alone
    (an ADD behind vllm-rs): it builds an AsyncResult and starts
    a gevent.Timeout (its guard, every 11.6 s) for every wait, and its FD
    watcher runs a Python callback that reads ZMQ_EVENTS through pyzmq's
    option lookup and sets that AsyncResult, whose links wake the waiter.
    This waiter stops zmq.green's watcher of `sock`, so no green call may
    wait on `sock` after it is made (the handshake's green calls on the
    input sockets are over by then; `close` is unaffected)."""

    def __init__(self, sock: Any) -> None:
        hub = gevent.get_hub()
        state_watcher = getattr(sock, "_state_event", None)
        if state_watcher is not None:
            state_watcher.stop()  # zmq.green's: its callback would run for every wake-up
        self._hub_wait = hub.wait
        self._io = hub.loop.io(_get(sock, _FD), 1)  # 1: READ
        # The safety net wakes this socket's loop (when parked) to look again.
        self._net = hub.loop.timer(WAIT_SAFETY_NET_S, WAIT_SAFETY_NET_S, ref=False)
        self._net.start(self._look_again)

    def wait(self) -> None:
        """Park until the socket's FD signals (or the safety net fires)."""
        self._hub_wait(self._io)

    def _look_again(self) -> None:
        io = self._io
        if io.active:  # the loop is parked in Hub.wait: answer as its watcher would
            io.callback(*io.args)

    def close(self) -> None:
        """Stop the safety net (the io watcher is stopped between waits)."""
        self._net.stop()
        self._net.close()


def patient(sock: Any) -> Any:
    """`sock` (zmq.green) with its guard against a lost edge at
    WAIT_SAFETY_NET_S instead of every 11.6 s: for a socket a greenlet
    waits on for ever with zmq.green's own wait (the KV replay ROUTER; the
    readers have their `ReadWaiter`)."""
    sock._gevent_bug_timeout = WAIT_SAFETY_NET_S
    return sock


def send_noblock(sock: Any, data: bytes) -> None:
    """Send one frame straight to libzmq; zmq.Again at the high-water mark
    (never waits)."""
    _send(sock, data, _NOBLOCK)


_NOBLOCK_SNDMORE = _NOBLOCK | int(zmq.SNDMORE)


def publish_noblock(sock: Any, frames: Sequence[bytes]) -> None:
    """A multipart message on a PUB, straight to libzmq: a PUB never waits
    (at its high-water mark, or with no subscriber, libzmq drops the
    message), and nobody waits on the socket, so zmq.green's wrapper (its
    state check after every frame) has nothing to do and would cost every
    KV event batch."""
    last = len(frames) - 1
    for index, frame in enumerate(frames):
        _send(sock, frame, _NOBLOCK if index == last else _NOBLOCK_SNDMORE)


@dataclass
class EngineSockets:
    """One engine's connected sockets; list position = client index (§2.4)."""

    rank: int
    #: Only until READY is sent: both frontends close their handshake ROUTER
    #: once every engine is ready, and an open DEALER would try to reconnect
    #: to it for ever (~7 refused connections a second per engine).
    handshake: Optional[Any]
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

    def send_dead(self, log: Any) -> None:
        """ENGINE_CORE_DEAD, raw, on every client's socket (§4.1); without
        blocking: a socket at its high-water mark is named in the log."""
        for index, sock in enumerate(self.outputs):
            try:
                sock.send(ENGINE_CORE_DEAD, zmq.NOBLOCK)
            except zmq.Again:
                log.warning("ENGINE_CORE_DEAD not sent on output[{}]: the frontend is not reading (high-water mark)", index)


def recv_waiting(sock: Any, what: str, log: Any, hint: Optional[str] = None) -> List[bytes]:
    """recv_multipart that logs every WAIT_LOG_INTERVAL_S while the frontend
    is silent; the first such line is a warning with `hint`, if given."""
    while True:
        frames = None
        with gevent.Timeout(WAIT_LOG_INTERVAL_S, False):
            frames = sock.recv_multipart()
        if frames is not None:
            return frames
        if hint is not None:
            log.warning("still waiting for {} from the frontend: {}", what, hint)
            hint = None
        else:
            log.info("still waiting for {} from the frontend", what)


def join_frontend(
    ctx: Any,
    rank: int,
    handshake_address: str,
    ready_response: Callable[[InitMessage], Dict[str, Any]],
    ready_message: Callable[[InitMessage], Dict[str, Any]],
    on_init: Optional[Callable[[InitMessage], None]] = None,
) -> "tuple[EngineSockets, InitMessage]":
    """Run the startup handshake for engine `rank` (§2.1) and return its sockets.

    `ready_response(init)` builds the registration map sent on every input
    socket (§2.5); `ready_message(init)` the READY map (§2.7). Raises
    ProtocolError if INIT is malformed (the frontend would not work anyway).
    `on_init(init)`, if given, is called once INIT arrived (the start-up hint
    tells a missing INIT from a missing coordinator READY by it).
    """
    log = logger.bind(engine=rank)
    identity = engine_identity(rank)
    handshake = ctx.socket(zmq.DEALER)
    handshake.setsockopt(zmq.IDENTITY, identity)
    handshake.setsockopt(zmq.LINGER, 0)
    handshake.connect(handshake_address)
    sockets = EngineSockets(rank, handshake)
    try:
        handshake.send(pack(hello_message()))
        log.debug("HELLO sent to {}", handshake_address)
        init = decode_init(recv_waiting(handshake, "INIT", log))
        log.debug("INIT {}", init)
        if on_init is not None:
            on_init(init)
        problem = init_address_problem(handshake_address, init)
        if problem is not None:
            log.error(problem)

        registration = pack(ready_response(init))
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
            sub.send(SUBSCRIBE_ALL)
            push = ctx.socket(zmq.PUSH)
            push.setsockopt(zmq.LINGER, 0)
            push.connect(init.coordinator_output)
            sockets.coordinator_input, sockets.coordinator_output = sub, push
            while True:
                frames = recv_waiting(sub, "the coordinator's READY", log, None if problem else COORDINATOR_WAIT_HINT)
                if frames == [COORDINATOR_READY]:
                    break
                log.warning("coordinator sent {} frame(s) before READY; ignored", len(frames))
            log.debug("coordinator READY received")

        handshake.send(pack(ready_message(init)))
        handshake.close(linger=HANDSHAKE_LINGER_MS)
        sockets.handshake = None
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


# -- the socket loops -------------------------------------------------------------


@dataclass
class Incidents:
    """Trouble one engine contained without stopping, counted for the
    summary line, gmock_stats and /metrics. Shared by the socket loops and
    the stepper, each of which adds what it contained."""

    #: Frames dropped because they could not be decoded.
    bad_frames: int = 0
    #: Outputs that could not be encoded (second line of defence), frames
    #: the decoder itself failed on, inputs or steps whose processing failed.
    contained_failures: int = 0


class Reader:
    """The input side of one engine: `run` is the loop of one input socket
    (one greenlet per input DEALER and one for the coordinator XSUB), each
    the only greenlet that receives on its socket (STYLE: one waiter per
    socket direction)."""

    def __init__(self, links: StageLinks, wire: Wire, incidents: Incidents, throttle: Throttle) -> None:
        #: To the stepper: `deliver`, `wake`; the gate a hang closes
        #: (--fault-hang: the socket is not read): `input_open`; `paced`.
        self.links = links
        self.wire = wire
        self.incidents = incidents
        self.throttle = throttle

    def run(self, sock: Any, where: str, decode: Callable[[Any, Wire], Any]) -> None:
        """One socket -> decoded messages -> input queue. `decode` is
        wire.inputs.decode_input for an input DEALER, wire.inputs.decode_coordinator
        for the coordinator XSUB (which answers None for a late READY, §2.6).
        A frame that cannot be decoded is dropped; only the socket failing
        ends this loop."""
        waiter = ReadWaiter(sock)  # idle, this loop waits on the socket for ever
        try:
            self._loop(sock, where, decode, waiter.wait)
        finally:
            waiter.close()

    def _loop(self, sock: Any, where: str, decode: Callable[[Any, Wire], Any], wait: Callable[[], None]) -> None:
        wire, links = self.wire, self.links
        deliver, wake, input_open = links.deliver, links.wake, links.input_open
        burst = 0  # messages read since this loop last gave the hub a round
        while True:
            if not input_open():
                links.wait_input_open()
            if not readable(sock):
                # Nothing there: wait for it, then look again. Not a green
                # recv_multipart, which costs more per message than this
                # (its per-frame state checks, an EAGAIN exception).
                burst = 0
                wait()
                continue
            if burst == READ_SLICE:
                # Paced, a burst (a wave of ADDs, each decoded here) gives
                # the hub a round every READ_SLICE messages, so a step that
                # falls due meanwhile (its timer) is not held up behind the
                # whole burst, which would make it late by the burst's
                # decoding time. Unpaced, the stepper yields
                # between its back-to-back steps, and the whole burst is
                # better taken in at once: the stepper's input slice grows
                # with the queue (runner.INPUT_SLICE_DIVISOR).
                burst = 0
                if links.paced():
                    gevent.idle()
                    continue  # the gate (a hang may have closed it) and the socket again
            burst += 1
            frames = recv_noblock(sock)
            try:
                message = decode(frames, wire)
            except Exception as exc:  # noqa: BLE001 - one frame's content, whatever it broke
                self._drop(where, exc)
                continue
            if message is not None:
                deliver(message)  # waits while the input queue is full (back-pressure)
                wake()

    def _drop(self, where: str, error: Exception) -> None:
        """Log a dropped frame; a flood (fuzzing, a broken peer) is summarised
        rather than written line by line (the Throttle's budget per window,
        then a count)."""
        self.incidents.bad_frames += 1
        if isinstance(error, ProtocolError):
            self.throttle.warning("bad frame", "bad frame on {} dropped: {:.300}", where, str(error))
        else:  # the decoder itself failed on this frame: a bug, with its traceback
            self.incidents.contained_failures += 1
            self.throttle.warning("decoder failure", "frame on {} dropped: the decoder failed on it", where, exception=True)


class Sender:
    """The output side of one engine: `run` is the one place a message
    leaves, the only greenlet that sends on the engine's output sockets."""

    def __init__(self, links: StageLinks, sockets: EngineSockets, wire: Wire, incidents: Incidents, throttle: Throttle) -> None:
        # Position = client index (§2.4); index -1 = coordinator_output (§4.1,
        # §6.2), which is None without a coordinator and then never addressed.
        self.outputs = [*sockets.outputs, sockets.coordinator_output]
        #: From the stepper: `take_output`; the gate a stall or a hang closes
        #: (--fault-stall-outputs, --fault-hang): `outputs_open`.
        self.links = links
        self.wire = wire
        self.incidents = incidents
        self.throttle = throttle
        #: Request ids this sender ended with ERROR (see wire.outputs.salvage).
        self.cut: set = set()
        #: True while `run` waits for the output queue (it holds no message):
        #: then `send_now` may send in its place.
        self.idle = False
        self._pack = Packer().pack

    def run(self) -> None:
        """Pack each queued (client_index, message) and PUSH it to
        outputs[client_index] (client index -1: the coordinator_output
        socket, §6.2), until STOP.

        A message that does not pack never stops it: its requests are
        answered with ERROR instead (wire.outputs.salvage) and their later
        outputs held back; only a socket failing ends this loop."""
        outputs = self.outputs
        pack = self._pack
        take_output, outputs_open, cut = self.links.take_output, self.links.outputs_open, self.cut
        while True:
            self.idle = True
            item = take_output()
            self.idle = False
            if not outputs_open():
                self.links.wait_outputs_open()
            if item is STOP:
                return
            client, message = item
            # bytes: encoded by the stepper (runner.EngineRunner._emit); a message:
            # queued unencoded (a late finish's timer), encoded now
            data = message if message.__class__ is bytes else self._encode(message, pack, cut)
            if data is not None:
                try:
                    send_noblock(outputs[client], data)
                except zmq.Again:
                    outputs[client].send(data)  # at the high-water mark: wait (green)

    def encode(self, message: List[Any]) -> Optional[bytes]:
        """The bytes of one message as `run` would send them (None: nothing
        to send: it carried only cut requests). The stepper encodes every
        message it makes at once, in order, so what the engine reuses from
        step to step (EngineSettings.reuse_outputs) is read before the next
        step changes it, and a queued message is its bytes."""
        if self.cut:
            return self._encode(message, self._pack, self.cut)
        try:  # `_encode` with nothing cut, inline: this is every step's
            return self._pack(message)
        except Exception as exc:  # noqa: BLE001 - as in _encode
            return self._salvage(message, exc, self._pack)

    def send_now(self, item: Any) -> bool:
        """Send one (client_index, encoded message) from the caller's greenlet, if
        that keeps every rule of `run`: only while `run` waits on an empty
        queue (so the order of messages holds and nobody else is sending),
        outputs flowing (no stall or hang), and without waiting (NOBLOCK:
        the socket never has a second waiter). False: nothing was sent (the
        socket is at its high-water mark); queue the item instead.

        This is the stepper's shortcut when the sender is idle:
        it saves a queue put and get and a greenlet switch per step, and a
        message leaves in the step that made it."""
        if not (self.idle and self.links.outputs_open()):
            return False
        client, data = item
        try:
            send_noblock(self.outputs[client], data)
        except zmq.Again:
            return False
        return True

    def _encode(self, message: List[Any], pack: Callable[[Any], bytes], cut: set) -> Optional[bytes]:
        """The bytes of a message, None for nothing to send."""
        if cut:
            message = without_requests(message, cut)
            if message is None:
                return None
        try:
            return pack(message)
        except Exception as exc:  # noqa: BLE001 - msgpack raises OverflowError, TypeError, ValueError
            return self._salvage(message, exc, pack)

    def _salvage(self, message: List[Any], exc: Exception, pack: Callable[[Any], bytes]) -> Optional[bytes]:
        reason = f"{type(exc).__name__}: {str(exc):.120}"
        data, failed = salvage(message, pack, self.wire.layout, reason)
        self.incidents.contained_failures += 1
        self.throttle.warning(
            "unencodable output", "a message could not be encoded ({}); {} request(s) answered with ERROR instead", reason, len(failed)
        )
        if len(self.cut) + len(failed) > MAX_CUT_REQUESTS:
            self.cut.clear()
        self.cut.update(failed)
        return data
