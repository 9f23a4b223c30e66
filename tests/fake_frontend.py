"""A fake vLLM frontend for tests: the frontend's side of docs/protocol.md §1-2.

It binds what a real frontend binds (handshake ROUTER, one input ROUTER and
one output PULL per client, optionally the coordinator's XPUB and PULL),
runs the handshake with N engines and then lets a test send ADD / ABORT /
UTILITY frames and read the outputs back, decoded. The frames themselves
come from gmock_engine/tools/frontend.py, the encoder the bench driver uses
too. It uses `zmq.green`, so it shares the gevent hub with an in-process
engine; it works just as well against an engine in another process.

Every wait is bounded (`timeout`, raising gevent.Timeout).
"""

from __future__ import annotations

import itertools
import os
import time
from typing import Any, Dict, List, Optional, Sequence

import gevent
import msgpack
import zmq.green as zmq

from gmock_engine.tools.frontend import REQUEST_INDEX, abort_frames, add_frames, identity, pack, utility_frames
from gmock_engine.tools.frontend import engine_core_request as _engine_core_request

DEFAULT_TIMEOUT = 10.0
#: arrival_time of the observed vllm-rs ADD in docs/protocol.md §3.2: fixed, so a
#: test's frames are the same bytes on every run.
OBSERVED_ARRIVAL_TIME = 1795975013.91


def unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def engine_core_request(
    request_id: str,
    prompt_token_ids: Sequence[int] = (1, 2, 3),
    sampling_params: Optional[Dict[str, Any]] = None,
    client_index: int = 0,
    **fields: Any,
) -> List[Any]:
    """A full 22-element 0.33 EngineCoreRequest, as the frontends send it (§3.2):
    gmock_engine.tools.frontend.engine_core_request with test defaults (prompt
    [1, 2, 3], sampling {"temperature": 1.0}, OBSERVED_ARRIVAL_TIME). Any other
    field by name, e.g. priority=3 or abort_immediately=True."""
    if sampling_params is None:
        sampling_params = {"temperature": 1.0}
    fields.setdefault("arrival_time", OBSERVED_ARRIVAL_TIME)
    return _engine_core_request(request_id, prompt_token_ids, sampling_params, client_index, **fields)


