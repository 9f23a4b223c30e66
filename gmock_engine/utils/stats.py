"""Small measurement helpers shared by the runtime and the bench driver."""

from __future__ import annotations

from array import array
import math
from typing import Dict, Iterable, Sequence


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of already sorted values (q in 0..100)."""
    if not sorted_values:
        return 0.0
    # the smallest rank k with k >= q% of n; q * n first, so that whole
    # ranks stay whole (0.07 * 100 is 7.000000000000001, 7 * 100 / 100 is 7.0)
    rank = max(0, min(len(sorted_values) - 1, math.ceil(q * len(sorted_values) / 100.0) - 1))
    return sorted_values[rank]


def summarize(values: Iterable[float], scale: float = 1.0) -> Dict[str, float]:
    """count, p50, p99 and max of values, multiplied by scale."""
    ordered = sorted(values)
    return {
        "count": len(ordered),
        "p50": percentile(ordered, 50) * scale,
        "p99": percentile(ordered, 99) * scale,
        "max": (ordered[-1] if ordered else 0.0) * scale,
    }


class Samples:
    """The most recent `size` samples of a quantity, in a preallocated ring of
    C doubles: constant memory from the start. Kept small on purpose: a
    summary sorts a copy as Python floats, and that transient list sets the
    process's memory high-water mark (65 536 samples cost 2 MB per summary,
    which a soak saw as RSS growth until the ring was full).

    `restart()` starts a new window: the summary covers only what was added
    since (`total` still counts every sample)."""

    def __init__(self, size: int = 4096) -> None:
        self._ring = array("d", bytes(8 * size))
        self._size = size
        self._count = 0  # samples in this window
        self.total = 0

    def add(self, value: float) -> None:
        self._ring[self._count % self._size] = value
        self._count += 1
        self.total += 1

    def restart(self) -> None:
        self._count = 0

    def summary(self, scale: float = 1.0) -> Dict[str, float]:
        result = summarize(self._ring[: min(self._count, self._size)], scale)
        result["total"] = self.total
        return result
