"""A step-time profile: how long a real engine's step takes for what is in it.

Fitted from a recorded trace of a real engine core (`./run.sh fit`,
tools/fit.py; docs/latency-profile.md) and read by the latency model
(latency.py) when `--latency-profile FILE` is given. Pure: the file format,
the prediction and the sampling of the step-to-step spread.

A step's time, in ms, is the sum of

* `step_ms(batch)`: a table over the running batch (the requests in the
  step, decoding or prefilling), linear between its points and extrapolated
  from the last two beyond them: the fixed cost of a step and the per-request
  cost, which is not linear on real hardware;
* `prefill_ms_per_token × prefill tokens` (the prompt tokens computed in
  the step, prefix-cache hits excluded), or, where the profile has one, a
  table over them (`prefill_tokens`, `prefill_ms`: linear in between, from
  0 ms at 0 tokens, extrapolated from the last two points beyond them): on
  a GPU a step of a few hundred prompt tokens costs little more than a
  decode step (both read every weight once) and a long one is bound by its
  arithmetic, which no single price per token gives;
* `prefill_ms_per_request × prefilling requests` (those of the batch that
  compute prompt tokens in the step): what a prompt costs beyond its
  tokens, so that a short prompt is not priced as a slice of a long one;
* `prefill_attention_ms × Σ c·(p + c/2) / 1000` over the prompt chunks of
  the step (c tokens from position p): the attention over the prompt, which
  grows with the square of its length;
* `context_ms_per_ktoken × context tokens / 1000`: the tokens the batch
  holds (prompt and generated tokens of every running request), which every
  decode step's attention reads;

times a factor drawn from the step's spread: the quantiles of measured /
predicted step time of the fit, sampled by inverse transform; for steps
that only decode one set per bin of the batch (`spread_decode_bins`), for
steps that prefill one set per bin of the prompt tokens they compute
(`spread_prefill_bins`; both the bins' upper edges). A real step's
variation is about the same in ms whatever is in it, so a long step varies
less in proportion than a short one: one set fitted mostly on short steps
would give long ones too wide a tail. A step of a size the engine has
not run before (its tokens: prompt tokens computed plus decoding requests;
`StepSizes`) draws its factor from `spread_new_size` instead, and one larger
than any before from `spread_new_max`, or, where the fit found a cost of
about the same ms whatever the step's size, the ms it adds from
`spread_new_size_ms` / `spread_new_max_ms`: a real engine may pay for a new size
once, and most for a new largest one (vLLM's CPU backend builds its matmul
kernels per token count and grows its buffers; on this project's reference
such steps took 1.5 and 3 times their prediction at the median, up to 15;
a GPU warmed up at start has no such cost, and its fit then keeps them with
the others). A request's first
token also waits for the engine's input delay (from its arrival to its
queueing in the engine), drawn from its measured quantiles.

The file is INI (one section, `[latency-profile]`), so an ops team keeps one
per GPU type and model beside their engine config and edits it by hand.
"""

from __future__ import annotations

import configparser
import hashlib
import math
import random
from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Tuple

FORMAT_VERSION = 1
SECTION = "latency-profile"


#: StepSizes.add: a size run before; the first step of a size; a step larger than any before.
STEADY, NEW_SIZE, NEW_MAX = 0, 1, 2


class ProfileError(ValueError):
    """A profile file that cannot be used; the message says which key and why."""