class FakeFrontend:
    """The frontend's sockets and the handshake with `dp` engines."""

    def __init__(
        self,
        num_clients: int = 1,
        dp: int = 1,
        coordinator: bool = False,
        transport: str = "tcp",
        ipc_dir: Optional[str] = None,
        stats_address: Optional[str] = None,
    ) -> None:
        self.ctx = zmq.Context()
        self.dp = dp
        self.num_clients = num_clients
        self._names = itertools.count()
        self.transport = transport
        self.ipc_dir = ipc_dir
        self.stats_address = stats_address
        self.sockets: List[Any] = []
        self.handshake, self.handshake_address = self._bind(zmq.ROUTER)
        self.inputs, self.input_addresses = [], []
        self.outputs, self.output_addresses = [], []
        for _ in range(num_clients):
            sock, address = self._bind(zmq.ROUTER)
            self.inputs.append(sock)
            self.input_addresses.append(address)
            sock, address = self._bind(zmq.PULL)
            self.outputs.append(sock)
            self.output_addresses.append(address)
        self.coord_pub = self.coord_pull = None
        self.coord_addresses = (None, None)
        if coordinator:
            self.coord_pub, pub_address = self._bind(zmq.XPUB)
            # As vLLM's coordinator: see every engine's subscription (§1).
            self.coord_pub.setsockopt(zmq.XPUB_VERBOSE, 1)
            self.coord_pull, pull_address = self._bind(zmq.PULL)
            self.coord_addresses = (pub_address, pull_address)
        self.hellos: Dict[int, Any] = {}
        self.readies: Dict[int, Any] = {}
        self.registrations: Dict[int, List[Any]] = {}
        self._call_ids = itertools.count(1)

    def _bind(self, kind: int):
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        # As vLLM's frontend (§1): unbounded queues. A ROUTER at its high-water
        # mark drops messages silently, which would lose test traffic.
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        if self.transport == "ipc":
            address = f"ipc://{self.ipc_dir}/fe-{os.getpid()}-{next(self._names)}.sock"
            sock.bind(address)
        else:
            port = sock.bind_to_random_port("tcp://127.0.0.1")
            address = f"tcp://127.0.0.1:{port}"
        self.sockets.append(sock)
        return sock, address

    def close(self) -> None:
        for sock in self.sockets:
            sock.close(linger=0)
        self.ctx.term()

    # -- handshake ----------------------------------------------------------

    def init_message(self) -> Dict[str, Any]:
        return {
            "addresses": {
                "inputs": self.input_addresses,
                "outputs": self.output_addresses,
                "coordinator_input": self.coord_addresses[0],
                "coordinator_output": self.coord_addresses[1],
                "frontend_stats_publish_address": self.stats_address,
            },
            "parallel_config": {},
        }

    def accept_engines(
        self,
        ranks: Optional[Sequence[int]] = None,
        timeout: float = DEFAULT_TIMEOUT,
        gate_check: float = 0.0,
    ) -> None:
        """HELLO -> INIT for every engine, the coordinator gate, READYs and
        the registration on every input socket (§2.1).

        With a coordinator and `gate_check` > 0, first assert that no READY
        arrives during that many seconds before the coordinator's READY.
        """
        expected = set(range(self.dp) if ranks is None else ranks)
        gate_open = self.coord_pub is None
        with gevent.Timeout(timeout):
            # Engines run their handshakes independently: HELLOs and READYs
            # interleave (one engine may be READY before another said HELLO).
            while set(self.readies) != expected:
                if not gate_open and set(self.hellos) == expected:
                    self._coordinator_gate(len(expected), gate_check)
                    gate_open = True
                ident, payload = self.handshake.recv_multipart()
                rank = int.from_bytes(ident, "little")
                message = unpack(payload)
                assert rank in expected, f"unexpected engine identity {ident!r}"
                if message["status"] == "HELLO":
                    assert rank not in self.hellos, f"second HELLO from engine {rank}"
                    self.hellos[rank] = message
                    self.handshake.send_multipart([ident, pack(self.init_message())])
                else:
                    assert message["status"] == "READY", message
                    assert rank in self.hellos and rank not in self.readies, f"unexpected READY from engine {rank}"
                    assert gate_open, f"READY from engine {rank} before the coordinator gate"
                    self.readies[rank] = message
            for client, sock in enumerate(self.inputs):
                for _ in expected:
                    frames = sock.recv_multipart()
                    assert len(frames) == 2, f"registration with {len(frames)} frames"
                    rank = int.from_bytes(frames[0], "little")
                    self.registrations.setdefault(rank, []).append(unpack(frames[1]))

    def _coordinator_gate(self, engines: int, gate_check: float) -> None:
        """As vLLM's DPCoordinator: one subscription per engine, then READY (§2.6)."""
        subscriptions = 0
        while subscriptions < engines:
            frame = self.coord_pub.recv()
            assert frame == b"\x01", f"coordinator got {frame!r}, expected a subscription"
            subscriptions += 1
        if gate_check:
            with gevent.Timeout(gate_check, False):
                early = self.handshake.recv_multipart()
                raise AssertionError(f"READY before the coordinator gate: {early!r}")
        self.coord_pub.send(b"READY")

    # -- requests -------------------------------------------------------------

    def send_raw(self, rank: int, client: int, frames: Sequence[bytes]) -> None:
        self.inputs[client].send_multipart([identity(rank), *frames])

    def add(self, rank: int, request_id: str, max_tokens: Optional[int] = None, client: int = 0, **kw: Any) -> None:
        sampling = kw.pop("sampling_params", None)
        if sampling is None:
            sampling = {"temperature": 1.0}
            if max_tokens is not None:
                sampling["max_tokens"] = max_tokens
        request = engine_core_request(request_id, sampling_params=sampling, client_index=client, **kw)
        if sampling == "nil":  # a pooling request: sampling_params nil (§3.2)
            request[REQUEST_INDEX["sampling_params"]] = None
        self.send_raw(rank, client, add_frames(request))

    def abort(self, rank: int, request_ids: Sequence[str], client: int = 0) -> None:
        self.send_raw(rank, client, abort_frames(request_ids))

    def utility(self, rank: int, method: str, args: Sequence[Any] = (), client: int = 0, call_id: Optional[int] = None) -> int:
        call_id = next(self._call_ids) if call_id is None else call_id
        self.send_raw(rank, client, utility_frames(client, call_id, method, args))
        return call_id

    # -- outputs --------------------------------------------------------------

    def recv(self, client: int = 0, timeout: float = DEFAULT_TIMEOUT) -> List[Any]:
        """The next EngineCoreOutputs on this client's PULL, decoded."""
        with gevent.Timeout(timeout):
            frames = self.outputs[client].recv_multipart()
        assert len(frames) == 1, f"output message with {len(frames)} frames"
        return unpack(frames[0])

    def poll_nothing(self, client: int = 0, wait: float = 0.2) -> bool:
        """True if no message arrives on this client within `wait` seconds."""
        try:
            with gevent.Timeout(wait):
                self.outputs[client].recv_multipart()
        except gevent.Timeout:
            return True
        return False

    def utility_result(self, call_id: int, client: int = 0, timeout: float = DEFAULT_TIMEOUT) -> List[Any]:
        """Read messages until the UtilityOutput for call_id; returns it."""
        with gevent.Timeout(timeout):
            while True:
                message = self.recv(client, timeout)
                if len(message) > 4 and message[4] is not None and message[4][0] == call_id:
                    return message[4]

    def collect(
        self, request_ids: Sequence[str], client: int = 0, timeout: float = DEFAULT_TIMEOUT, into: Optional["Collected"] = None
    ) -> "Collected":
        """Read this client's outputs until every id has a terminal output
        (adding to `into` when given)."""
        collected = Collected() if into is None else into
        pending = set(request_ids)
        with gevent.Timeout(timeout):
            while pending:
                message = self.recv(client, timeout)
                collected.add(message)
                pending -= collected.terminal.keys()
        return collected


