"""The engine's multimodal caches [`multimodal/cache/base.py`,
`v1/core/encoder_cache_manager.py`] (docs/multimodal.md).

The receiver cache mirrors the frontend's processor cache: the frontend
sends an item's tensors the first time and strips them (data nil) while it
believes the engine still holds them; the engine serves such an item from
its own cache by `mm_hash` (else `identifier`), as vLLM's
`LruKeyReplicatedReceiverCache` does, an LRU of the same size
(`--mm-processor-cache-gb`, vLLM's default 4 GiB). An item the engine lacks
(the caches drifted: another size, a reset, another engine) is a miss: the
request ends with ERROR and the missing hashes (`mm_cache_miss_hashes`,
0.28+), which the frontend drops from its cache so the client's retry
resends the data. The mock keeps only each item's key and size, not its
tensors.

The encoder cache holds encoder outputs by `identifier`, sized in encoder
tokens: an item whose output is cached costs no encoder time again.

Pure: no zmq, no gevent.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, List

from gmock_engine.wire.mm_features import MultiModalFeature


class ReceiverCache:
    """The engine's side of the processor cache: key -> item bytes, least
    recently used first, at most `capacity` bytes."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.size = 0
        self.items: "OrderedDict[str, int]" = OrderedDict()
        self.hits = 0
        self.misses = 0

    def receive(self, features: Iterable[MultiModalFeature]) -> List[str]:
        """Store the items that came with data, serve the stripped ones from
        the cache; return the keys of stripped items it does not hold (empty:
        the request can run). Every key is touched first, so that storing one
        item never evicts another of the same request (as vLLM does)."""
        features = tuple(features)
        for feature in features:
            if feature.cache_key in self.items:
                self.items.move_to_end(feature.cache_key)
        missing: List[str] = []
        for feature in features:
            key = feature.cache_key
            if feature.data_bytes is None:
                if key in self.items:
                    self.hits += 1
                elif key not in missing:
                    self.misses += 1
                    missing.append(key)
                continue
            self._put(key, feature.data_bytes)
        return missing

    def _put(self, key: str, size: int) -> None:
        old = self.items.pop(key, None)
        if old is not None:
            self.size -= old
        if size > self.capacity:
            return  # larger than the whole cache: not kept
        self.items[key] = size
        self.size += size
        while self.size > self.capacity:
            _, evicted = self.items.popitem(last=False)
            self.size -= evicted

    def clear(self) -> None:
        """reset_mm_cache: forget every item (the frontend clears its own at the same call)."""
        self.items.clear()
        self.size = 0


class EncoderCache:
    """Encoder outputs by identifier, at most `capacity` encoder tokens,
    least recently used evicted first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.size = 0
        self.items: "OrderedDict[str, int]" = OrderedDict()

    def cost(self, features: Iterable[MultiModalFeature]) -> int:
        """The encoder tokens `encode` would charge for these items now."""
        return sum(f.num_embeds for f in features if f.identifier not in self.items)

    def encode(self, features: Iterable[MultiModalFeature]) -> int:
        """The encoder tokens these items cost now: those whose output is not
        cached; they are cached after (each at most `capacity`)."""
        cost = 0
        for feature in features:
            key = feature.identifier
            if key in self.items:
                self.items.move_to_end(key)
                continue
            cost += feature.num_embeds
            if feature.num_embeds <= self.capacity:
                self.items[key] = feature.num_embeds
                self.size += feature.num_embeds
                while self.size > self.capacity:
                    _, evicted = self.items.popitem(last=False)
                    self.size -= evicted
        return cost

    def clear(self) -> None:
        """reset_encoder_cache."""
        self.items.clear()
        self.size = 0
