"""wire_rules' groundwork: the integer limits of the frontends' types, the
type predicates both decoders share (msgspec and serde both refuse a bool for
an int) and the collector of one message's problems. The rules and where they
come from: wire_rules.py. § sections: docs/protocol.md."""

from __future__ import annotations

import math
from typing import Any, List

from gmock_engine.wire.eras import WireLayout

U8_MAX = 2**8 - 1
U32_MAX = 2**32 - 1
U64_MAX = 2**64 - 1
I64_MIN = -(2**63)
I64_MAX = 2**63 - 1


# --------------------------------------------------------------------------
# small type predicates (msgspec and serde both refuse a bool for an int)
# --------------------------------------------------------------------------


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _fits(value: Any, low: int, high: int) -> bool:
    return _is_int(value) and low <= value <= high


def _is_float(value: Any) -> bool:
    return isinstance(value, float)


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class _Checker:
    """Collects problems for one message."""

    def __init__(self, layout: WireLayout) -> None:
        self.layout = layout
        self.problems: List[str] = []

    def add(self, rule: str, where: str, detail: str) -> None:
        self.problems.append(f"[{rule}] {where}: {detail}")

    # -- scalars -----------------------------------------------------------------

    def uint(self, rule: str, where: str, value: Any, high: int, rust_type: str) -> bool:
        if not _is_int(value):
            self.add(rule, where, f"{_short(value)} is not an int (vllm-rs {rust_type})")
            return False
        if not 0 <= value <= high:
            self.add(rule, where, f"{_short(value)} does not fit {rust_type} (vllm-rs decodes it as {rust_type})")
            return False
        return True

    def float_(self, rule: str, where: str, value: Any) -> bool:
        if not _is_float(value):
            self.add(rule, where, f"{_short(value)} is not a float (f64 / float; docs/protocol.md §0: floats, not ints)")
            return False
        if not math.isfinite(value):
            self.add(rule, where, f"{value!r} is not finite (one monotonic engine clock, docs/protocol.md §4.2)")
            return False
        return True

    def string(self, rule: str, where: str, value: Any) -> bool:
        if not isinstance(value, str):
            self.add(rule, where, f"{_short(value)} is not a string")
            return False
        return True