@dataclass(frozen=True)
class StepProfile:
    """A fitted step-time model (see the module docstring); times in ms."""

    batch: Tuple[int, ...]
    step_ms: Tuple[float, ...]
    prefill_ms_per_token: float = 0.0
    prefill_attention_ms: float = 0.0
    context_ms_per_ktoken: float = 0.0
    prefill_ms_per_request: float = 0.0
    #: the prefill tokens' cost as a table instead of prefill_ms_per_token
    #: (none: the price per token): token counts and ms at each
    prefill_tokens: Tuple[int, ...] = ()
    prefill_ms: Tuple[float, ...] = ()
    #: quantiles of measured / predicted at evenly spaced probabilities 0..1
    #: of decode-only steps, one set per bin of the batch (bins: the upper
    #: edges, the last bin open above them; no bins: one set)
    spread_decode: Tuple[Tuple[float, ...], ...] = ()
    spread_decode_bins: Tuple[int, ...] = ()
    #: the same for steps that prefill, per bin of their prefill tokens
    spread_prefill: Tuple[Tuple[float, ...], ...] = ()
    spread_prefill_bins: Tuple[int, ...] = ()
    #: the same for the first step of each size (tokens computed) the engine
    #: runs, and for a step larger than any before it (StepSizes)
    spread_new_size: Tuple[float, ...] = ()
    spread_new_max: Tuple[float, ...] = ()
    #: or, for either, quantiles of the ms such a step takes beyond its
    #: prediction (measured - predicted, may be < 0): a cost of about the
    #: same ms whatever the step's size (one of a key and its _ms twin)
    spread_new_size_ms: Tuple[float, ...] = ()
    spread_new_max_ms: Tuple[float, ...] = ()
    #: quantiles of the engine's input delay, ms: from a request's arrival
    #: to its queueing in the engine, which its first token waits for
    input_delay_ms: Tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if not self.batch or len(self.batch) != len(self.step_ms):
            raise ProfileError("batch and step_ms need the same number of values (at least one)")
        if any(b < 1 for b in self.batch) or any(b >= c for b, c in zip(self.batch, self.batch[1:])):
            raise ProfileError("batch: increasing request counts, each at least 1")
        for name in ("prefill_ms_per_token", "prefill_attention_ms", "prefill_ms_per_request", "context_ms_per_ktoken"):
            if not getattr(self, name) >= 0.0:
                raise ProfileError(f"{name}: must be >= 0")
        if any(not v >= 0.0 for v in self.step_ms):
            raise ProfileError("step_ms: values must be >= 0")
        if len(self.prefill_tokens) != len(self.prefill_ms):
            raise ProfileError("prefill_tokens and prefill_ms need the same number of values")
        if any(t < 1 for t in self.prefill_tokens) or any(a >= b for a, b in zip(self.prefill_tokens, self.prefill_tokens[1:])):
            raise ProfileError("prefill_tokens: increasing token counts, each at least 1")
        if any(not 0.0 <= v < math.inf for v in self.prefill_ms):
            raise ProfileError("prefill_ms: values must be >= 0")
        if self.prefill_tokens and self.prefill_ms_per_token:
            raise ProfileError("prefill_ms_per_token and prefill_tokens/prefill_ms: one or the other (a price per token, or a table)")
        for name in ("spread_new_size", "spread_new_max"):
            if getattr(self, name) and not _quantile_list(getattr(self, name)):
                raise ProfileError(f"{name}: at least two non-decreasing factors >= 0 (or none)")
            added = getattr(self, name + "_ms")
            if added and not _quantile_list(added, low=-math.inf):
                raise ProfileError(f"{name}_ms: at least two non-decreasing numbers, ms (or none)")
            if added and getattr(self, name):
                raise ProfileError(f"{name} and {name}_ms: one or the other (factors of the prediction, or ms added to it)")
        if self.input_delay_ms and not _quantile_list(self.input_delay_ms):
            raise ProfileError("input_delay_ms: at least two non-decreasing values >= 0 (or none)")
        for kind, unit in (("decode", "batch sizes"), ("prefill", "prompt token counts")):
            sets, edges = getattr(self, f"spread_{kind}"), getattr(self, f"spread_{kind}_bins")
            if not all(_quantile_list(values) for values in sets):
                raise ProfileError(f"spread_{kind}: at least two non-decreasing factors >= 0 (or none)")
            if any(e < 1 for e in edges) or any(a >= b for a, b in zip(edges, edges[1:])):
                raise ProfileError(f"spread_{kind}_bins: increasing {unit}, each at least 1")
            if edges and len(sets) != len(edges) + 1:
                raise ProfileError(
                    f"spread_{kind}: {len(edges) + 1} sets (one per bin of spread_{kind}_bins, separated by |), got {len(sets)}"
                )
            if not edges and len(sets) > 1:
                raise ProfileError(f"spread_{kind}: several sets need spread_{kind}_bins (their upper edges)")

    def batch_ms(self, batch: int) -> float:
        """The table's step time for `batch` running requests."""
        xs, ys = self.batch, self.step_ms
        if len(xs) == 1:
            return ys[0]
        i = bisect_right(xs, batch) - 1
        if i < 0:
            i = 0  # below the first point: the first segment, extended
        elif i >= len(xs) - 1:
            i = len(xs) - 2  # beyond the last: the last segment, extended
        x0, x1, y0, y1 = xs[i], xs[i + 1], ys[i], ys[i + 1]
        return max(0.0, y0 + (y1 - y0) * (batch - x0) / (x1 - x0))

    def prefill_tokens_ms(self, tokens: int) -> float:
        """What `tokens` prompt tokens computed in a step add to it, ms:
        the table's (from 0 ms at 0 tokens), or the price per token."""
        xs = self.prefill_tokens
        if not xs or not tokens:
            return self.prefill_ms_per_token * tokens
        ys = self.prefill_ms
        i = bisect_right(xs, tokens) - 1
        if i < 0:
            return ys[0] * tokens / xs[0]  # from 0 ms at 0 tokens to the first point
        if i >= len(xs) - 1:
            if len(xs) == 1:
                return ys[0] * tokens / xs[0]
            i = len(xs) - 2  # beyond the last: the last segment, extended
        x0, x1, y0, y1 = xs[i], xs[i + 1], ys[i], ys[i + 1]
        return max(0.0, y0 + (y1 - y0) * (tokens - x0) / (x1 - x0))

    def predict_ms(
        self, batch: int, prefill_tokens: int = 0, prefill_attention: float = 0.0, context_tokens: int = 0, prefill_reqs: int = 0
    ) -> float:
        """The step time the profile predicts, ms, before its spread.
        `prefill_attention` is Σ c·(p + c/2) over the step's prompt chunks,
        `prefill_reqs` the requests that compute a prompt chunk."""
        return (
            self.batch_ms(batch)
            # the table's lookup only for a step that prefills (a decode step: the product, 0)
            + (self.prefill_tokens_ms(prefill_tokens) if prefill_tokens and self.prefill_tokens
               else self.prefill_ms_per_token * prefill_tokens)
            + self.prefill_attention_ms * prefill_attention / 1000.0
            + self.prefill_ms_per_request * prefill_reqs
            + self.context_ms_per_ktoken * context_tokens / 1000.0
        )

    def spread_of(self, prefill_tokens: int, batch: int = 1, novelty: int = 0) -> Tuple[Tuple[float, ...], bool]:
        """The spread a step's time is drawn from (empty: none), and whether
        its values are ms added to the prediction (else factors of it): with
        a `novelty` (StepSizes.add) that of new largest sizes or of new
        sizes, when the profile has it; else that of steps that prefill this
        many tokens, or of decode-only steps of this batch (prefill_tokens 0)."""
        if novelty == NEW_MAX and (self.spread_new_max or self.spread_new_max_ms):
            return (self.spread_new_max, False) if self.spread_new_max else (self.spread_new_max_ms, True)
        if novelty and (self.spread_new_size or self.spread_new_size_ms):
            return (self.spread_new_size, False) if self.spread_new_size else (self.spread_new_size_ms, True)
        if prefill_tokens:
            sets, edges, key = self.spread_prefill, self.spread_prefill_bins, prefill_tokens
        else:
            sets, edges, key = self.spread_decode, self.spread_decode_bins, batch
        return (sets[bisect_left(edges, key)] if sets else ()), False

    def spread(self, prefill_tokens: int, rng: random.Random, batch: int = 1) -> float:
        """A factor drawn from the spread of a step of a size run before
        (`spread_of`); 1.0: none."""
        return _draw(self.spread_of(prefill_tokens, batch)[0], rng, 1.0)

    def input_delay(self, rng: random.Random) -> float:
        """A request's input delay, ms, drawn from the measured ones (0: none)."""
        return _draw(self.input_delay_ms, rng, 0.0)

    def sample_ms(
        self,
        batch: int,
        prefill_tokens: int,
        prefill_attention: float,
        context_tokens: int,
        rng: random.Random,
        prefill_reqs: int = 0,
        novelty: int = 0,
    ) -> float:
        """One step's time, ms: the prediction times a factor drawn from its
        spread, or plus the ms drawn from it (`spread_of`)."""
        predicted = self.predict_ms(batch, prefill_tokens, prefill_attention, context_tokens, prefill_reqs)
        values, added = self.spread_of(prefill_tokens, batch, novelty)
        return spread_time(predicted, _draw(values, rng, 0.0 if added else 1.0), added)

    @property
    def prices_new_sizes(self) -> bool:
        """Whether a step's novelty changes its time (StepSizes)."""
        return bool(self.spread_new_size or self.spread_new_max or self.spread_new_size_ms or self.spread_new_max_ms)


