"""Fault injection, applied: where the --fault-* faults act on a running engine.

faults/specs.py is the pure part (the specs, which fault fires when, the rewrite
of a request's last output); this module is the layer that applies them
between the runtime's stages. The runtime asks it four things and knows
nothing else about faults:

* `on_input(message)`: each input before the engine applies it. A request
  may fire an engine fault (crash, hang, stall-outputs, slow-steps), get
  an ERROR mid-stream planted, or be marked for a wire fault; a utility
  call may be answered with a failure instead of being applied.
* `on_outputs(messages)`: each batch the engine built, before it is
  queued: the marked requests' terminal outputs are dropped, doubled or
  held back (faults.rewrite).
* `next_step_at(started, due)`: the step period, stretched by slow-steps.
* the gates: `flowing` (closed by a hang: readers, stepper and sender
  wait) and `outputs_flowing` (closed by a stall or a hang: the sender
  waits), and `hung`.

With no fault configured for an engine, `build` gives `NoFaults`, a
null object whose answers are pass-throughs and whose gates never close,
so the serving path has no fault branches and pays nothing per token.

A reload (SIGHUP) builds the layer again (`build` with `previous`),
between two steps: the new specs (faults.Faults carries over the state of
the unchanged ones), and whatever is under way goes on in the new layer: the same gates (a hang
or a stall ends when it was due to), the requests marked for a wire fault,
slow steps.

The request ledger sees the messages before `on_outputs` rewrites them
(core/engine.py keeps the books of what a correct engine sends); the injected
faults are counted beside it (`Faults.injected`), so a run with faults
still expects 0 ledger violations.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import gevent
import gevent.event

from gmock_engine.faults import specs as faults
from gmock_engine.kv import transfer as kv_transfer
from gmock_engine.core.engine import COORDINATOR, EngineCore, Outbound
from gmock_engine.faults.specs import FaultSpec, Faults
from gmock_engine.wire.checks import MAX_DELAY_MS
from gmock_engine.wire.inputs import EngineCoreRequest, UtilityCall

#: What `on_input` answers for an input it leaves alone: nothing to send.
NO_OUTPUTS: Tuple[Outbound, ...] = ()


def _open_gate() -> gevent.event.Event:
    gate = gevent.event.Event()
    gate.set()
    return gate


class NoFaults:
    """No --fault-* for this engine: every answer a pass-through, the gates
    always open. The runtime calls it like a `FaultInjector`, without an
    `if` of its own."""

    #: Never: nothing here hangs the engine.
    hung = False

    def __init__(self, faults: Faults) -> None:
        #: The (empty) decider, for the `fault_*` counters (none).
        self.faults = faults
        #: Never closed (see FaultInjector).
        self.flowing = _open_gate()
        self.outputs_flowing = _open_gate()

    def joined(self, engine: EngineCore, now: float) -> Optional[Callable[[], None]]:
        """The engine joined its frontend: no timed fault to run."""
        return None

    def on_input(self, message: Any) -> Tuple[Any, Sequence[Outbound]]:
        """The input, to apply as it is; nothing to send for it."""
        return message, NO_OUTPUTS

    def on_outputs(self, messages: List[Outbound]) -> List[Outbound]:
        """The batch, to queue as it is."""
        return messages

    @property
    def under_way(self) -> bool:
        """Never: nothing for a rebuilt layer to take over."""
        return False

    def next_step_at(self, started: float, due: Optional[float]) -> Optional[float]:
        """The step time the latency model asked for."""
        return due


class FaultInjector:
    """One engine's configured faults, applied.

    `Faults` decides which fault fires on which occasion; this class does
    what the fired fault does. What only the runtime can do is handed in:
    `spawn` (the Supervisor's: every timer greenlet is supervised), `put`
    (the output queue, for late finishes) and `vanish` (a crash: end this
    engine's greenlets and close its sockets; it does not return)."""

    def __init__(
        self,
        faults: Faults,
        rank: int,
        log: Any,
        spawn: Callable[..., gevent.Greenlet],
        put: Callable[[Outbound], None],
        vanish: Callable[[], None],
    ) -> None:
        self.faults = faults
        self.rank = rank
        self.log = log
        self._spawn = spawn
        self._put = put
        self._vanish = vanish
        self._engine: Optional[EngineCore] = None
        #: Cleared by a hang: readers, stepper and sender wait on it.
        self.flowing = _open_gate()
        #: Cleared by a stall (and a hang): the sender waits on it.
        self.outputs_flowing = _open_gate()
        #: Requests whose terminal output a wire fault will rewrite.
        self.marked: Dict[str, FaultSpec] = {}
        self.slow_factor = 1.0
        self.slow_until = float("inf")

    @property
    def hung(self) -> bool:
        """A hang is on: nothing the engine holds can be waited for."""
        return not self.flowing.is_set()

    @property
    def under_way(self) -> bool:
        """A fault is still acting (a gate closed, a marked request, slow
        steps): a rebuilt layer must go on with it (`build`)."""
        return (
            not self.flowing.is_set()
            or not self.outputs_flowing.is_set()
            or bool(self.marked)
            or self.slow_factor != 1.0
        )

    def joined(self, engine: EngineCore, now: float) -> Optional[Callable[[], None]]:
        """The engine joined its frontend at `now`: `at=` counts from here,
        and `engine` answers the failed utility calls. Returns the loop
        that fires the timed faults, for the runtime to spawn, or None."""
        self._engine = engine
        self.faults.joined(now)
        return self._fault_timer if self.faults.timed() else None

    # -- input ---------------------------------------------------------------

    def on_input(self, message: Any) -> Tuple[Any, Sequence[Outbound]]:
        """Check one input against the faults: (the input to apply, maybe
        changed, or None when a fault answered it; the outputs to send for
        it). An engine fault acts here and now; a crash does not return."""
        now = time.monotonic()
        if isinstance(message, EngineCoreRequest):
            for spec in self.faults.on_request(now):
                if spec.scope == faults.ENGINE:
                    self._engine_fault(spec, f"request {message.request_id}")
                elif spec.kind == "error-mid-stream":
                    message = self._fail_mid_stream(message)
                elif message.request_id not in self.marked:
                    self.marked[message.request_id] = spec
                    self.log.warning("injected fault {}: request {}", spec.kind, message.request_id)
            # an occasion only where the load happens: a consumer engine (kv/transfer.py)
            transfer = getattr(self._engine, "kv_transfer", None)
            if transfer is not None and transfer.settings.consumes and kv_transfer.remote_prefill_requested(message.extra_args):
                for spec in self.faults.on_transfer(now):
                    message = self._kv_transfer_fault(message, spec)
        elif isinstance(message, UtilityCall):
            spec = self.faults.on_utility(message.method, now)
            if spec is not None:
                self.log.warning("injected fault fail-utility: {} (call id {}) answered with a failure", message.method, message.call_id)
                return None, self._engine.fail_utility(message, faults.UTILITY_FAILURE_MESSAGE)
        return message, NO_OUTPUTS

    def _kv_transfer_fault(self, request: EngineCoreRequest, spec: FaultSpec) -> EngineCoreRequest:
        """kv-transfer-fail / -slow: the engine's own P/D scenarios
        (vllm_xargs mock_kv_load=fail, mock_kv_transfer_delay_ms), set on
        this request; a delay adds to the request's own."""
        xargs = dict(request.extra_args)
        if spec.kind == "kv-transfer-fail":
            xargs["mock_kv_load"] = "fail"
            self.log.warning("injected fault kv-transfer-fail: request {} ends with ERROR after its KV transfer", request.request_id)
        else:
            previous = xargs.get("mock_kv_transfer_delay_ms")
            own = previous if isinstance(previous, (int, float)) and not isinstance(previous, bool) and previous >= 0 else 0
            xargs["mock_kv_transfer_delay_ms"] = min(own + spec.delay * 1000.0, MAX_DELAY_MS)
            self.log.warning("injected fault kv-transfer-slow: request {}'s KV transfer takes {}s longer", request.request_id, spec.delay)
        return dataclasses.replace(request, extra_args=xargs)

    def _fail_mid_stream(self, request: EngineCoreRequest) -> EngineCoreRequest:
        """error-mid-stream: the engine's own `mock_fail_after` scenario, set
        to half the tokens (or the request's own, if that comes sooner)."""
        after = faults.fail_after(request.max_tokens)
        previous = request.extra_args.get("mock_fail_after")
        if isinstance(previous, int) and previous < after:
            after = previous
        request = dataclasses.replace(request, extra_args={**request.extra_args, "mock_fail_after": after})
        self.log.warning("injected fault error-mid-stream: request {} ends with ERROR after {} tokens", request.request_id, after)
        return request

    # -- output --------------------------------------------------------------

    def on_outputs(self, messages: List[Outbound]) -> List[Outbound]:
        """The batch to queue now. While a wire fault waits for a marked
        request's end, each client's message is rewritten (faults.rewrite,
        §4.2); what late-finish holds back is queued by a timer greenlet.
        Coordinator messages (stats, §6.2) carry no request and pass."""
        if not self.marked:
            return messages
        now: List[Outbound] = []
        for client, message in messages:
            if client == COORDINATOR:
                now.append((client, message))
                continue
            sent, later = faults.rewrite(message, self.marked)
            now.extend((client, each) for each in sent)
            for delay, each in later:
                self._spawn(f"engine-{self.rank}-late-finish", self._put_later, delay, (client, each))
        return now

    def _put_later(self, delay: float, item: Outbound) -> None:
        gevent.sleep(delay)
        self._put(item)

    # -- the step period -----------------------------------------------------

    def next_step_at(self, started: float, due: Optional[float]) -> Optional[float]:
        """When the step that started at `started` lets the next one come:
        `due` (the latency model's answer), or under slow-steps the step
        period (what the model asked, or what the step took, whichever is
        longer) times the factor."""
        if self.slow_factor == 1.0 or due is None:
            return due
        now = time.monotonic()
        if now >= self.slow_until:
            self.log.warning("slow steps over")
            self.slow_factor = 1.0
            return due
        return started + max(due - started, now - started) * self.slow_factor

    # -- engine faults -------------------------------------------------------

    def _fault_timer(self) -> None:
        """Fires the engine faults with at=T, each when due."""
        for due, spec in self.faults.timed():
            gevent.sleep(max(0.0, due - time.monotonic()))
            if self.faults.fire(spec):
                self._engine_fault(spec, f"at={spec.at:g}s")

    def _engine_fault(self, spec: FaultSpec, why: str) -> None:
        """crash | hang | stall-outputs | slow-steps, now."""
        kind = spec.kind
        if kind == "crash":
            self.log.critical("injected fault crash ({}): engine {} vanishes without ENGINE_CORE_DEAD", why, self.rank)
            self._vanish()  # does not return
        elif kind == "hang":
            self.log.warning("injected fault hang ({}): not reading, stepping or sending{}", why, _for(spec.duration))
            self.flowing.clear()
            self.outputs_flowing.clear()
            if spec.duration is not None:
                self._spawn(f"engine-{self.rank}-hang-end", self._resume_after, spec.duration, True)
        elif kind == "stall-outputs":
            self.log.warning("injected fault stall-outputs ({}): no output leaves{}", why, _for(spec.duration))
            self.outputs_flowing.clear()
            if spec.duration is not None:
                self._spawn(f"engine-{self.rank}-stall-end", self._resume_after, spec.duration, False)
        elif kind == "slow-steps":
            self.log.warning("injected fault slow-steps ({}): steps take {:g}x as long{}", why, spec.factor, _for(spec.duration))
            self.slow_factor = spec.factor or 1.0
            self.slow_until = time.monotonic() + spec.duration if spec.duration is not None else float("inf")

    def _resume_after(self, seconds: float, hang: bool) -> None:
        """End a timed hang or stall; a stall that ends during a hang leaves
        the outputs shut until the hang is over too."""
        gevent.sleep(seconds)
        if hang:
            self.log.warning("hang over: the engine goes on")
            self.flowing.set()
        elif self.flowing.is_set():
            self.log.warning("output stall over")
        if self.flowing.is_set():
            self.outputs_flowing.set()


Injector = Union[NoFaults, FaultInjector]


@dataclasses.dataclass(frozen=True)
class RuntimeHooks:
    """What only the runtime can do for the fault layer of engine `rank`
    (see FaultInjector): `spawn` a supervised timer greenlet, `put` a late
    output on the output queue, `vanish` (a crash; does not return)."""

    rank: int
    log: Any
    spawn: Callable[..., gevent.Greenlet]
    put: Callable[[Outbound], None]
    vanish: Callable[[], None]


def build(
    specs: Sequence[FaultSpec],
    seed: int,
    hooks: RuntimeHooks,
    *,
    previous: Optional[Injector] = None,
    now: float = 0.0,
    engine: Optional[EngineCore] = None,
) -> Tuple[Injector, Optional[Callable[[], None]]]:
    """The fault layer of engine `hooks.rank`: a `FaultInjector` when a spec
    applies to this rank (or `previous` has a fault under way), else
    `NoFaults`; and the loop that fires its timed faults, for the runtime to
    spawn (None: no timed fault, or `engine` not given).

    Without `previous`: the layer an engine starts with (its timed faults
    get their loop from `joined`, once the engine joined its frontend).
    With `previous`: a reload (SIGHUP) puts the new layer in its place, with
    the new `specs` (faults.Faults carries over the state of the unchanged
    ones; a new or changed at= counts from `now`), going on with what
    `previous` has under way: the same gates, the requests it marked, slow
    steps. With `engine` (it joined already) the new layer answers for it
    at once and its timer loop replaces the previous one."""
    rank = hooks.rank
    if previous is None:
        decider = Faults(specs, rank, seed)
        if not decider:
            return NoFaults(decider), None
        return FaultInjector(decider, rank, hooks.log, hooks.spawn, hooks.put, hooks.vanish), None
    decider = Faults(specs, rank, seed, previous.faults, now)
    if not decider and not previous.under_way:
        layer: Injector = NoFaults(decider)
    else:
        layer = FaultInjector(decider, rank, hooks.log, hooks.spawn, hooks.put, hooks.vanish)
        if isinstance(previous, FaultInjector):
            layer.marked = previous.marked
            layer.slow_factor, layer.slow_until = previous.slow_factor, previous.slow_until
    # The readers, the stepper and the sender wait at these very gates, and
    # a timed hang or stall under way opens them when it is over.
    layer.flowing, layer.outputs_flowing = previous.flowing, previous.outputs_flowing
    if engine is None or isinstance(layer, NoFaults):
        return layer, None
    layer._engine = engine
    return layer, (layer._fault_timer if decider.timed() else None)


def _for(duration: Optional[float]) -> str:
    return f" for {duration:g} s" if duration is not None else " until the process stops"