class Collected:
    """Outputs per request id, read from one client's socket."""

    def __init__(self) -> None:
        self.messages: List[List[Any]] = []
        self.outputs: Dict[str, List[List[Any]]] = {}
        self.terminal: Dict[str, int] = {}
        self.finished_requests: List[str] = []

    def add(self, message: List[Any]) -> None:
        self.messages.append(message)
        for output in message[1]:
            rid = output[0]
            assert rid not in self.terminal, f"output for {rid} after its terminal output"
            self.outputs.setdefault(rid, []).append(output)
            if len(output) > 5 and output[5] is not None:
                self.terminal[rid] = output[5]
        if len(message) > 5 and message[5]:
            self.finished_requests.extend(message[5])

    def tokens(self, rid: str) -> List[int]:
        return [t for output in self.outputs.get(rid, []) for t in output[1]]


#: Field values an era's frontend sends when nothing is asked for (by name).
_ERA_DEFAULTS = {"resumable": False, "abort_immediately": False, "client_index": 0, "current_wave": 0, "priority": 0}


def era_request(layout: Any, request_id: str = "r", prompt: Sequence[int] = (1, 2, 3),
                sampling: Optional[Dict[str, Any]] = None, **fields: Any) -> List[Any]:
    """A full EngineCoreRequest array in `layout` (a wire.eras.WireLayout), as
    that era's Python frontend sends it (docs/protocol.md §8.1): its fields by name,
    sampling {"max_tokens": 4} unless given, arrival now, nil for the rest."""
    values = {**_ERA_DEFAULTS, "request_id": request_id, "prompt_token_ids": list(prompt),
              "sampling_params": {"max_tokens": 4} if sampling is None else sampling,
              "arrival_time": time.time(), **fields}
    return [values.get(name) for name in layout.request_fields]
