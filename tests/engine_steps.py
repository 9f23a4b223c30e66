"""Driving one EngineCore by hand in unit tests: its clock, the engine
itself, stepping it until idle (or for a few steps, or at the times it asks
for), and picking a request's outputs and tokens out of what it sent."""

import time
from typing import Any, Callable, List, Optional, Tuple

import msgpack

from gmock_engine.core.engine import EngineCore, EngineSettings


class Clock:
    """The engine clock of a test: it stands still until the test moves `now`."""

    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class TickClock(Clock):
    """A clock that moves by one at every read (from `now`): each step, and
    each input that reads the time, has its own time."""

    def __init__(self, now: float = 0.0) -> None:
        super().__init__(now)

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def engine_with(clock: Optional[Callable[[], float]] = None, **settings: Any) -> EngineCore:
    """An EngineCore of rank 0 with one client (unless `settings` say
    otherwise) on `clock` (None: EngineCore's own, the monotonic clock)."""
    settings.setdefault("rank", 0)
    settings.setdefault("num_clients", 1)
    return EngineCore(EngineSettings(**settings), clock=clock or time.monotonic)


def run(engine: Any, clock: Optional[Clock] = None, tick: float = 0.0, limit: int = 10000) -> List[Tuple[int, List[Any]]]:
    """Step until idle; return every (client, message) sent, each of which
    must pack. With `clock`, it moves by `tick` after each step."""
    sent: List[Tuple[int, List[Any]]] = []
    for _ in range(limit):
        if not engine.has_work:
            return sent
        for client, message in engine.step():
            msgpack.packb(message, use_bin_type=True)
            sent.append((client, message))
        if clock is not None:
            clock.now += tick
    raise AssertionError("engine never went idle")


def run_steps(engine: Any, steps: int) -> List[Tuple[int, List[Any]]]:
    """At most `steps` steps (fewer if the engine goes idle); every (client, message) sent."""
    sent: List[Tuple[int, List[Any]]] = []
    for _ in range(steps):
        if not engine.has_work:
            break
        sent.extend(engine.step())
    return sent


def run_due(engine: Any, limit: int = 1000) -> List[Tuple[int, List[Any]]]:
    """Step until idle, first moving the engine's clock (a `Clock`) to each
    step's due time; every (client, message) sent."""
    sent: List[Tuple[int, List[Any]]] = []
    for _ in range(limit):
        if not engine.has_work:
            return sent
        due = engine.next_step_time(engine.clock.now)
        engine.clock.now = max(engine.clock.now, due)
        sent.extend(engine.step())
    raise AssertionError("engine never went idle")


def drive(engine: Any, clock: Clock, limit: int = 10000) -> List[Tuple[float, List[Any]]]:
    """Run steps at the times the engine asks for; return (time, message) pairs."""
    sent, step_started = [], clock.now
    for _ in range(limit):
        if not engine.has_work:
            return sent
        step_started = clock.now
        for _, message in engine.step():
            sent.append((clock.now, message))
        due = engine.next_step_time(step_started)
        if due is None:
            return sent
        clock.now = max(clock.now, due)
    raise AssertionError("never idle")


def outputs_of(sent: List[Tuple[Any, List[Any]]], rid: str) -> List[List[Any]]:
    """The EngineCoreOutputs of request `rid`, in order."""
    return [o for _, m in sent for o in m[1] if o[0] == rid]


def tokens_of(sent: List[Tuple[Any, List[Any]]], rid: str) -> List[int]:
    """The token ids request `rid` was sent, in order."""
    return [t for o in outputs_of(sent, rid) for t in o[1]]


#: Qwen's tool-call and think markers, added tokens that are not special.
MARKERS = ["<tool_call>", "</tool_call>", "<think>", "</think>"]


def marked_model_dir(dest, vocab_size):
    """The generated model dir with MARKERS as added tokens (not special, as Qwen's)."""
    import tokenizers

    from gmock_engine.tools import model_dir

    path = model_dir.write_model_dir(dest, vocab_size=vocab_size)
    tok = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.add_tokens([tokenizers.AddedToken(m, special=False, normalized=False) for m in MARKERS])
    tok.save(str(path / "tokenizer.json"))
    return path
