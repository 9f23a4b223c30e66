"""The KV-event publisher: one engine's PUB and replay ROUTER, and their greenlets.

docs/protocol.md Appendix D; vLLM: `ZmqEventPublisher` in
`vllm/distributed/kv_events.py`. The config and the wire form it sends are
kv/events.py's (pure); this module owns the sockets:

* `KVEventPublisher`: one ZMQ PUB and, when `replay_endpoint` is set, one
  ROUTER per engine (DP rank), each owned by one supervised greenlet. The
  stepper only puts a step's events on a bounded gevent queue
  (`put_nowait`: a full queue drops the batch and counts it, so the step
  never waits); the publisher greenlet numbers, encodes, sends and buffers
  each batch (a PUB drops at its HWM, as vLLM's); the replay greenlet
  answers `[id, "", start_seq]` with the buffered batches from start_seq
  and the end marker. A malformed replay request is logged rate-limited
  and ignored.

Event-plane faults (`--fault-kv-*`, faults/specs.py) act in the publisher: a batch
dropped (its seq skipped on the PUB, kept for replay), sent twice, sent after
the next one, the sequence restarted from 0 with an empty replay buffer (an
engine restart as a router sees it), the replay socket stalled, a storm of
`AllBlocksCleared` batches.

Disabled (the default) nothing here is built: the KV manager keeps no
events, the stepper checks one `None`.
"""

from __future__ import annotations

import collections
import dataclasses
import socket
import time
from collections import Counter
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple, Union

import gevent
import gevent.queue
import msgpack
import zmq.green as zmq

from gmock_engine.kv.events import CLEARED, END_SEQ, EventFormat, KVEventsConfig, batch_payload, encode_events, seq_bytes
from gmock_engine.runtime.transport import patient, publish_noblock

#: The publisher and the replay loop yield to the hub after this many
#: messages, so a long replay or a backlog never starves the stepper.
YIELD_EVERY = 64
#: Bounded shutdown: what is still queued gets this long to go out.
FLUSH_TIMEOUT_S = 0.2
#: Rate-limited warnings about replay requests (logs.Throttle kind).
BAD_REPLAY = "bad replay request"

_STOP = object()


class BindError(Exception):
    """An endpoint of --kv-events-config could not be bound (the entry point
    exits 2 naming the option)."""


