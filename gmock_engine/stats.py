"""Small measurement helpers shared by the runtime and the bench driver."""

from __future__ import annotations

from collections import deque
from typing import Dict, Iterable, Sequence


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of already sorted values (q in 0..100)."""
    if not sorted_values:
        return 0.0
    rank = max(0, min(len(sorted_values) - 1, int(round(q / 100.0 * len(sorted_values) + 0.5)) - 1))
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
    """The most recent `size` samples of a quantity (bounded memory in soaks)."""

    def __init__(self, size: int = 65536) -> None:
        self._values: deque = deque(maxlen=size)
        self.total = 0

    def add(self, value: float) -> None:
        self._values.append(value)
        self.total += 1

    def summary(self, scale: float = 1.0) -> Dict[str, float]:
        result = summarize(self._values, scale)
        result["total"] = self.total
        return result