class StepSizes:
    """The step sizes an engine has run (a size: the prompt tokens a step
    computes plus its decoding requests, vLLM's tokens scheduled). A real
    engine may pay for a size once, and most for one larger than any
    before; the trace reader and the mock's scheduler tell steps apart
    with this one class."""

    __slots__ = ("seen", "largest")

    def __init__(self) -> None:
        self.seen: set = set()
        self.largest = 0

    def add(self, size: int) -> int:
        """Record a step of `size`; its novelty: NEW_MAX, NEW_SIZE or STEADY."""
        if size in self.seen:
            return STEADY
        self.seen.add(size)
        if size > self.largest:
            self.largest = size
            return NEW_MAX
        return NEW_SIZE


def spread_time(predicted: float, value: float, added: bool) -> float:
    """A step's time, ms, from its prediction and a value of its spread
    (`StepProfile.spread_of`): plus the value, never below 0, when its values
    are ms added; else times it."""
    return max(0.0, predicted + value) if added else predicted * value


def _quantile_list(values: Tuple[float, ...], low: float = 0.0) -> bool:
    """Whether `values` can be quantiles: two or more, non-decreasing,
    finite, >= `low`."""
    return (
        len(values) >= 2
        and all(low <= v < math.inf for v in values)
        and all(a <= b for a, b in zip(values, values[1:]))
    )


