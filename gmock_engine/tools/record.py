"""`gmock-engine record` (`./run.sh record`): the record tap (docs/record.md).

It sits between a real frontend and real engine cores, both unchanged:

* toward the frontend it is N engines (ranks start..start+N-1): per rank a
  DEALER on the frontend's handshake ROUTER, then per client a DEALER on the
  frontend's input socket and a PUSH on its output socket (§1, §2);
* toward the engines it is the frontend: it binds its own handshake ROUTER
  and, per rank and client, an input ROUTER and an output PULL.

Handshake: an engine's HELLO and READY and its registration on each input
socket are relayed unchanged; the frontend's INIT is relayed with only
`addresses.inputs`/`outputs` replaced by the tap's own sockets. Everything
else in INIT (coordinator addresses, the frontend's stats address, the
parallel config) stays, so the engines talk to a DP coordinator directly
and what they echo in the registration and READY (§2.5, §2.7) is still the
frontend's. After that every frame is relayed both ways as it came; the
trace writer (gmock_engine/timing/trace.py) decodes copies in a process of its own.

Plain pyzmq (no gevent): one poller loop relays and hands each relayed data
message, with its receive time, to a PUSH socket; the writer process PULLs,
decodes and writes. Decoding in a thread instead would hold the GIL while
the relay wants to forward the next frame.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import signal
import struct
import sys
import tempfile
import threading
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import msgpack
import zmq

from gmock_engine.config.loader import ConfigError
from gmock_engine.tools.record_config import parse_args

from gmock_engine.timing.trace import TraceWriter
from gmock_engine.wire.handshake import decode_init
from gmock_engine.wire.inputs import unpack
from gmock_engine.wire.types import engine_identity

log = logging.getLogger("gmock_engine.record")

#: Poll timeout: how soon a stop request is noticed.
POLL_MS = 200
#: The READY relayed on the handshake DEALER gets this long to leave before it closes.
HANDSHAKE_LINGER_MS = 1000
#: How long closing waits for the writer to take what is still queued for it.
TRACE_LINGER_MS = 60_000
#: Engine PUSH sockets linger so the last outputs (and ENGINE_CORE_DEAD) get out.
OUTPUT_LINGER_MS = 1000


def _socket(ctx: zmq.Context, kind: int) -> zmq.Socket:
    sock = ctx.socket(kind)
    # As vLLM (§1): unbounded queues, so the tap never drops what a peer would have queued.
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.LINGER, 0)
    return sock


class Binder:
    """Binds the tap's engine-facing data sockets next to its handshake address:
    ephemeral TCP ports on the same host, or ipc paths beside its socket file."""

    def __init__(self, handshake_address: str, advertise_host: Optional[str] = None) -> None:
        self.handshake_address = handshake_address
        self.advertise_host = advertise_host
        self._count = 0

    def bind(self, sock: zmq.Socket, name: str) -> str:
        self._count += 1
        if self.handshake_address.startswith("ipc://"):
            address = f"{self.handshake_address}-{name}-{self._count}"
            sock.bind(address)
            return address
        host = self.handshake_address[len("tcp://"):].rsplit(":", 1)[0]
        port = sock.bind_to_random_port(f"tcp://{host}")
        advertised = self.advertise_host or ("127.0.0.1" if host in ("*", "0.0.0.0") else host)
        return f"tcp://{advertised}:{port}"


class Tap:
    """The relay: sockets, the handshake rewrite and the poll loop."""

    def __init__(
        self,
        frontend_handshake: str,
        engine_handshake: str,
        ranks: Sequence[int],
        trace_address: str,
        advertise_host: Optional[str] = None,
    ) -> None:
        self.ctx = zmq.Context()
        self.frontend_handshake = frontend_handshake
        self.ranks = set(ranks)
        #: copies of the relayed data messages, to the writer process
        self.trace = _socket(self.ctx, zmq.PUSH)
        self.trace.connect(trace_address)
        self.binder = Binder(engine_handshake, advertise_host)
        self.engine_hs = _socket(self.ctx, zmq.ROUTER)
        self.engine_hs.bind(engine_handshake)
        self.poller = zmq.Poller()
        self.poller.register(self.engine_hs, zmq.POLLIN)
        #: socket -> (role, rank, client)
        self.roles: Dict[zmq.Socket, Tuple[str, int, int]] = {}
        self.frontend_hs: Dict[int, zmq.Socket] = {}
        self.frontend_inputs: Dict[Tuple[int, int], zmq.Socket] = {}
        self.frontend_outputs: Dict[Tuple[int, int], zmq.Socket] = {}
        self.engine_inputs: Dict[Tuple[int, int], zmq.Socket] = {}
        self.ready: set = set()
        self.stopping = threading.Event()

    def _watch(self, sock: zmq.Socket, role: str, rank: int, client: int = -1) -> None:
        self.roles[sock] = (role, rank, client)
        self.poller.register(sock, zmq.POLLIN)

    # -- handshake -------------------------------------------------------------

    def _engine_handshake(self, frames: List[bytes]) -> None:
        """HELLO / READY from an engine: relayed to the frontend under its identity."""
        identity, payload = frames[0], frames[1:]
        rank = int.from_bytes(identity, "little")
        if rank not in self.ranks or len(identity) != 2:
            log.warning("handshake from identity %r, not one of ranks %s: ignored", identity, sorted(self.ranks))
            return
        sock = self.frontend_hs.get(rank)
        if sock is None:
            sock = _socket(self.ctx, zmq.DEALER)
            sock.setsockopt(zmq.IDENTITY, identity)
            sock.connect(self.frontend_handshake)
            self.frontend_hs[rank] = sock
            self._watch(sock, "frontend_hs", rank)
        status = _status(payload)
        sock.send_multipart(payload)
        log.info("engine %d: %s relayed to the frontend", rank, status)
        if status == "READY":
            # As an engine does (runtime/transport.py): the frontend closes its handshake ROUTER once
            # every engine is READY, and an open DEALER would keep reconnecting to it.
            self.poller.unregister(sock)
            del self.roles[sock], self.frontend_hs[rank]
            sock.close(linger=HANDSHAKE_LINGER_MS)
            self.ready.add(rank)
            if self.ready == self.ranks:
                log.info("all %d engine(s) ready", len(self.ranks))

    def _frontend_init(self, rank: int, frames: List[bytes]) -> None:
        """INIT from the frontend: connect the tap to its data sockets, bind the
        engine's, and hand the engine an INIT naming the tap's."""
        init = decode_init(frames)
        message = unpack(frames[0])
        identity = engine_identity(rank)
        inputs, outputs = [], []
        for client, (fe_in, fe_out) in enumerate(zip(init.inputs, init.outputs)):
            dealer = _socket(self.ctx, zmq.DEALER)
            dealer.setsockopt(zmq.IDENTITY, identity)
            dealer.connect(fe_in)
            push = _socket(self.ctx, zmq.PUSH)
            push.setsockopt(zmq.LINGER, OUTPUT_LINGER_MS)
            push.connect(fe_out)
            router = _socket(self.ctx, zmq.ROUTER)
            inputs.append(self.binder.bind(router, f"r{rank}-c{client}-in"))
            pull = _socket(self.ctx, zmq.PULL)
            outputs.append(self.binder.bind(pull, f"r{rank}-c{client}-out"))
            self.frontend_inputs[rank, client] = dealer
            self.frontend_outputs[rank, client] = push
            self.engine_inputs[rank, client] = router
            self._watch(dealer, "frontend_in", rank, client)
            self._watch(router, "engine_in", rank, client)
            self._watch(pull, "engine_out", rank, client)
        message["addresses"] = {**message["addresses"], "inputs": inputs, "outputs": outputs}
        self.engine_hs.send_multipart([identity, msgpack.packb(message, use_bin_type=True)])
        log.info("engine %d: INIT relayed, %d client(s), tap sockets %s / %s", rank, len(inputs), inputs, outputs)

    # -- the loop --------------------------------------------------------------

    def run(self) -> None:
        """Relay until stop(); every relayed data message also goes to the writer."""
        while not self.stopping.is_set():
            for sock, _ in self.poller.poll(POLL_MS):
                self._drain(sock)

    def _drain(self, sock: zmq.Socket) -> None:
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if sock is self.engine_hs:
                self._engine_handshake(frames)
                continue
            role, rank, client = self.roles[sock]
            if role == "frontend_in":
                self.engine_inputs[rank, client].send_multipart([engine_identity(rank), *frames])
                self.trace.send_multipart([_IN, _HEAD.pack(time.time(), rank, client), *frames])
            elif role == "engine_out":
                self.frontend_outputs[rank, client].send_multipart(frames)
                self.trace.send_multipart([_OUT, _HEAD.pack(time.time(), rank, client), *frames])
            elif role == "engine_in":
                # the registration (§2.5), or anything else the engine says on its input socket
                self.frontend_inputs[rank, client].send_multipart(frames[1:])
            elif role == "frontend_hs":
                self._frontend_init(rank, frames)

    def stop(self) -> None:
        self.stopping.set()

    def close(self) -> None:
        for sock in list(self.roles) + [self.engine_hs]:
            sock.close(linger=0)
        # everything queued for the writer, then the end mark (ipc: delivered, however many)
        self.trace.send(_END)
        self.trace.close(linger=TRACE_LINGER_MS)
        for sock in self.frontend_outputs.values():
            sock.close(linger=OUTPUT_LINGER_MS)
        self.ctx.term()


def _status(payload: Sequence[bytes]) -> str:
    try:
        return str(unpack(payload[0]).get("status"))
    except Exception:
        return "an undecodable handshake message"


#: Writer messages: [kind, _HEAD(t, rank, client), *frames] or [_END].
_IN, _OUT, _END = b"i", b"o", b"end"
_HEAD = struct.Struct("<dii")


def write_trace(address: str, path: str, meta: Dict[str, Any], token_ids: bool) -> None:
    """The writer process: PULL, decode and write until the end mark.

    It ignores SIGTERM/SIGINT (a process-group signal reaches it too): the
    tap sends the end mark after its last relayed message, so the trace is
    complete when this returns."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ctx = zmq.Context()
    pull = _socket(ctx, zmq.PULL)
    pull.bind(address)
    try:
        with open(path, "w", encoding="utf-8") as stream:
            writer = TraceWriter(stream, token_ids=token_ids, **meta)
            while True:
                message = pull.recv_multipart()
                if message[0] == _END:
                    break
                t, rank, client = _HEAD.unpack(message[1])
                (writer.input if message[0] == _IN else writer.output)(t, rank, client, message[2:])
                if not pull.poll(0):
                    writer.flush()
    finally:
        pull.close(linger=0)
        ctx.term()


