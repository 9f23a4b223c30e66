"""KV-cache events for cache-aware routers: the config and the wire form (pure).

docs/protocol.md Appendix D; vLLM: `vllm/distributed/kv_events.py`,
`vllm/config/kv_events.py`. What is cached, stored and evicted is decided by
the KV manager (core/prefix_cache.py), which records plain event tuples; the
engine takes them once per step and the runtime hands them to the publisher
(runtime/kv_publisher.py: the sockets and their greenlets). This module is
what both need and nothing that runs: it imports no gevent and no zmq, so
the reference emitter (benchmarks/reference_emitter.py, the floor of the
benchmarks) shares it too.

* `KVEventsConfig`: vLLM's `--kv-events-config` JSON, checked key by key
  (`parse_config`), with the per-rank endpoints (`for_rank`: vLLM's
  `offset_endpoint_port`) and the map the ready response carries (§2.5
  `kv_events_config`, which both frontends expose as `/kv_event_sources`).
* the wire form (`encode_events`, `batch_payload`, `seq_bytes`): since vLLM
  0.24 each event is a msgpack map tagged by `"type"`; before, a tagged
  array with trailing defaults omitted (msgspec `array_like` +
  `omit_defaults`). Replay replies carry the topic since 0.26. Both are
  switches of `EventFormat`, which the wire layout of the frontend's
  version sets.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple


#: The tags of the prefix cache's event tuples: vLLM's event names, which this
#: module encodes as its BlockStored, BlockRemoved and AllBlocksCleared.
STORED, REMOVED, CLEARED = "BlockStored", "BlockRemoved", "AllBlocksCleared"
#: The replay end marker's seq: -1 as 8 signed big-endian bytes (vLLM's END_SEQ).
END_SEQ = (-1).to_bytes(8, "big", signed=True)
#: vLLM's MEDIUM_GPU: where the blocks live.
MEDIUM_GPU = "GPU"


# -- configuration (vLLM's KVEventsConfig) -------------------------------------


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's KVEventsConfig (0.32 fields, same defaults); prints as JSON."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: Optional[str] = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __str__(self) -> str:  # --print-config and all-options.ini show the JSON
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))

    @property
    def enabled(self) -> bool:
        """Events are published (vLLM: enabled and the zmq publisher)."""
        return self.enable_kv_cache_events and self.publisher == "zmq"

    def for_rank(self, rank: int) -> "KVEventsConfig":
        """This config with the endpoints of DP rank `rank` (vLLM offsets the
        tcp port by the rank, appends `_dp<rank>` to inproc, leaves port 0)."""
        return dataclasses.replace(
            self, endpoint=offset_endpoint(self.endpoint, rank), replay_endpoint=offset_endpoint(self.replay_endpoint, rank)
        )

    def ready_map(self) -> Dict[str, Any]:
        """The ready response's `kv_events_config` (§2.5): vLLM's publisher
        config with the endpoints as bound."""
        return dataclasses.asdict(self)


_FIELDS = {f.name: f for f in dataclasses.fields(KVEventsConfig)}
_ENDPOINT_RE = re.compile(r"^(tcp://(\[[0-9A-Fa-f:.*]+\]|[A-Za-z0-9_.*-]+):(\d{1,5})|ipc://.+|inproc://.+)$")


def _check_endpoint(key: str, value: Any, optional: bool) -> Optional[str]:
    if value is None and optional:
        return None
    if not isinstance(value, str) or not _ENDPOINT_RE.match(value):
        raise ValueError(f"{key}: {value!r} is not tcp://host:port, ipc://path or inproc://name")
    if value.startswith("tcp://") and int(value.rsplit(":", 1)[1]) > 65535:
        raise ValueError(f"{key}: {value!r} has a port above 65535")
    return value


def _check_int(key: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{key}: {value!r} is not an integer")
    if value < low:
        raise ValueError(f"{key}: {value} is less than {low}")
    return value


def parse_config(text: str) -> KVEventsConfig:
    """vLLM's --kv-events-config JSON -> KVEventsConfig; ValueError names the
    key (an unknown key, a wrong type, a bad endpoint)."""
    try:
        raw = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"not JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ValueError("not a JSON object like {\"enable_kv_cache_events\": true, \"endpoint\": \"tcp://*:5557\"}")
    for key in raw:
        if key not in _FIELDS:
            raise ValueError(f"unknown key {key!r}; known: {', '.join(_FIELDS)}")
    enable = raw.get("enable_kv_cache_events", False)
    if not isinstance(enable, bool):
        raise ValueError(f"enable_kv_cache_events: {enable!r} is not true or false")
    publisher = raw.get("publisher", "zmq" if enable else "null")  # vLLM's __post_init__
    if publisher not in ("null", "zmq"):
        raise ValueError(f"publisher: {publisher!r} is not \"zmq\" or \"null\"")
    if publisher == "zmq" and not enable:
        raise ValueError("publisher: \"zmq\" with enable_kv_cache_events false publishes nothing; set it true")
    topic = raw.get("topic", "")
    if not isinstance(topic, str):
        raise ValueError(f"topic: {topic!r} is not a string")
    return KVEventsConfig(
        enable_kv_cache_events=enable,
        publisher=publisher,
        endpoint=_check_endpoint("endpoint", raw.get("endpoint", "tcp://*:5557"), False),  # type: ignore[arg-type]
        replay_endpoint=_check_endpoint("replay_endpoint", raw.get("replay_endpoint"), True),
        buffer_steps=_check_int("buffer_steps", raw.get("buffer_steps", 10_000), 1),
        hwm=_check_int("hwm", raw.get("hwm", 100_000), 0),
        max_queue_size=_check_int("max_queue_size", raw.get("max_queue_size", 100_000), 1),
        topic=topic,
    )


def offset_endpoint(endpoint: Optional[str], rank: int) -> Optional[str]:
    """vLLM's ZmqEventPublisher.offset_endpoint_port."""
    if not endpoint or rank == 0:
        return endpoint
    if "inproc" in endpoint:
        return f"{endpoint}_dp{rank}"
    if "tcp" in endpoint:
        base, _, port = endpoint.rpartition(":")
        return endpoint if int(port) == 0 else f"{base}:{int(port) + rank}"
    return endpoint  # ipc: vLLM raises; the mock keeps one path per rank impossible to share, so say so at bind