def _draw(q: Tuple[float, ...], rng: random.Random, none: float) -> float:
    """A value drawn by inverse transform from quantiles `q` at evenly spaced
    probabilities (linear in between); `none` when there are none."""
    if not q:
        return none
    x = rng.random() * (len(q) - 1)
    i = int(x)
    if i >= len(q) - 1:
        return q[-1]
    return q[i] + (q[i + 1] - q[i]) * (x - i)


def _floats(text: str) -> Tuple[float, ...]:
    return tuple(float(v) for v in text.replace(",", " ").split())


def _whole(key: str, numbers: Tuple[float, ...]) -> Tuple[int, ...]:
    if any(n != int(n) for n in numbers):
        raise ProfileError(f"{key}: token and request counts are whole numbers")
    return tuple(int(n) for n in numbers)


_KEYS = (
    "version",
    "batch",
    "step_ms",
    "prefill_ms_per_token",
    "prefill_tokens",
    "prefill_ms",
    "prefill_attention_ms",
    "prefill_ms_per_request",
    "context_ms_per_ktoken",
    "spread_decode",
    "spread_decode_bins",
    "spread_prefill",
    "spread_prefill_bins",
    "spread_new_size",
    "spread_new_max",
    "spread_new_size_ms",
    "spread_new_max_ms",
    "input_delay_ms",
)

#: Keys whose value is one or more lists of numbers, separated by |.
_SETS = ("spread_decode", "spread_prefill")


def parse_profile(text: str, source: str = "<profile>") -> StepProfile:
    """A profile from its INI text; ProfileError names `source` and the key."""
    parser = configparser.ConfigParser(interpolation=None, inline_comment_prefixes=("#", ";"))
    try:
        parser.read_string(text, source=source)
    except configparser.Error as exc:
        raise ProfileError(f"{source}: not an INI file ({exc.__class__.__name__}: {exc})") from None
    if not parser.has_section(SECTION):
        raise ProfileError(f"{source}: no [{SECTION}] section")
    section = parser[SECTION]
    unknown = sorted(set(section) - set(_KEYS))
    if unknown:
        raise ProfileError(f"{source}: unknown key(s) {', '.join(unknown)} in [{SECTION}] (known: {', '.join(_KEYS)})")
    values: Dict[str, object] = {}
    try:
        version = int(section.get("version", str(FORMAT_VERSION)))
    except ValueError:
        raise ProfileError(f"{source}: version: not an integer") from None
    if version > FORMAT_VERSION:
        raise ProfileError(f"{source}: version {version} is newer than this engine reads ({FORMAT_VERSION})")
    for key in _KEYS[1:]:
        if key not in section:
            if key in ("batch", "step_ms"):
                raise ProfileError(f"{source}: missing key {key}")
            continue
        try:
            sets = tuple(_floats(part) for part in section[key].split("|"))
        except ValueError:
            raise ProfileError(f"{source}: {key}: not a list of numbers: {section[key]!r}") from None
        if len(sets) > 1 and key not in _SETS:
            raise ProfileError(f"{source}: {key}: one list of numbers expected (| only separates the sets of {' and '.join(_SETS)})")
        numbers = sets[0]
        if key in _SETS:
            values[key] = sets if any(sets) else ()
        elif key in ("batch", "spread_decode_bins", "spread_prefill_bins", "prefill_tokens"):
            try:
                values[key] = _whole(key, numbers)
            except ProfileError as exc:
                raise ProfileError(f"{source}: {exc}") from None
        elif key in ("step_ms", "prefill_ms", "input_delay_ms", "spread_new_size", "spread_new_max", "spread_new_size_ms", "spread_new_max_ms"):
            values[key] = numbers
        else:
            if len(numbers) != 1:
                raise ProfileError(f"{source}: {key}: one number expected")
            values[key] = numbers[0]
    try:
        return StepProfile(**values)  # type: ignore[arg-type]
    except ProfileError as exc:
        raise ProfileError(f"{source}: {exc}") from None


