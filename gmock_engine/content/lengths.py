"""Output lengths: when a request would end by EOS if nothing else stopped it.

Pure. `OutputLengths.parse("uniform:16:256")` from `--output-len-dist`, or
`OutputLengths.eos(p)` from `--eos-probability`; `draw(rng)` gives the
number of tokens a request generates before its EOS (>= 1). Either models a
model's EOS, so a request with `ignore_eos` does not use it.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Optional, Tuple

KINDS = ("fixed", "uniform", "normal", "exponential")


@dataclass(frozen=True)
class OutputLengths:
    """A distribution of output lengths (tokens until EOS)."""

    kind: str
    params: Tuple[float, ...]

    @classmethod
    def parse(cls, spec: str) -> "OutputLengths":
        """fixed:N | uniform:MIN:MAX | normal:MEAN:STD | exponential:MEAN.

        Raises ValueError with a sentence that says what is wrong.
        """
        kind, _, rest = spec.strip().partition(":")
        arity = {"fixed": 1, "uniform": 2, "normal": 2, "exponential": 1}
        if kind not in arity:
            raise ValueError(f"{spec!r}: the kind must be one of {', '.join(KINDS)}")
        try:
            params = tuple(float(p) for p in rest.split(":")) if rest else ()
        except ValueError:
            raise ValueError(f"{spec!r}: parameters must be numbers") from None
        if len(params) != arity[kind]:
            raise ValueError(f"{spec!r}: {kind} takes {arity[kind]} parameter(s), e.g. {_EXAMPLES[kind]}")
        if any(p < 0 or math.isnan(p) for p in params) or (kind in ("fixed", "exponential") and params[0] < 1):
            raise ValueError(f"{spec!r}: parameters must be positive (lengths >= 1)")
        if kind == "uniform" and params[0] > params[1]:
            raise ValueError(f"{spec!r}: uniform MIN is larger than MAX")
        return cls(kind, params)

    @classmethod
    def eos(cls, probability: float) -> "OutputLengths":
        """Each token is EOS with this probability (a geometric length)."""
        return cls("eos", (probability,))

    def draw(self, rng: random.Random) -> int:
        """One length, at least 1 token."""
        kind, p = self.kind, self.params
        if kind == "fixed":
            value = p[0]
        elif kind == "uniform":
            value = rng.uniform(p[0], p[1])
        elif kind == "normal":
            value = rng.gauss(p[0], p[1])
        elif kind == "exponential":
            value = rng.expovariate(1.0 / p[0])
        else:  # eos: number of tokens up to and including the first EOS
            if p[0] >= 1.0:
                return 1
            value = math.floor(math.log(1.0 - rng.random()) / math.log(1.0 - p[0])) + 1
        return max(1, int(round(value)))


_EXAMPLES = {"fixed": "fixed:128", "uniform": "uniform:16:256", "normal": "normal:200:50", "exponential": "exponential:150"}


def from_config(output_len_dist: Optional[str], eos_probability: float) -> Optional[OutputLengths]:
    """The configured length model, or None (requests end by length only)."""
    if output_len_dist:
        return OutputLengths.parse(output_len_dist)
    if eos_probability > 0:
        return OutputLengths.eos(eos_probability)
    return None
