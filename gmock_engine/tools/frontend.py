"""The frontend's side of the input socket, pure: what a vLLM frontend sends
an engine (docs/protocol.md §3).

The one encoder for everything here that plays the frontend: the bench
driver (tools/bench.py) and the tests' fake frontend (tests/fake_frontend.py).
It is written from docs/protocol.md, not from gmock_engine/wire/, so that
the engine's decoder is tested against a second reading of the protocol, not
against itself. No sockets: the frame functions return what follows the
engine's identity frame on the frontend's input ROUTER (§3.1).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

import msgpack

#: Request type bytes, frame 0 after the identity (§3.1).
ADD = b"\x00"
ABORT = b"\x01"
UTILITY = b"\x03"

#: EngineCoreRequest fields in wire order: the 0.21+ layout, 22 elements in
#: 0.32-0.33 (§3.2). Python frontends always send the full array, and so does
#: vllm-rs 0.33.
ENGINE_CORE_REQUEST_FIELDS = (
    "request_id",
    "prompt_token_ids",
    "mm_features",
    "sampling_params",
    "pooling_params",
    "arrival_time",
    "lora_request",
    "cache_salt",
    "data_parallel_rank",
    "prompt_embeds",
    "prompt_is_token_ids",
    "client_index",
    "current_wave",
    "priority",
    "trace_headers",
    "resumable",
    "external_req_id",
    "reasoning_ended",
    "reasoning_parser_kwargs",
    "abort_immediately",
    "session_id",
    "kv_hints",
)
#: Field name -> position in the array.
REQUEST_INDEX: Dict[str, int] = {name: i for i, name in enumerate(ENGINE_CORE_REQUEST_FIELDS)}

#: The struct's defaults that are not nil (§3.2); every other field is nil
#: unless given.
_DEFAULTS: Mapping[str, Any] = {
    "client_index": 0,
    "current_wave": 0,
    "priority": 0,
    "resumable": False,
    "abort_immediately": False,
}

Pack = Callable[[Any], bytes]


def pack(obj: Any) -> bytes:
    """msgpack with bin types, as msgspec writes it; a new packer per call, so
    it is safe from any thread (a driver passes its own Packer().pack)."""
    return msgpack.packb(obj, use_bin_type=True)


def identity(rank: int) -> bytes:
    """An engine's ZMQ identity: its DP rank, 2 bytes little-endian (§2); the
    frontend's input ROUTER routes a request to an engine by it."""
    return rank.to_bytes(2, "little")


def external_req_id(request_id: str) -> str:
    """The user-visible id in a request id: both frontends send
    `<user id>-<8 random hex>` as the request id (§3.2)."""
    return request_id.rsplit("-", 1)[0]


def engine_core_request(
    request_id: str,
    prompt_token_ids: Optional[Sequence[int]],
    sampling_params: Optional[Dict[str, Any]],
    client_index: int = 0,
    **fields: Any,
) -> List[Any]:
    """A full 22-element EngineCoreRequest, as the frontends send it (§3.2).

    `sampling_params` None is sent as nil (a pooling request). Every other
    field can be given by its name (`priority=3`, `abort_immediately=True`);
    unless given, `arrival_time` is now (wall clock, as the frontends stamp
    it), `external_req_id` is taken from the request id, and the rest take
    the struct's defaults (nil when it has none).
    """
    request: List[Any] = [None] * len(ENGINE_CORE_REQUEST_FIELDS)
    for name, value in _DEFAULTS.items():
        request[REQUEST_INDEX[name]] = value
    request[REQUEST_INDEX["request_id"]] = request_id
    request[REQUEST_INDEX["prompt_token_ids"]] = None if prompt_token_ids is None else list(prompt_token_ids)
    request[REQUEST_INDEX["sampling_params"]] = sampling_params
    request[REQUEST_INDEX["client_index"]] = client_index
    request[REQUEST_INDEX["arrival_time"]] = time.time()
    request[REQUEST_INDEX["external_req_id"]] = external_req_id(request_id)
    for name, value in fields.items():
        position = REQUEST_INDEX.get(name)
        if position is None:
            raise TypeError(f"EngineCoreRequest has no field {name!r}")
        request[position] = value
    return request


class RequestTemplate:
    """Many alike requests, cheaply: the array built once by
    engine_core_request, then per request a shallow copy with its own
    request id, external id and arrival time (the bench driver's ADDs).
    The prompt and sampling params are shared by every copy: never mutate
    them."""

    _REQUEST_ID = REQUEST_INDEX["request_id"]
    _ARRIVAL_TIME = REQUEST_INDEX["arrival_time"]
    _EXTERNAL_REQ_ID = REQUEST_INDEX["external_req_id"]

    def __init__(
        self,
        prompt_token_ids: Optional[Sequence[int]],
        sampling_params: Optional[Dict[str, Any]],
        client_index: int = 0,
        **fields: Any,
    ) -> None:
        self._array = engine_core_request("", prompt_token_ids, sampling_params, client_index, **fields)

    def request(self, request_id: str, arrival_time: Optional[float] = None) -> List[Any]:
        """The template's request under this id, arriving now (or at arrival_time)."""
        request = self._array.copy()
        request[self._REQUEST_ID] = request_id
        request[self._ARRIVAL_TIME] = time.time() if arrival_time is None else arrival_time
        request[self._EXTERNAL_REQ_ID] = external_req_id(request_id)
        return request


def add_frames(request: List[Any], pack: Pack = pack) -> List[bytes]:
    """ADD: [type, EngineCoreRequest] (§3.2)."""
    return [ADD, pack(request)]


def abort_frames(request_ids: Sequence[str], pack: Pack = pack) -> List[bytes]:
    """ABORT: [type, array of request ids] (§3.4)."""
    return [ABORT, pack(list(request_ids))]


def utility_frames(client_index: int, call_id: int, method: str, args: Sequence[Any] = (), pack: Pack = pack) -> List[bytes]:
    """UTILITY: [type, [client_index, call_id, method_name, args]] (§3.5); the
    reply comes back on output socket `client_index`."""
    return [UTILITY, pack([client_index, call_id, method, list(args)])]