# -- the wire form (pure) ------------------------------------------------------


@dataclass(frozen=True)
class EventFormat:
    """How the frontend's vLLM version encodes events (Appendix D).

    `tagged_maps`: each event a map with `"type"` (vLLM >= 0.24), else a
    tagged array. `replay_topic`: replay replies carry the topic (>= 0.26).
    `group_idx`: BlockStored/BlockRemoved carry group_idx 0 (vLLM >= 0.21
    sets it; older structs have no such field)."""

    tagged_maps: bool = True
    replay_topic: bool = True
    group_idx: bool = True

    @classmethod
    def of(cls, layout: Any) -> "EventFormat":
        """The format of a wire.eras.WireLayout's era."""
        return cls(layout.kv_events_tagged_maps, layout.kv_events_replay_topic, layout.kv_events_group_idx)


def encode_events(events: Sequence[Tuple[Any, ...]], block_size: int, fmt: EventFormat) -> List[Any]:
    """prefix_cache.py's event tuples as vLLM's msgspec structs encode them
    (omit_defaults: lora_id/lora_name/parent are always there, maybe nil;
    extra_keys, a request's blocks with image placeholders, only when set)."""
    out: List[Any] = []
    for event in events:
        tag = event[0]
        if tag == STORED:
            _, hashes, parent, token_ids = event[:4]
            lora_id, lora_name = (event[4], event[5]) if len(event) > 5 else (None, None)
            extra_keys = event[6] if len(event) > 6 else None
            out.append(block_stored(hashes, parent, token_ids, block_size, fmt, lora_id, lora_name, extra_keys))
        elif tag == REMOVED:
            out.append(block_removed(event[1], fmt))
        elif tag == CLEARED:
            out.append({"type": CLEARED} if fmt.tagged_maps else [CLEARED])
        else:
            raise ValueError(f"not a KV event: {event!r}")
    return out


def block_stored(
    hashes: List[int], parent: Optional[int], token_ids: List[int], block_size: int, fmt: EventFormat,
    lora_id: Optional[int] = None, lora_name: Optional[str] = None, extra_keys: Optional[List[Any]] = None,
) -> Any:
    """One BlockStored as `fmt`'s vLLM encodes it (the floor, reference_emitter.py, makes its events with it too).
    `extra_keys`: one entry per block, (identifier, offset) pairs of the images in it or None; eras
    before group_idx get none (their struct is not read here)."""
    if fmt.tagged_maps:
        item: Any = {
            "type": STORED,
            "block_hashes": hashes,
            "parent_block_hash": parent,
            "token_ids": token_ids,
            "block_size": block_size,
            "lora_id": lora_id,
            "medium": MEDIUM_GPU,
            "lora_name": lora_name,
        }
        if extra_keys is not None and fmt.group_idx:
            item["extra_keys"] = [None if keys is None else [list(pair) for pair in keys] for keys in extra_keys]
        if fmt.group_idx:
            item["group_idx"] = 0
        return item
    item = [STORED, hashes, parent, token_ids, block_size, lora_id, MEDIUM_GPU, lora_name]
    if fmt.group_idx:
        keys = None if extra_keys is None else [None if k is None else [list(pair) for pair in k] for k in extra_keys]
        item += [keys, 0]  # extra_keys (default, but not trailing), group_idx
    return item


def block_removed(hashes: List[int], fmt: EventFormat) -> Any:
    """One BlockRemoved as `fmt`'s vLLM encodes it."""
    if fmt.tagged_maps:
        item: Any = {"type": REMOVED, "block_hashes": hashes, "medium": MEDIUM_GPU}
        if fmt.group_idx:
            item["group_idx"] = 0
        return item
    return [REMOVED, hashes, MEDIUM_GPU] + ([0] if fmt.group_idx else [])


def batch_payload(ts: float, encoded: List[Any], data_parallel_rank: int) -> List[Any]:
    """KVEventBatch (array_like): [ts (float64), events, data_parallel_rank]."""
    return [float(ts), encoded, data_parallel_rank]


def seq_bytes(seq: int) -> bytes:
    """A batch's seq on the wire: 8 bytes big-endian."""
    return seq.to_bytes(8, "big")
