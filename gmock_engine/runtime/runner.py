"""One engine's greenlet wiring: readers -> stepper -> sender.

Per engine (design card):

* one **reader** greenlet per input DEALER (and one for the coordinator
  socket): receives `[type, payload, aux...]`, decodes it (wire/inputs.py) and
  `deliver`s the message to the stepper. A bad frame is logged and
  dropped; the engine keeps serving. (The loop: `transport.Reader`.)
* one **stepper** greenlet that owns the `EngineCore`: applies queued input,
  advances every running request once per round, packs each message as it
  makes it (the engine reuses its steady outputs' lists in the next step) and
  sends it itself when the sender is idle, else queues the bytes for the
  sender. It blocks on `woken` when there is nothing to do (idle CPU is
  zero) and yields to the hub after every round, so input is never starved.
* one **sender** greenlet, the only place a message leaves: PUSHes each
  queued message to `outputs[client_index]` (packing only what a fault's
  timer queued unpacked). (The loop and the packing: `transport.Sender`.)

The stages talk only through the engine's `links.StageLinks`, each link by
name: its bounded queues, its `wake` event and the gates of the fault layer
(fault_injection.py: `on_input`, `on_outputs` and `next_step_at` asked by
the stepper; `NoFaults`, all pass-throughs, when no --fault-* applies).
Every greenlet runs in the `Supervisor`'s group (supervisor.py); a reload
reaches an engine as a `Reconfiguration` (app.py), which its stepper takes
between two steps.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any, Callable, Dict, List, Optional

import gevent
import gevent.event
import gevent.queue
from loguru import logger

from gmock_engine.runtime import fault_injection, frontend_watch, grammar_pool, kv_publisher as kv_event_publisher, transport
from gmock_engine.kv import events as kv_events
from gmock_engine.content import tokens
from gmock_engine.wire.eras import Wire
from gmock_engine.wire.handshake import engine_ready_message, engine_ready_response, InitMessage
from gmock_engine.wire.inputs import decode_coordinator, decode_input
from gmock_engine.config import settings as parts
from gmock_engine.core.engine import Drain, EngineCore, EngineSettings, LedgerViolation, Outbound
from gmock_engine.runtime.links import StageLinks
from gmock_engine.utils.logs import Throttle
from gmock_engine.config.reload import Reconfiguration
from gmock_engine.utils.stats import Samples
from gmock_engine.runtime.steptimer import StepTimer, cadence_base
from gmock_engine.runtime.supervisor import Supervisor

#: Back-to-back (unpaced) steps give the hub a round (socket poll, the
#: readers, the sender, the other engines) at least this often.
YIELD_INTERVAL_S = 0.0001
#: Input messages the stepper applies between two steps, at most (then it
#: steps and takes the rest): a cohort of hundreds of ADDs, each decoded,
#: would otherwise hold up the step that serves the first of them, and
#: every running request's next token, for milliseconds (TTFT at
#: saturation, step lateness when paced). A count, not a time, so that
#: what shares a step does not depend on the machine's load; a burst of
#: up to this many is scheduled together, as vLLM schedules its whole
#: input queue.
INPUT_SLICE = 32
#: Unpaced, 1/INPUT_SLICE_DIVISOR of the running requests, if more: the
#: intake grows with the step it alternates with (an ADD costs about what
#: 20 tokens do), so an unpaced engine at its CPU limit still takes in
#: what arrives (vLLM takes its whole input queue before every step)
#: instead of leaving ADDs in front of the scheduler, where SchedulerStats
#: do not count them as waiting.
INPUT_SLICE_DIVISOR = 8
#: Budget of each shutdown stage, seconds; the sum stays well under 1 s.
#: Stage 2 (flush_output) takes at most SENDER_FLUSH_TIMEOUT_S + KILL_TIMEOUT_S,
#: and shutdown waits that long (plus a margin) before it closes any socket,
#: so no sender is still in `send` when its socket closes.
KILL_TIMEOUT_S = 0.2
SENDER_FLUSH_TIMEOUT_S = 0.3

#: At most this many "bad frame" warnings per window, then one summary line.
BAD_FRAME_LOGS = 20
BAD_FRAME_WINDOW_S = 10.0


class EngineRunner:
    """One engine: its handshake, sockets, queues and three kinds of greenlet."""

    def __init__(
        self,
        ctx: Any,
        supervisor: Supervisor,
        rank: int,
        config: Any,
        settings: parts.Settings,
        wire: Wire,
        on_crash: Callable[["EngineRunner"], None] = lambda runner: None,
        on_frontend_gone: Callable[[], None] = lambda: None,
    ) -> None:
        self.ctx = ctx
        self.supervisor = supervisor
        self.rank = rank
        #: The parsed options in force: READY reports them as configured (wire/handshake.py).
        self.config = config
        #: The settings stage's parts (App.settings): the engine runs by them; the handshake builds the EngineSettings from them.
        self.parts = settings
        process = settings.process
        self.wire = wire
        self.log = logger.bind(engine=rank)
        self.sockets: Optional[transport.EngineSockets] = None
        self.engine: Optional[EngineCore] = None
        #: What the readers, the stepper and the sender share, by name.
        self.links = StageLinks()
        self.handshake: Optional[gevent.Greenlet] = None
        self.readers: List[gevent.Greenlet] = []
        #: Fires the faults with at=T (only when one is configured).
        self.fault_timer: Optional[gevent.Greenlet] = None
        self.stepper: Optional[gevent.Greenlet] = None
        self.sender: Optional[gevent.Greenlet] = None
        self.joined = gevent.event.Event()
        #: The watch of the frontend (frontend_watch.py) and its greenlet, once joined.
        self.watch = frontend_watch.FrontendWatch(
            rank, self.log, process.frontend_heartbeat, process.exit_when_frontend_gone, on_frontend_gone,
            busy=lambda: self.engine is not None and self.engine.has_work,
        )
        self.watcher: Optional[gevent.Greenlet] = None
        self.stall_watcher: Optional[gevent.Greenlet] = None
        #: Set once INIT arrived (joined follows after the coordinator's READY, if any).
        self.got_init = gevent.event.Event()
        #: Rate-limited warnings for what the frontend (or anyone) sends.
        self.throttle = Throttle(self.log, BAD_FRAME_LOGS, BAD_FRAME_WINDOW_S)
        #: Bad frames and contained failures, counted by the socket loops and the stepper.
        self.incidents = transport.Incidents()
        self.step_lateness = Samples()
        #: What only this runner can do for the fault layer.
        self._fault_hooks = fault_injection.RuntimeHooks(rank, self.log, supervisor.spawn, self.links.queue_output, self._vanish)
        #: The fault layer (fault_injection.py): NoFaults unless a --fault-*
        #: applies to this rank. Its gates stay the same across reloads.
        self.injector, _ = fault_injection.build(settings.faults, settings.generation.seed, self._fault_hooks)
        self.links.set_gates(self.injector.flowing, self.injector.outputs_flowing)
        #: Which faults fired, by kind (faults.Faults; the `fault_*` counters).
        self.faults = self.injector.faults
        self._on_crash = on_crash
        #: Set by --fault-crash: this engine is gone.
        self.crashed = False
        #: The configuration generation this engine runs with (1: as started).
        self.generation = 1
        #: A reload waiting for the stepper (taken between two steps).
        self._pending: Optional[Reconfiguration] = None
        # -- KV-cache events (kv_publisher.py): None unless --kv-events-config enables them --
        self.kv_events: Optional[kv_event_publisher.KVEventPublisher] = None
        events_config = process.kv_events_config
        if events_config is not None and events_config.enabled:
            # the format of the frontend's era, read per batch: `auto` learns it from the first ADD
            self.kv_events = kv_event_publisher.KVEventPublisher(
                ctx, events_config, rank, settings.kv.block_size, self.log, self.throttle, lambda: self.faults,
                lambda: kv_events.EventFormat.of(self.wire.layout),
            )
            # Bound now, so that an endpoint in use fails at start
            # (kv_event_publisher.BindError), and before the handshake: the
            # ready response names the endpoints.
            self.kv_events.bind()

    @property
    def bad_frames(self) -> int:
        """Frames dropped because they could not be decoded."""
        return self.incidents.bad_frames

    @property
    def contained_failures(self) -> int:
        """Failures contained without stopping the engine (transport.Incidents)."""
        return self.incidents.contained_failures

    # -- startup ---------------------------------------------------------------

    def start(self) -> None:
        """Start the KV event publisher, if any, then spawn the handshake; it
        spawns the serving greenlets when done."""
        if self.kv_events is not None:
            self.kv_events.start(self.supervisor.spawn)
        self.handshake = self.supervisor.spawn(f"engine-{self.rank}-handshake", self._handshake)

    def ready_response(self, init: InitMessage) -> Dict[str, Any]:
        """The registration map (§2.5): full 0.33 key set, correct types."""
        instance_id = f"gmock-{socket.gethostname()}-{os.getpid()}-{self.rank}"
        kv_events_config = self.kv_events.config.ready_map() if self.kv_events is not None else None
        return engine_ready_response(self.config, init, self.wire.layout, self.rank, instance_id, kv_events_config)

    def ready_message(self, init: InitMessage) -> Dict[str, Any]:
        return engine_ready_message(self.config, init)

    def engine_settings(
        self, settings: parts.Settings, num_clients: int, has_coordinator: bool, token_source: Optional[tokens.TokenSource] = None
    ) -> EngineSettings:
        """The engine's settings from the typed parts of config/settings.py (at the
        handshake, and for a reload); `token_source` given: that one, else
        made from `settings` (a token file is read here: OSError or
        ValueError if it cannot be)."""
        return parts.engine_settings(settings, self.rank, num_clients, has_coordinator, self.wire, token_source)

    def _handshake(self) -> None:
        self.sockets, init = transport.join_frontend(
            self.watch.context(self.ctx), self.rank, self.parts.process.handshake_address, self.ready_response, self.ready_message,
            on_init=lambda init: self.got_init.set(),
        )
        # From here to the end no greenlet runs in between: a reload meanwhile
        # found this engine not joined and changed `config`, `parts` and the injector.
        self.engine = EngineCore(self.engine_settings(self.parts, len(init.outputs), init.has_coordinator))
        # structured answers are made off the loop (core/grammar_wait.py), their outcomes come back as input
        self.engine.grammar_executor = grammar_pool.ThreadedExecutor(self.supervisor.spawn, self.links.deliver, self.links.wake)
        if self.engine.settings.tokenizer is not None:
            grammar_pool.warm(self.engine.settings.tokenizer)
        self.engine.stats_provider = self.runtime_stats
        self.links.engine = self.engine  # `paced` reads its latency model as it is now
        spawn = self.supervisor.spawn
        reader = transport.Reader(self.links, self.wire, self.incidents, self.throttle)
        for index, sock in enumerate(self.sockets.inputs):
            name = f"engine-{self.rank}-reader-{index}"
            self.readers.append(spawn(name, reader.run, sock, f"input[{index}]", decode_input))
        if self.sockets.coordinator_input is not None:
            name = f"engine-{self.rank}-coordinator-reader"
            self.readers.append(
                spawn(name, reader.run, self.sockets.coordinator_input, "coordinator_input", decode_coordinator)
            )
        self.stepper = spawn(f"engine-{self.rank}-stepper", self._stepper)
        self.watch.attach(self.sockets)
        self.watcher = spawn(f"engine-{self.rank}-frontend-watch", self.watch.run)
        self.stall_watcher = spawn(f"engine-{self.rank}-link-stalls", self.watch.run_stalls)
        sender = transport.Sender(self.links, self.sockets, self.wire, self.incidents, self.throttle)
        self.sender = spawn(f"engine-{self.rank}-sender", sender.run)
        self.links.attach_sender(sender.send_now, sender.encode)
        fire_timed = self.injector.joined(self.engine, time.monotonic())
        if fire_timed is not None:
            self.fault_timer = spawn(f"engine-{self.rank}-fault-timer", fire_timed)
        self.joined.set()

    # -- the stepper (the readers and the sender: transport.py) ------------------

    def _stepper(self) -> None:
        """Owns the EngineCore: apply input, step, hand outputs to the sender.

        It sleeps on `links.woken`, which the readers set after queueing
        input (`wake`) and the step timer sets when a step is due, so an idle engine costs no
        CPU and input is applied while the engine waits for its next step.

        Unpaced (no latency model) steps run back to back. Paced, the engine
        says when its next step is due (timing/latency.py: the step time grows with
        the batch and its prefill); how late each step starts against that
        is recorded as step lateness. With a latency profile, a step that
        starts late by less than its own time is counted from when it was
        due (`cadence_base`), so the next one comes sooner and the engine
        keeps its cadence, as a GPU's queued steps do (and the emulated GPU,
        benchmarks/emulated_gpu/): a wake-up the machine's load delayed does
        not lengthen every step; a step later than that counts from its
        actual start. The flat model (--itl-ms) counts every step from its
        actual start: its interval is a floor between two steps.
        """
        engine, links = self.engine, self.links
        woken = links.woken
        input_open = links.input_open  # closed by a hang (--fault-hang); the same after a reload
        stretched = self.injector.next_step_at  # slow-steps (--fault-slow-steps)
        paced = engine.latency.paced
        # a latency profile (a GPU's steps) keeps its cadence; the flat --itl-ms
        # model keeps its interval as a floor between two steps
        cadenced = paced and engine.latency.profile is not None
        clock = time.monotonic
        timer = StepTimer(links.wake)
        # KV events: the step's (and the inputs') events go to the publisher
        # greenlet as one batch; None when off (one check per round)
        publish = self.kv_events.put if self.kv_events is not None else None
        next_step_at: Optional[float] = None
        started = 0.0  # when the last step started
        yielded = 0.0  # when the stepper last gave the hub a round
        idle = True  # no work since the last step: the frontend watch rests
        in_queue, out_queue = links.input_queue, links.output_queue
        try:
            while True:
                if not input_open():
                    links.wait_input_open()
                    # The hang is over: the readers (waiting on the same
                    # gate) take in what came during it before the next
                    # step, as vLLM's input thread would have queued it.
                    gevent.idle()
                if self._pending is not None:
                    # A reload, between two steps (a hung engine takes it
                    # when the hang is over): the next step is timed by the
                    # new latency model and fault layer.
                    self._reconfigure()
                    stretched = self.injector.next_step_at
                    paced = engine.latency.paced
                    cadenced = paced and engine.latency.profile is not None
                    if next_step_at is not None:
                        next_step_at = stretched(started, engine.next_step_time(started))
                # Apply what is queued before the next step (a slice of
                # it), so an ABORT or a new request takes effect at once.
                # Paced, the drain goes on between steps until one is due:
                # slices larger than INPUT_SLICE would only make steps late.
                applied = not in_queue.empty()
                if not applied:
                    more_input = False
                elif paced:
                    more_input = self._drain_input(INPUT_SLICE)
                else:
                    more_input = self._drain_input(max(INPUT_SLICE, engine.num_running // INPUT_SLICE_DIVISOR))
                if applied and next_step_at is not None and engine.has_work:
                    # Input may let the next step come sooner: a step put off
                    # until a prefill (or a replayed output, --replay) is due
                    # admits a new request at the latency model's time instead
                    # (Scheduler.next_step_time).
                    sooner = stretched(started, engine.next_step_time(started))
                    if sooner is not None and sooner < next_step_at:
                        next_step_at = sooner
                if publish is not None:
                    publish(engine.take_kv_events())  # e.g. reset_prefix_cache's AllBlocksCleared, at once
                if not input_open():
                    continue  # an input hung the engine: no step
                if not engine.has_work:
                    next_step_at = None  # idle: the next work starts a step at once
                    if more_input:
                        continue  # the rest of the input first (wake may be clear)
                    idle = True
                    woken.wait()
                    woken.clear()
                    continue
                if idle:
                    idle = False
                    self.watch.wake()  # it reads the connections while there is work
                now = clock()
                if next_step_at is not None and now < next_step_at:
                    if more_input:
                        gevent.idle()
                        continue  # the step is not due: take more input meanwhile
                    timer.arm(next_step_at)
                    woken.wait()
                    woken.clear()
                    continue  # input may have arrived: drain, then check the time
                due = next_step_at
                if paced and due is not None:
                    self.step_lateness.add(now - due)
                try:
                    out = engine.step()
                except LedgerViolation:
                    raise  # --strict-ledger: meant to stop the process
                except Exception as exc:  # noqa: BLE001 - contained: the requests of this step fail, the engine goes on
                    out = self._contain("step", None, exc)
                self._emit(out)
                if publish is not None:
                    publish(engine.take_kv_events())
                # Unpaced this is `now` (steps back to back) unless every
                # running request waits for its prefill (e.g. mock_ttft_ms).
                started = cadence_base(now, due, engine.step_delay) if cadenced else now
                next_step_at = stretched(started, engine.next_step_time(started))
                # Yield to the hub between rounds: readers and the sender run.
                # Not sleep(0): gevent runs ready callbacks (each sleep(0) is one)
                # for up to its switch interval, 5 ms, before it polls the
                # sockets again, so back-to-back steps left new ADDs unread for
                # up to 5 ms (TTFT). gevent.idle() returns after one
                # loop iteration with its socket poll; the readers yield when
                # their socket is empty or the input queue is full, so the
                # stepper is never starved.
                # A hub round (its poll, two switches) costs more than a step
                # of a few requests. Back-to-back steps yield at
                # most every YIELD_INTERVAL_S (new input waits that long at
                # most), and at once when the sender has a backlog.
                if now - yielded >= YIELD_INTERVAL_S or not out_queue.empty():
                    gevent.idle()
                    yielded = clock()
        finally:
            timer.close()

    # -- reloads (SIGHUP) ----------------------------------------------------------

    def reconfigure(self, change: Reconfiguration) -> None:
        """Hand this engine a reload. Joined, its stepper takes it between two
        steps (a hung engine when the hang is over); still in its handshake,
        it starts with the new configuration; crashed, nothing is left to
        change. A later reload before the stepper took this one replaces it
        (each carries the whole configuration)."""
        if self.crashed:
            return
        self.config = change.config
        if change.parts is not None:
            self.parts = change.parts
        if self.engine is None:
            if change.faults is not None:
                self._rebuild_faults(change)
            self.generation = change.generation
            return
        if self._pending is not None and self._pending.faults is not None and change.faults is None:
            # the one waiting rebuilds the fault layer; this one keeps the specs it brought
            change = Reconfiguration(change.generation, change.config, change.settings, self._pending.faults, change.parts)
        self._pending = change
        self.links.wake()

    def token_source(self) -> Optional[tokens.TokenSource]:
        """The token source of new requests, or of the reload waiting for the
        stepper (None: not joined)."""
        if self._pending is not None and self._pending.settings is not None:
            return self._pending.settings.token_source
        return self.engine.settings.token_source if self.engine is not None else None

    def _reconfigure(self) -> None:
        """The stepper takes the pending reload (between two steps)."""
        change, self._pending = self._pending, None
        assert change is not None and change.settings is not None and self.engine is not None
        self.engine.reconfigure(change.settings)
        if change.faults is not None:
            fire_timed = self._rebuild_faults(change)
            if self.fault_timer is not None:
                self.fault_timer.kill(block=False)  # it sleeps until its next at=; the new one takes over
            self.fault_timer = None
            if fire_timed is not None:
                self.fault_timer = self.supervisor.spawn(f"engine-{self.rank}-fault-timer", fire_timed)
        self.generation = change.generation
        self.log.debug("engine {} runs configuration generation {}", self.rank, change.generation)

    def _rebuild_faults(self, change: Reconfiguration) -> Optional[Callable[[], None]]:
        """The fault layer in place of the current one, with the specs
        `change` brings (the engine's, when joined); its timer loop or None."""
        self.injector, fire_timed = fault_injection.build(
            change.faults, self.parts.generation.seed, self._fault_hooks, previous=self.injector, now=time.monotonic(), engine=self.engine
        )
        self.faults = self.injector.faults
        return fire_timed

    def _drain_input(self, budget: int) -> bool:
        """Apply up to `budget` queued messages, in order; True when some
        are left for the next round."""
        in_queue, apply, emit = self.links.input_queue, self.engine.apply, self._emit
        on_input, input_open = self.injector.on_input, self.links.input_open
        while not in_queue.empty() and input_open():
            if not budget:
                return True
            budget -= 1
            message = in_queue.get_nowait()
            try:
                # The fault layer may change the input, or answer it itself
                # (a failed utility call): then it is not applied.
                message, out = on_input(message)
                if message is not None:
                    out = apply(message)
            except LedgerViolation:
                raise  # --strict-ledger: meant to stop the process
            except Exception as exc:  # noqa: BLE001 - contained to this input
                out = self._contain("input", message, exc)
            emit(out)

    def _contain(self, what: str, message: Any, exc: Exception) -> List[Outbound]:
        """An input (or a step) whose processing raised: logged with its
        traceback (rate-limited) and answered with errors, so that only the
        requests it concerned fail. A failure of this answer itself is one
        of the engine, and stops the process."""
        self.incidents.contained_failures += 1
        name = type(message).__name__ if message is not None else "step"
        self.throttle.warning("contained failure", "{} {} failed; answered with errors, the engine goes on", what, name, exception=True)
        if message is None:
            return self.engine.fail_all(f"gmock_engine failed in a step ({type(exc).__name__}: {str(exc):.200})")
        return self.engine.answer_failure(message, exc)

    def _vanish(self) -> None:
        """--fault-crash (the fault layer calls this): the engine vanishes,
        no goodbye, queued outputs dropped, sockets closed. The App ends the
        process when no engine is left. Does not return: the calling stage
        ends here, quietly."""
        self.crashed = True
        self._on_crash(self)  # does not return if this was the process's last engine
        current = gevent.getcurrent()
        stages = [*self.readers, self.fault_timer, self.stepper, self.sender, self.watcher, self.stall_watcher]
        greenlets = [g for g in stages if g is not None and g is not current]
        gevent.killall(greenlets, block=True, timeout=KILL_TIMEOUT_S)
        self.watch.close()
        if self.sockets is not None:
            self.sockets.close(output_linger_ms=0)
        if self.kv_events is not None:  # a crashed engine publishes nothing more
            gevent.killall(self.kv_events.greenlets, block=True, timeout=KILL_TIMEOUT_S)
            self.kv_events.close_sockets()
        raise gevent.GreenletExit

    def runtime_stats(self, restart_window: bool = False) -> Dict[str, Any]:
        """Figures only the runtime knows, for the gmock_stats utility;
        `restart_window`: the step lateness starts a new window after this."""
        figures = {
            "pid": os.getpid(),
            "bad_frames": self.bad_frames,
            "step_lateness_us": self.step_lateness.summary(scale=1e6),
            "contained_failures": self.contained_failures,
            "input_queue": self.links.input_queue.qsize(),
            "output_queue": self.links.output_queue.qsize(),
            "faults": self.faults.summary(),
            "config_generation": self.generation,
            **(self.kv_events.summary() if self.kv_events is not None else {}),
        }
        if restart_window:
            self.step_lateness.restart()
        return figures

    def _emit(self, messages: List[Outbound]) -> None:
        """Pack a batch and send it, or queue it for the sender, as the fault
        layer lets it go (once per batch, never per output: this is the
        per-token path)."""
        links = self.links
        out_queue, send_now, encode = links.output_queue, links.send_now, links.encode
        for client, message in self.injector.on_outputs(messages):
            # Encoded here, as it is made: the engine reuses its steady
            # outputs' lists in the next step (EngineSettings.reuse_outputs).
            data = encode(message)
            if data is None:
                continue  # it carried only requests the sender cut (wire.outputs.salvage)
            item = (client, data)
            # the sender idle and nothing queued: sent from here, at once
            # (transport.Sender.send_now); else queued, in order
            if not (out_queue.empty() and send_now(item)):
                links.queue_output(item)

    def counters(self) -> Dict[str, int]:
        """The engine's books: its ledger summary (started, finished by
        reason, active, violations, ...) plus steps, tokens, utility calls,
        bad frames, faults fired and KV events."""
        counts: Dict[str, int] = {"bad_frames": self.bad_frames, "contained_failures": self.contained_failures}
        if self.engine is not None:
            counts.update(self.engine.ledger.summary())
            for key in ("steps", "tokens", "utility_calls", "preemptions", "rejected"):
                counts[key] = self.engine.counters[key]
        counts.update(self.faults.summary())
        if self.kv_events is not None:
            counts.update(self.kv_events.summary())
        return counts

    # -- shutdown ------------------------------------------------------------------

    def input_greenlets(self) -> List[gevent.Greenlet]:
        """Stage 1 of shutdown stops these: the handshake (if still waiting),
        the readers, the timed faults, the stepper and the frontend watch
        (before the sockets close: their closing is no frontend going)."""
        stages = [self.handshake, *self.readers, self.fault_timer, self.stepper, self.watcher, self.stall_watcher]
        return [g for g in stages if g is not None]

    def request_drain(self, finish: bool) -> None:
        """Ask the stepper to end (or finish) everything (--on-stop)."""
        if self.engine is not None and not self.crashed:
            self.links.deliver(Drain(finish))
            self.links.wake()

    @property
    def drained(self) -> bool:
        """Nothing running or waiting, and nothing left to send; or nothing
        that can be waited for (crashed, or hung: --fault-*)."""
        if self.engine is None or self.crashed or self.injector.hung:
            return True
        return self.engine.num_active == 0 and self.links.output_queue.empty() and self.links.input_queue.empty()

    def flush_output(self, send_dead: bool = False) -> None:
        """Stage 2, at most SENDER_FLUSH_TIMEOUT_S + KILL_TIMEOUT_S: let the
        sender send what is queued, end it, then push the dead-engine
        sentinel if asked (§4.1). What could not go out in time is said in
        the log, never dropped silently."""
        if self.sender is None or self.crashed:
            return
        deadline = time.monotonic() + SENDER_FLUSH_TIMEOUT_S
        if not self.sender.dead:
            try:
                self.links.output_queue.put(transport.STOP, timeout=SENDER_FLUSH_TIMEOUT_S)
            except gevent.queue.Full:
                pass
            self.sender.join(timeout=max(0.0, deadline - time.monotonic()))
            if not self.sender.dead:
                self.log.warning(
                    "outputs not flushed within {:g} s (the frontend is not reading): {} queued message(s) dropped",
                    SENDER_FLUSH_TIMEOUT_S,
                    self.links.output_queue.qsize(),
                )
                self.sender.kill(block=True, timeout=KILL_TIMEOUT_S)
        if send_dead:
            self.sockets.send_dead(self.log)

    def close(self) -> None:
        """Stage 3: close the sockets (outputs linger, bounded); the KV event
        publisher sends what it has queued first (bounded too)."""
        if self.kv_events is not None and not self.crashed:
            self.kv_events.close()
        self.watch.close()  # the monitors first (also when the handshake failed)
        if self.sockets is not None and not self.crashed:
            self.sockets.close()

