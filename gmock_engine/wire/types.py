"""What every part of the wire shares: the message-type byte, the enums
carried in outputs, the protocol's constants and its two errors (§3.1,
§4.4, §4.5). Pure: no sockets.
"""

from __future__ import annotations

import enum
from typing import Any


class EngineCoreRequestType(bytes, enum.Enum):
    """Type byte in frame 0 of every message on an input socket (§3.1)."""

    ADD = b"\x00"
    ABORT = b"\x01"
    START_DP_WAVE = b"\x02"
    UTILITY = b"\x03"


class FinishReason(enum.IntEnum):
    """`finish_reason` of the last EngineCoreOutput of a request (§4.4)."""

    STOP = 0
    LENGTH = 1
    ABORT = 2
    ERROR = 3
    REPETITION = 4


class EngineCoreEventType(enum.IntEnum):
    """`type` of an EngineCoreEvent map (§4.5)."""

    QUEUED = 1
    SCHEDULED = 2
    PREEMPTED = 3


#: The coordinator's startup/scale-up broadcast (§2.6); ignored after startup.
COORDINATOR_READY = b"READY"
#: Subscribe-to-everything frame an XSUB sends to the coordinator's XPUB (§2.1).
SUBSCRIBE_ALL = b"\x01"
#: Dead-engine sentinel, a single raw frame on every output socket (§4.1).
ENGINE_CORE_DEAD = b"ENGINE_CORE_DEAD"
#: Ext types that carry pickles (§0); refused on decode, never sent.
PICKLE_EXT_TYPES = (1, 2)
#: `max_tokens` when the key is absent from SamplingParams (§3.3).
DEFAULT_MAX_TOKENS = 16


#: Token ids (and an integer stop_reason) the frontends can decode: vllm-rs
#: reads them as u32 (Appendix E; its protocol/output.rs), Python as int.
TOKEN_ID_LIMIT = 1 << 32
#: Output sockets an engine can have: client indexes beyond are nonsense.
MAX_CLIENTS = 1 << 16


def engine_identity(rank: int) -> bytes:
    """ZMQ identity of engine `rank`: 2 bytes little-endian (§1)."""
    return rank.to_bytes(2, "little")


class ProtocolError(ValueError):
    """A frame that does not follow the protocol; the message says why."""


class BadValue(ValueError):
    """A value in a request that the engine cannot accept (wrong type, out
    of range); the message names the key and the value (cut)."""


def is_int(value: Any) -> bool:
    """An int that is not a bool (msgpack gives both; a bool is never an id or a count)."""
    return isinstance(value, int) and not isinstance(value, bool)