def main(argv: Sequence[str]) -> int:
    """Run the tap until SIGTERM/SIGINT; the trace is complete when it exits."""
    try:
        args = parse_args(argv)
    except ConfigError as exc:
        print(f"gmock-engine record: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=os.environ.get("GMOCK_LOG_LEVEL", "INFO").upper(), format="%(asctime)s record %(levelname)s %(message)s")
    ranks = list(range(args.data_parallel_start_rank, args.data_parallel_start_rank + args.engine_count))
    workdir = tempfile.mkdtemp(prefix="gmock-record-")
    trace_address = f"ipc://{workdir}/trace"
    meta = {"created": time.time(), "ranks": ranks, "frontend_handshake": args.handshake_address, "clock": "time.time"}
    # spawn, not fork: the child gets no copy of this process's state
    writer = multiprocessing.get_context("spawn").Process(
        target=write_trace, args=(trace_address, args.output, meta, args.record_token_ids), name="trace-writer"
    )
    writer.start()
    tap = Tap(args.handshake_address, args.engine_handshake_address, ranks, trace_address, args.advertise_host)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: tap.stop())
    log.info("tap: engines %s on %s, frontend %s, trace %s", ranks, args.engine_handshake_address, args.handshake_address, args.output)
    try:
        tap.run()
    finally:
        tap.close()
        writer.join()
        shutil.rmtree(workdir, ignore_errors=True)
    log.info("trace written to %s", args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
