"""The driver of the engine's property tests: frames -> `decode_input` ->
`EngineCore.apply`, steps on a fake clock as the runtime's stepper takes
them (`Run`, `run_scenario`); the `Observer`s that check each property see
every decoded input and every returned message. Also the example counts
(`examples`), the case counter conftest.py prints, and `violation`, the
failure of one named rule. The scenarios: engine_scenarios.py."""

from __future__ import annotations

import os
import re
from collections import Counter
from typing import Any, Dict, List, Optional, Tuple

import msgpack
from engine_scenarios import build_settings
from fake_frontend import engine_core_request
from hypothesis import note

from gmock_engine.core.engine import EngineCore
from gmock_engine.wire.eras import DEFAULT_PROTOCOL_VERSION, WIRE_LAYOUTS
from gmock_engine.wire.inputs import EngineCoreRequest, InvalidRequest, decode_input
from gmock_engine.wire.types import EngineCoreRequestType, ProtocolError

LAYOUT = WIRE_LAYOUTS[DEFAULT_PROTOCOL_VERSION]
#: Decoded ADDs: a request, or (newer decoders) an ADD with a bad value that
#: the engine answers with an ERROR output for that request.
ADD_TYPES = tuple(t for t in (EngineCoreRequest, InvalidRequest) if t is not None)
#: Steps at the end before everything is aborted (requests may ask for 2**64 tokens).
FINAL_STEPS = 48


def examples(default: int) -> int:
    """Examples per test: GMOCK_HYPOTHESIS_EXAMPLES, else the test's default."""
    value = os.environ.get("GMOCK_HYPOTHESIS_EXAMPLES")
    return int(value) if value else default


# --------------------------------------------------------------------------
# Counting cases (printed by conftest.pytest_terminal_summary)
# --------------------------------------------------------------------------


class CaseCounter:
    """Examples and generated cases (the settings draw + every operation) per test."""

    def __init__(self) -> None:
        self.per_test: Dict[str, List[float]] = {}
        self.current = "?"

    def add(self, cases: int) -> None:
        entry = self.per_test.setdefault(self.current, [0, 0, 0.0])
        entry[0] += 1
        entry[1] += cases

    def timed(self, test: str, seconds: float) -> None:
        self.per_test.setdefault(test, [0, 0, 0.0])[2] += seconds

    def totals(self) -> Tuple[int, int, float]:
        return (
            sum(int(e[0]) for e in self.per_test.values()),
            sum(int(e[1]) for e in self.per_test.values()),
            sum(e[2] for e in self.per_test.values()),
        )


CASES = CaseCounter()


# --------------------------------------------------------------------------
# Failures: one AssertionError subclass per rule (distinct bugs for Hypothesis)
# --------------------------------------------------------------------------

_ERROR_CLASSES: Dict[str, type] = {}


def violation(rule: str, detail: str) -> AssertionError:
    """An AssertionError whose class names the rule, e.g. WireRule_stop_reason_u32."""
    name = re.sub(r"\W", "_", rule)
    cls = _ERROR_CLASSES.get(name)
    if cls is None:
        cls = _ERROR_CLASSES[name] = type(name, (AssertionError,), {})
    return cls(detail)


# --------------------------------------------------------------------------
# The driver: frames -> decode -> apply, steps on a fake clock
# --------------------------------------------------------------------------


class StepClock:
    """The engine clock: constant between steps, advanced by each step."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Observer:
    """Sees every decoded input and every returned message; raises on a violation."""

    def input(self, run: "Run", message: Any) -> None:
        pass

    def output(self, run: "Run", client: int, message: List[Any]) -> None:
        pass

    def after(self, run: "Run") -> None:
        """After every apply and every step."""

    def end(self, run: "Run") -> None:
        pass


class Run:
    def __init__(self, spec: Dict[str, Any], observers: List[Observer]) -> None:
        self.spec = spec
        self.settings = build_settings(spec)
        self.clock = StepClock()
        self.engine = EngineCore(self.settings, clock=self.clock)
        self.observers = observers
        self.next_step_at: Optional[float] = None
        self.added_ids: Dict[str, None] = {}  # every id of a decoded ADD, in order
        self.stats = Counter()

    # -- input ---------------------------------------------------------------

    def frames(self, frames: List[bytes]) -> None:
        try:
            message = decode_input(frames, LAYOUT)
        except ProtocolError:
            self.stats["rejected"] += 1  # the reader logs and drops it
            return
        self.stats["decoded"] += 1
        if isinstance(message, ADD_TYPES):
            self.added_ids[message.request_id] = None
        for observer in self.observers:
            observer.input(self, message)
        self.emit(self.engine.apply(message))

    def add_payload(self, payload: Any) -> None:
        self.frames([EngineCoreRequestType.ADD.value, msgpack.packb(payload, use_bin_type=True)])

    def abort_payload(self, payload: Any) -> None:
        self.frames([EngineCoreRequestType.ABORT.value, msgpack.packb(payload, use_bin_type=True)])

    def utility_payload(self, payload: Any) -> None:
        self.frames([EngineCoreRequestType.UTILITY.value, msgpack.packb(payload, use_bin_type=True)])

    # -- steps ---------------------------------------------------------------

    def step(self, dt: float) -> bool:
        """One step as the runtime's stepper takes it; False when idle."""
        engine = self.engine
        if not engine.has_work:
            self.next_step_at = None
            return False
        now = self.clock.now + dt
        if self.next_step_at is not None and now < self.next_step_at:
            now = self.next_step_at
        self.clock.now = now
        self.emit(engine.step())
        self.next_step_at = engine.next_step_time(now)
        self.stats["steps"] += 1
        return True

    def emit(self, out: List[Tuple[int, List[Any]]]) -> None:
        for client, message in out:
            for observer in self.observers:
                observer.output(self, client, message)
        for observer in self.observers:
            observer.after(self)

    # -- operations ------------------------------------------------------------

    def do(self, op: Tuple[Any, ...]) -> None:
        kind = op[0]
        if kind == "add":
            self.add_payload(op[1])
        elif kind == "add_many":
            _, n, max_tokens, prompt_len, prefix = op
            for i in range(n):
                sampling = {"temperature": 1.0, "max_tokens": max_tokens}
                self.add_payload(engine_core_request(f"{prefix}{i}", list(range(prompt_len)), sampling))
        elif kind == "abort":
            self.abort_payload(op[1])
        elif kind == "abort_known":
            self.abort_payload(list(self.added_ids)[: op[1]])
        elif kind == "utility":
            self.utility_payload(op[1])
        elif kind == "raw":
            self.frames(op[1])
        elif kind == "step":
            self.step(op[1])
        elif kind == "steps":
            for _ in range(op[1]):
                if not self.step(op[2]):
                    break
        else:
            raise AssertionError(f"unknown op {op!r}")

    def finish(self) -> None:
        """Step until idle, abort everything, step until idle."""
        for _ in range(FINAL_STEPS):
            if not self.step(0.05):
                break
        if self.added_ids:
            self.abort_payload(list(self.added_ids))
        for _ in range(FINAL_STEPS):
            if not self.step(0.05):
                break
        for observer in self.observers:
            observer.end(self)


def run_scenario(scenario: Tuple[Dict[str, Any], List[Tuple[Any, ...]]], observers: List[Observer]) -> Run:
    spec, ops = scenario
    CASES.add(1 + len(ops))
    run = Run(spec, observers)
    for op in ops:
        run.do(op)
    run.finish()
    note(f"run stats: {dict(run.stats)}")
    return run
