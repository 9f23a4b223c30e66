"""The value types of the options: each turns the text of a flag, variable
or config-file key into its value, or raises argparse.ArgumentTypeError
with what is wrong; the parser adds the flag and where the value came from
(loader.py). Like the rest of the configuration, no gevent or zmq here; the
modules a value is checked against are imported when it is parsed.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from typing import Any, Dict, Sequence, Tuple

from gmock_engine.wire.eras import AUTO, layout_for_version
from gmock_engine.faults.specs import parse_spec

_TCP_RE = re.compile(r"^tcp://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.*-]+):(\d{1,5})$")

_INT64_MAX = (1 << 63) - 1


def int_at_least(minimum: int, maximum: int = _INT64_MAX):
    """An integer (any base Python reads: 0x10) in [minimum, maximum]."""

    def parse(text: str) -> int:
        try:
            value = int(text, 0)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is less than {minimum}")
        if value > maximum:
            # every number reaches a frontend or the wire somewhere (READY, stats, token ids)
            raise argparse.ArgumentTypeError(f"{value} is more than {maximum}")
        return value

    parse.__name__ = f"integer >= {minimum}" if maximum == _INT64_MAX else f"integer in [{minimum}, {maximum}]"
    return parse


def float_at_least(minimum: float):
    """A number >= minimum (nan is not)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not value >= minimum:  # also rejects nan
            raise argparse.ArgumentTypeError(f"{value} is less than {minimum}")
        return value

    parse.__name__ = f"number >= {minimum}"
    return parse


def float_in(low: float, high: float):
    """A number in [low, high]."""

    def parse(text: str) -> float:
        value = float_at_least(low)(text)
        if value > high:
            raise argparse.ArgumentTypeError(f"{value} is more than {high}")
        return value

    parse.__name__ = f"number in [{low}, {high}]"
    return parse


def rate_list(text: str) -> Tuple[float, ...]:
    """Comma-separated numbers in [0, 1] (at least one), e.g. 0.8,0.6,0.4."""
    parts = [part.strip() for part in str(text).split(",")]
    if not parts or any(not part for part in parts):
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of rates")
    return tuple(float_in(0.0, 1.0)(part) for part in parts)


rate_list.__name__ = "rates in [0, 1]"


def length_spec(text: str) -> str:
    """--output-len-dist: a spec lengths.OutputLengths reads (kept as text)."""
    from gmock_engine.content.lengths import OutputLengths

    try:
        OutputLengths.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text.strip()


def token_source(text: str) -> str:
    """--token-source: random, echo, text or file:PATH (the file is read to check it;
    text needs --tokenizer, which config.parse_config checks)."""
    from gmock_engine.content.tokens import read_token_file

    text = text.strip()
    if text in ("random", "echo", "text"):
        return text
    if text.startswith("file:"):
        try:
            read_token_file(text[5:])
        except (OSError, ValueError) as exc:
            raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None
        return text
    raise argparse.ArgumentTypeError(f"{text!r} is not random, echo, text or file:PATH")


def tokenizer_path(text: str) -> str:
    """--tokenizer: a model directory with tokenizer.json, or the file (loaded later, by config.parse_config)."""
    from gmock_engine.content.tokenizer import tokenizer_file

    text = text.strip()
    try:
        tokenizer_file(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def latency_profile(text: str) -> Any:
    """--latency-profile: a step-time profile file, read (a ProfileFile)."""
    from gmock_engine.timing.profile import ProfileError, read_profile_file

    path = text.strip()
    try:
        return read_profile_file(path)
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"{path!r}: cannot read it ({exc.strerror or exc})") from None
    except ProfileError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def replay_trace(text: str) -> Any:
    """--replay: a record tap's trace file, read (replay.load) into the
    recorded requests the engines replay."""
    from gmock_engine.timing.replay import load

    path = text.strip()
    try:
        return load(path)
    except (OSError, ValueError) as exc:
        raise argparse.ArgumentTypeError(f"{path!r}: {exc}") from None


replay_trace.__name__ = "trace file"


@dataclass(frozen=True)
class IdRange:
    """--token-id-range: [low, high); prints as it is written."""

    low: int
    high: int

    def __str__(self) -> str:
        return f"{self.low}:{self.high}"


def id_range(text: str) -> IdRange:
    """--token-id-range: LOW:HIGH with 0 <= LOW < HIGH."""
    low, sep, high = text.partition(":")
    try:
        bounds = IdRange(int(low), int(high))
    except ValueError:
        bounds = None
    if not sep or bounds is None or not 0 <= bounds.low < bounds.high:
        raise argparse.ArgumentTypeError(f"{text!r} is not LOW:HIGH with 0 <= LOW < HIGH")
    return bounds


def zmq_address(text: str) -> str:
    """A ZMQ endpoint the engine connects to: tcp://host:port or ipc:///path."""
    text = text.strip()
    if text.startswith("ipc://"):
        if len(text) == len("ipc://"):
            raise argparse.ArgumentTypeError(f"{text!r} has no path after ipc://")
        return text
    match = _TCP_RE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not tcp://host:port or ipc:///path")
    port = int(match.group(2))
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} has port {port}, not in 1..65535")
    return text


def task_list(text: str) -> Tuple[str, ...]:
    """--supported-tasks: comma-separated, at least one."""
    tasks = tuple(t.strip() for t in text.split(",") if t.strip())
    if not tasks:
        raise argparse.ArgumentTypeError("needs at least one task, e.g. generate")
    return tasks


def fault(kind: str):
    """--fault-KIND: a spec faults.parse_spec reads for that kind."""

    def parse(text: str) -> Any:
        try:
            return parse_spec(kind, text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse.__name__ = "fault spec"
    return parse


def kv_events_config(text: str) -> Any:
    """--kv-events-config: vLLM's KV events JSON (kv_events.parse_config)."""
    from gmock_engine.kv.events import parse_config

    try:
        return parse_config(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


kv_events_config.__name__ = "KV events config"


def choice(choices: Sequence[str], fold=str.lower):
    """One of `choices`, compared after `fold` (lower case unless told)."""

    def parse(text: str) -> str:
        value = fold(text.strip())
        if value not in choices:
            raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(choices)}")
        return value

    parse.__name__ = "choice"
    return parse


def kv_transfer_config(text: str) -> Dict[str, Any]:
    """--kv-transfer-config: vLLM's KV transfer JSON (kv_transfer.parse_kv_transfer_config)."""
    from gmock_engine.kv.transfer import parse_kv_transfer_config

    try:
        return parse_kv_transfer_config(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None


kv_transfer_config.__name__ = "JSON"


def protocol_version(text: str) -> str:
    """`auto`, or a vLLM version that has a wire layout (kept as given)."""
    value = text.strip().lower()
    if value == AUTO:
        return value
    try:
        layout_for_version(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{exc}; or auto") from None
    return value


def nonempty(text: str) -> str:
    """Any text but an empty one (stripped)."""
    text = text.strip()
    if not text:
        raise argparse.ArgumentTypeError("must not be empty")
    return text
