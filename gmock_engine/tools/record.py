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
trace writer (gmock_engine/trace.py) decodes copies in its own thread.

Plain pyzmq and threads (no gevent): one poller loop relays, one thread
writes the trace.
"""

from __future__ import annotations

import argparse
import logging
import os
import queue
import signal
import sys
import threading
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import msgpack
import zmq

from gmock_engine.trace import TraceWriter
from gmock_engine.wire.handshake import decode_init
from gmock_engine.wire.inputs import unpack
from gmock_engine.wire.types import engine_identity

log = logging.getLogger("gmock_engine.record")

#: Poll timeout: how soon a stop request is noticed.
POLL_MS = 200
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
        trace: "queue.Queue[Any]",
        advertise_host: Optional[str] = None,
    ) -> None:
        self.ctx = zmq.Context()
        self.frontend_handshake = frontend_handshake
        self.ranks = set(ranks)
        self.trace = trace
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
        """Relay until stop(); every relayed data frame also goes to the trace queue."""
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
                self.trace.put(("in", time.time(), rank, client, frames))
            elif role == "engine_out":
                self.frontend_outputs[rank, client].send_multipart(frames)
                self.trace.put(("out", time.time(), rank, client, frames))
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
        for sock in self.frontend_outputs.values():
            sock.close(linger=OUTPUT_LINGER_MS)
        self.ctx.term()


def _status(payload: Sequence[bytes]) -> str:
    try:
        return str(unpack(payload[0]).get("status"))
    except Exception:
        return "an undecodable handshake message"


def write_trace(path: str, items: "queue.Queue[Any]", meta: Dict[str, Any], token_ids: bool) -> None:
    """The writer thread: decode and write until the None sentinel."""
    with open(path, "w", encoding="utf-8") as stream:
        writer = TraceWriter(stream, token_ids=token_ids, **meta)
        while True:
            item = items.get()
            if item is None:
                break
            direction, t, rank, client, frames = item
            (writer.input if direction == "in" else writer.output)(t, rank, client, frames)
            if items.empty():
                writer.flush()


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="gmock-engine record", description="Record tap between a frontend and engine cores (docs/record.md).")
    parser.add_argument("--handshake-address", required=True, help="the frontend's handshake ROUTER (as for an engine)")
    parser.add_argument("--engine-handshake-address", required=True, help="the handshake ROUTER the tap binds for the engines")
    parser.add_argument("--engine-count", "--data-parallel-size-local", type=int, default=1, dest="engine_count", help="engines behind the tap")
    parser.add_argument("--data-parallel-start-rank", type=int, default=0, help="rank of the first engine")
    parser.add_argument("--advertise-host", help="host the engines reach the tap's data sockets at (default: the engine handshake host)")
    parser.add_argument("-o", "--output", default="trace.jsonl", help="trace file (JSON lines, docs/record.md)")
    parser.add_argument("--record-token-ids", action="store_true", help="also record prompt and output token ids")
    args = parser.parse_args(argv)
    for name in ("handshake_address", "engine_handshake_address"):
        value = getattr(args, name)
        if not value.startswith(("tcp://", "ipc://")):
            parser.error(f"--{name.replace('_', '-')} must be tcp://host:port or ipc://path, got {value!r}")
    if args.engine_count < 1:
        parser.error("--engine-count must be at least 1")
    return args


def main(argv: Sequence[str]) -> int:
    """Run the tap until SIGTERM/SIGINT; the trace is complete when it exits."""
    args = parse_args(argv)
    logging.basicConfig(level=os.environ.get("GMOCK_LOG_LEVEL", "INFO").upper(), format="%(asctime)s record %(levelname)s %(message)s")
    ranks = list(range(args.data_parallel_start_rank, args.data_parallel_start_rank + args.engine_count))
    items: "queue.Queue[Any]" = queue.Queue()
    meta = {"created": time.time(), "ranks": ranks, "frontend_handshake": args.handshake_address, "clock": "time.time"}
    writer = threading.Thread(target=write_trace, args=(args.output, items, meta, args.record_token_ids), name="trace-writer")
    writer.start()
    tap = Tap(args.handshake_address, args.engine_handshake_address, ranks, items, args.advertise_host)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: tap.stop())
    log.info("tap: engines %s on %s, frontend %s, trace %s", ranks, args.engine_handshake_address, args.handshake_address, args.output)
    try:
        tap.run()
    finally:
        tap.close()
        items.put(None)
        writer.join()
    log.info("trace written to %s", args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