def read_profile(path: str) -> StepProfile:
    """The profile in file `path` (OSError when unreadable, ProfileError when invalid)."""
    return read_profile_file(path).profile


@dataclass(frozen=True)
class ProfileFile:
    """`--latency-profile`'s value: the path and what was read from it.
    Two are equal when path and content are, so a reload that reads an
    edited file under the same path sees a change and applies it."""

    path: str
    profile: StepProfile
    digest: str

    def __str__(self) -> str:
        return self.path  # as written in a config file (--print-config)

    @property
    def label(self) -> str:
        """The path and a digest of its content (the reload line)."""
        return f"{self.path} (sha256 {self.digest[:12]})"


def read_profile_file(path: str) -> ProfileFile:
    """File `path` and its profile (OSError when unreadable, ProfileError when invalid)."""
    with open(path, "rb") as f:
        data = f.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ProfileError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    return ProfileFile(path, parse_profile(text, source=path), hashlib.sha256(data).hexdigest())


def _join(values: Sequence[float], digits: int = 4) -> str:
    return " ".join(f"{v:.{digits}g}" for v in values)


def format_profile(profile: StepProfile, comment: Optional[Sequence[str]] = None) -> str:
    """The INI text of `profile`, with `comment` lines on top (parse_profile reads it back)."""
    lines = [f"# {line}".rstrip() for line in (comment or ())]
    lines += [
        f"[{SECTION}]",
        f"version = {FORMAT_VERSION}",
        "# running requests in the step, and the step time at each (ms): linear in between",
        f"batch = {' '.join(str(b) for b in profile.batch)}",
        f"step_ms = {_join(profile.step_ms, 5)}",
        "# ms per prompt token computed in the step (prefix-cache hits excluded)",
        f"prefill_ms_per_token = {profile.prefill_ms_per_token:.5g}",
    ]
    if profile.prefill_tokens:
        lines += [
            "# or a table: prompt tokens computed in the step, and what they add to it (ms): linear in between",
            f"prefill_tokens = {' '.join(str(t) for t in profile.prefill_tokens)}",
            f"prefill_ms = {_join(profile.prefill_ms, 5)}",
        ]
    lines += [
        "# ms per 1000 of sum c*(p + c/2) over the step's prompt chunks (c tokens from position p)",
        f"prefill_attention_ms = {profile.prefill_attention_ms:.5g}",
        "# ms per request computing a prompt chunk in the step",
        f"prefill_ms_per_request = {profile.prefill_ms_per_request:.5g}",
        "# ms per 1000 tokens held by the running requests (prompt + generated)",
        f"context_ms_per_ktoken = {profile.context_ms_per_ktoken:.5g}",
        "# measured / predicted step time, quantiles at evenly spaced probabilities: decode-only steps, one set",
        "# per bin of the batch, and steps that prefill, one set per bin of prefill tokens (the bins' upper edges;",
        "# sets separated by |)",
        f"spread_decode_bins = {' '.join(str(e) for e in profile.spread_decode_bins)}",
        f"spread_decode = {' | '.join(_join(q) for q in profile.spread_decode)}",
        f"spread_prefill_bins = {' '.join(str(e) for e in profile.spread_prefill_bins)}",
        f"spread_prefill = {' | '.join(_join(q) for q in profile.spread_prefill)}",
        "# the same for the first step of each size (prompt tokens computed + decoding requests) the engine runs,",
        "# and for a step larger than any before it",
        f"spread_new_size = {_join(profile.spread_new_size)}",
        f"spread_new_max = {_join(profile.spread_new_max)}",
        "# or, for either, the ms such a step takes beyond its prediction (measured - predicted), quantiles",
        f"spread_new_size_ms = {_join(profile.spread_new_size_ms)}",
        f"spread_new_max_ms = {_join(profile.spread_new_max_ms)}",
        "# ms from a request's arrival to the engine queueing it, quantiles at evenly spaced probabilities",
        f"input_delay_ms = {_join(profile.input_delay_ms)}",
    ]
    return "\n".join(lines) + "\n"