def _binds(endpoint: str) -> bool:
    """vLLM's _is_bind_endpoint: wildcards and ipc/inproc bind, the rest connect."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KVEventPublisher:
    """One engine's KV-event sockets and their two greenlets (see the module
    docstring). `bind` (at start: a taken port stops the program there),
    then `start` with the supervisor's spawn; `put` from the stepper;
    `close` at shutdown (bounded)."""

    def __init__(
        self,
        ctx: Any,
        config: KVEventsConfig,
        rank: int,
        block_size: int,
        log: Any,
        throttle: Any,
        faults: Callable[[], Any] = lambda: None,
        fmt: Union[EventFormat, Callable[[], EventFormat]] = EventFormat(),
    ) -> None:
        self.ctx = ctx
        #: This rank's config; `bind` puts the endpoints as bound into it.
        self.config = config.for_rank(rank)
        self.rank = rank
        self.block_size = block_size
        #: The format, or what gives it: the era may be detected after start (wire.eras.Wire).
        self._fmt = fmt
        self.log = log
        self.throttle = throttle
        #: The engine's current faults.Faults (a reload may replace it).
        self._faults = faults
        self.topic = self.config.topic.encode("utf-8")
        self.queue: gevent.queue.Queue = gevent.queue.Queue(self.config.max_queue_size)
        #: (seq, payload) of the last buffer_steps batches, for replay
        self.buffer: Deque[Tuple[int, bytes]] = collections.deque(maxlen=self.config.buffer_steps)
        self._next_seq = 0
        #: a batch held back by kv-reorder-batches: sent after the next one
        self._held: Optional[Tuple[int, bytes]] = None
        self._replay_stalled_until = 0.0
        #: batches, events, dropped_queue_full, replay_requests, replayed_batches, bad_replay_requests
        self.counters: Counter = Counter()
        self.pub: Optional[Any] = None
        self.replay: Optional[Any] = None
        self.greenlets: List[gevent.Greenlet] = []

    # -- sockets ---------------------------------------------------------------


    @property
    def fmt(self) -> EventFormat:
        """The event format now (the frontend's era, docs/protocol.md Appendix D)."""
        return self._fmt if isinstance(self._fmt, EventFormat) else self._fmt()

    def bind(self) -> None:
        """Create and bind (or connect) the PUB and the replay ROUTER; raise
        BindError naming the endpoint."""
        c = self.config
        pub = self.ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.SNDHWM, c.hwm)
        pub.setsockopt(zmq.LINGER, 0)
        self.pub = pub
        endpoint = self._attach(pub, c.endpoint, _binds(c.endpoint))
        replay_endpoint = None
        if c.replay_endpoint is not None:
            router = patient(self.ctx.socket(zmq.ROUTER))  # idle for ever between replays
            router.setsockopt(zmq.LINGER, 0)
            self.replay = router
            replay_endpoint = self._attach(router, c.replay_endpoint, True)
        self.config = dataclasses.replace(c, endpoint=endpoint, replay_endpoint=replay_endpoint)

    def _attach(self, sock: Any, endpoint: str, bind: bool) -> str:
        try:
            if not bind:
                sock.connect(endpoint)
                return endpoint
            sock.bind(endpoint)
        except zmq.ZMQError as exc:
            self.close_sockets()
            raise BindError(f"engine {self.rank}: cannot {'bind' if bind else 'connect'} {endpoint}: {exc}") from None
        if endpoint.startswith("tcp://") and endpoint.endswith(":0"):
            # port 0: the OS chose; say which (a wildcard as this host's address)
            bound = sock.getsockopt_string(zmq.LAST_ENDPOINT)
            host, _, port = bound[len("tcp://") :].rpartition(":")
            if host in ("0.0.0.0", "[::]", "::"):
                host = _host_ip()
            return f"tcp://{host}:{port}"
        return endpoint

    def start(self, spawn: Callable[..., gevent.Greenlet]) -> None:
        """Spawn the publisher (and replay) greenlet, supervised."""
        self.greenlets.append(spawn(f"engine-{self.rank}-kv-publisher", self._publish_loop))
        if self.replay is not None:
            self.greenlets.append(spawn(f"engine-{self.rank}-kv-replay", self._replay_loop))

    # -- the stepper's side ------------------------------------------------------

    def put(self, events: List[Tuple[Any, ...]]) -> None:
        """A step's events (nothing to do for none); never waits: a full
        queue drops the batch and counts it."""
        if not events:
            return
        try:
            self.queue.put_nowait((time.time(), events))
        except gevent.queue.Full:
            self.counters["dropped_queue_full"] += 1
            self.throttle.warning("kv events queue full", "KV event queue full ({} batches): a batch was dropped", self.config.max_queue_size)

    # -- the publisher greenlet ----------------------------------------------------

    def _publish_loop(self) -> None:
        """Owns the PUB: number, encode, send and buffer each batch."""
        packer = msgpack.Packer(use_bin_type=True, autoreset=True)
        get, sent = self.queue.get, 0
        while True:
            item = get()
            if item is _STOP:
                break
            ts, events = item
            payload = packer.pack(batch_payload(ts, encode_events(events, self.block_size, self.fmt), self.rank))
            self.counters["events"] += len(events)
            self._publish(payload, packer)
            sent += 1
            if sent % YIELD_EVERY == 0:
                gevent.sleep(0)

    def _publish(self, payload: bytes, packer: Any) -> None:
        """One batch: the next seq, the buffer, the PUB; event-plane faults here."""
        faults = self._faults()
        fired = faults.on_kv_batch(time.monotonic()) if faults else ()
        for spec in fired:
            if spec.kind == "kv-reset-seq":
                self.log.warning("injected fault kv-reset-seq: the KV event sequence restarts at 0, replay buffer emptied")
                self._next_seq = 0
                self.buffer.clear()
                self._held = None
        seq = self._next_seq
        self._next_seq += 1
        self.buffer.append((seq, payload))
        self.counters["batches"] += 1
        kinds = {spec.kind for spec in fired}
        if "kv-stall-replay" in kinds:
            spec = next(s for s in fired if s.kind == "kv-stall-replay")
            self.log.warning("injected fault kv-stall-replay: replay requests wait {:g} s", spec.duration)
            self._replay_stalled_until = time.monotonic() + (spec.duration or 0.0)
        if "kv-drop-batch" in kinds:
            self.log.warning("injected fault kv-drop-batch: seq {} not published (kept for replay)", seq)
        elif "kv-reorder-batches" in kinds and self._held is None:
            self.log.warning("injected fault kv-reorder-batches: seq {} goes out after seq {}", seq, seq + 1)
            self._held = (seq, payload)
            return
        else:
            self._send(seq, payload)
            if "kv-duplicate-batch" in kinds:
                self.log.warning("injected fault kv-duplicate-batch: seq {} published twice", seq)
                self._send(seq, payload)
        if self._held is not None and self._held[0] != seq:
            held, self._held = self._held, None
            self._send(*held)
        for spec in fired:
            if spec.kind == "kv-clear-storm":
                count = spec.count or 1
                self.log.warning("injected fault kv-clear-storm: {} AllBlocksCleared batches", count)
                for _ in range(count):
                    storm = packer.pack(batch_payload(time.time(), encode_events([(CLEARED,)], self.block_size, self.fmt), self.rank))
                    seq = self._next_seq
                    self._next_seq += 1
                    self.buffer.append((seq, storm))
                    self.counters["batches"] += 1
                    self.counters["events"] += 1
                    self._send(seq, storm)

    def _send(self, seq: int, payload: bytes) -> None:
        # A PUB never blocks: at its HWM (or with no subscriber) ZMQ drops, as vLLM's.
        publish_noblock(self.pub, (self.topic, seq_bytes(seq), payload))

    # -- the replay greenlet -------------------------------------------------------

    def _replay_loop(self) -> None:
        """Owns the ROUTER: `[id, "", start_seq (8 B)]` -> every buffered batch
        with seq >= start_seq, then the end marker (Appendix D)."""
        router = self.replay
        while True:
            frames = router.recv_multipart()  # type: ignore[union-attr]
            stalled = self._replay_stalled_until - time.monotonic()
            if stalled > 0:
                gevent.sleep(stalled)
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                self.counters["bad_replay_requests"] += 1
                self.throttle.warning(
                    BAD_REPLAY, "replay request ignored: expected [identity, \"\", start_seq (8 bytes)], got {} frame(s) {}",
                    len(frames), [len(f) for f in frames],
                )  # fmt: skip
                continue
            self.counters["replay_requests"] += 1
            identity, start = frames[0], int.from_bytes(frames[2], "big")
            head = (identity, b"", self.topic) if self.fmt.replay_topic else (identity, b"")
            sent = 0
            # a copy: the publisher may append (and the deque drop) meanwhile
            for seq, payload in list(self.buffer):
                if seq >= start:
                    router.send_multipart((*head, seq_bytes(seq), payload), flags=zmq.NOBLOCK)  # type: ignore[union-attr]
                    sent += 1
                    if sent % YIELD_EVERY == 0:
                        gevent.sleep(0)
            self.counters["replayed_batches"] += sent
            end = (identity, b"", b"", END_SEQ, b"") if self.fmt.replay_topic else (identity, b"", END_SEQ, b"")
            router.send_multipart(end, flags=zmq.NOBLOCK)  # type: ignore[union-attr]

    # -- shutdown --------------------------------------------------------------------

    def close(self) -> None:
        """Let what is queued go out (bounded), end the greenlets, close the sockets."""
        publisher = self.greenlets[0] if self.greenlets else None
        if publisher is not None and not publisher.dead:
            try:
                self.queue.put(_STOP, timeout=FLUSH_TIMEOUT_S)
            except gevent.queue.Full:
                pass
            publisher.join(timeout=FLUSH_TIMEOUT_S)
        gevent.killall([g for g in self.greenlets if not g.dead], block=True, timeout=FLUSH_TIMEOUT_S)
        self.close_sockets()

    def close_sockets(self) -> None:
        for sock in (self.pub, self.replay):
            if sock is not None and not sock.closed:
                sock.close(linger=0)

    def summary(self) -> Dict[str, int]:
        """Counters as `kv_events_<name>` (gmock_stats, the summary line)."""
        return {f"kv_events_{k}": v for k, v in sorted(self.counters.items())}


def _host_ip() -> str:
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"
