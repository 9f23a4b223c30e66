"""The process-level wiring: all engines of one gmock_engine process.

`App` owns the ZMQ context, the `Supervisor` and one `runner.EngineRunner`
per engine (DP rank), and everything that concerns them together: starting
them (and the metrics endpoint, the summary line, the heap trim), the
--fault-crash exit when no engine is left, reloads, the drain (--on-stop)
and the ordered, bounded shutdown.

The App is the last stage of start-up (argv -> parsed options -> settings
-> app, cli.py): it takes the settings made from the parsed options and
runs by them (the process's part: ranks, metrics, the drain, the shutdown),
and each engine's EngineSettings are made from them at its handshake.

A reload (SIGHUP: cli.py sets `App.request_reload`; config/reload.py decides
what changed) runs in the App's `config-reloader` greenlet. It re-enters
the pipeline at the parsed options, read again by the loader stage that
cli.py handed over (`load`), and builds the settings anew
(settings.from_config) and every
engine's new EngineSettings first (so a token file that cannot be read refuses
the reload before anything changed), then hands each runner a
`Reconfiguration`, which its stepper takes between two steps: the engine's
settings and, when the --fault-* specs changed, a rebuilt fault layer.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from typing import Any, Callable, Dict, List, Optional

import gevent
import gevent.event
import zmq.green as zmq
from loguru import logger

from gmock_engine.faults import specs as faults
from gmock_engine.runtime import frontend_link
from gmock_engine.utils import logs
from gmock_engine.config import reload
from gmock_engine.config.settings import Settings, from_config
from gmock_engine.wire.eras import Wire
from gmock_engine.config.reload import Reconfiguration
from gmock_engine.runtime.runner import KILL_TIMEOUT_S, SENDER_FLUSH_TIMEOUT_S, EngineRunner
from gmock_engine.runtime.supervisor import Supervisor

#: How long an abort drain may take to get its outputs out.
DRAIN_ABORT_TIMEOUT_S = 2.0

#: How often freed heap memory is handed back to the OS (glibc malloc_trim).
HEAP_TRIM_INTERVAL_S = 60.0


class App:
    """All engines of this process, their supervisor and the ZMQ context.

    `settings` are what the settings stage made of `config`, the parsed
    options (config/parsed.py): the App runs by them. It keeps `config`
    only for what goes on from the parsed options: a reload compares what
    `load` reads again with them (cli.py gives the loader bound to the
    process's command line, config.reader), and READY reports them as
    configured (runner.py)."""

    def __init__(self, settings: Settings, config: Any, load: Optional[Callable[[], Any]] = None) -> None:
        #: The parsed options in force (a reload compares with them).
        self.config = config
        self.load = load
        #: The settings in force: the engines' typed parts and the process's; a reload makes them anew.
        self.settings = settings
        process = settings.process
        #: One layout for all engines of the process: they serve one frontend (§8.2).
        self.wire = Wire.from_setting(process.protocol_version, logger.info)
        self.ctx = zmq.Context()
        self.supervisor = Supervisor()
        self.metrics_server: Optional[Any] = None
        #: The configuration generation: 1 as started, +1 per reload that took.
        self.generation = 1
        #: When the configuration in force was read (time.time()).
        self.loaded_at = time.time()
        #: Reloads by result: "applied" or "refused".
        self.reloads: Counter = Counter()
        self._reload_wanted = gevent.event.Event()
        self.summary: Optional[gevent.Greenlet] = None
        self.runners = [
            EngineRunner(self.ctx, self.supervisor, rank, config, settings, self.wire, self._on_crash, self._on_frontend_gone)
            for rank in process.ranks
        ]

    def _on_crash(self, runner: EngineRunner) -> None:
        """--fault-crash: when no engine of this process is left, the process
        exits at once, as a crashed engine process would: no goodbye, no flush."""
        if all(r.crashed for r in self.runners):
            logger.critical("every engine of this process crashed (injected); exiting with status {}", faults.CRASH_EXIT_STATUS)
            os._exit(faults.CRASH_EXIT_STATUS)

    def _on_frontend_gone(self) -> None:
        """--exit-when-frontend-gone: an engine's frontend has been gone that
        long; once every joined engine's has (crashed ones aside), stop as
        SIGTERM does: the ordinary ordered shutdown, exit status 0."""
        limit = self.settings.process.exit_when_frontend_gone
        links = [r.watch.link for r in self.runners if not r.crashed]
        if limit is not None and frontend_link.expired(links, limit, time.monotonic()):
            logger.warning("the frontend has been gone for {:g} s or more (--exit-when-frontend-gone); stopping", limit)
            self.stop()

    def start(self) -> None:
        """Bind the metrics endpoint (OSError if it cannot), then start every engine."""
        c = self.settings.process
        if c.metrics_port is not None:
            from gmock_engine.runtime import metrics  # prometheus_client only when asked for

            self.metrics_server = metrics.server(c.metrics_host, c.metrics_port, self.runners, self)
            self.supervisor.spawn("metrics-server", self.metrics_server.serve_forever)
        for runner in self.runners:
            runner.start()
        self._start_summary(self.settings.logging.summary_interval)
        self.supervisor.spawn("config-reloader", self._reloader)
        trim = _malloc_trim()
        if trim is not None:
            self.supervisor.spawn("heap-trim", _trim_heap, trim, HEAP_TRIM_INTERVAL_S)

    def _start_summary(self, interval: float) -> None:
        if interval:
            from gmock_engine.runtime.metrics import summary_loop

            self.summary = self.supervisor.spawn("summary", summary_loop, self, interval)

    # -- reloads (SIGHUP) ----------------------------------------------------------

    def request_reload(self) -> None:
        """Ask for a reload (cli.py's SIGHUP handler: it only sets this)."""
        self._reload_wanted.set()

    def _reloader(self) -> None:
        while True:
            self._reload_wanted.wait()
            self._reload_wanted.clear()
            self.reload()

    def reload(self) -> bool:
        """Read the configuration again and apply what may change (config/reload.py).

        One log line names every change (old -> new, source); one warning the
        options that cannot change. A bad file or value changes nothing: an
        error line says why, and the engines go on as they were. Every
        engine's settings are built before any is handed over, so a reload
        is refused whole or taken whole; each engine's stepper takes its
        share between two steps. True when it took."""
        if self.load is None:
            logger.warning("config reload: this process has no configuration to read again")
            return False
        found = reload.check(self.config, self.load)
        if found.error is None:
            try:
                parts = from_config(found.config)
                plans = self._plan(found, parts)
            except (OSError, ValueError) as exc:  # e.g. a token file gone since the check
                found = reload.refused(f"{type(exc).__name__}: {exc}")
        process = self.settings.process
        engines = f"engines {process.first_rank}..{process.first_rank + process.engine_count - 1}"
        if found.error is not None:
            self.reloads["refused"] += 1
            logger.error(found.refused_line(self.generation, engines))
            return False
        generation = self.generation + 1
        logger.info(found.line(generation, engines))
        if found.fixed:
            logger.warning(reload.fixed_line(found.fixed))
        new = found.config
        if found.changed(("log_level", "log_json")):
            logs.set_level(parts.logging.log_level, parts.logging.log_json)
        if found.changed(("summary_interval",)):
            if self.summary is not None:
                self.summary.kill(block=False)
                self.summary = None
            self._start_summary(parts.logging.summary_interval)
        self.config = new
        self.settings = parts
        self.generation = generation
        self.loaded_at = time.time()
        self.reloads["applied"] += 1
        specs = list(parts.faults) if found.changed(reload.FAULTS) else None
        for runner, engine in plans:
            runner.reconfigure(Reconfiguration(generation, new, engine, specs, parts))
        return True

    def _plan(self, found: "reload.Reload", parts: Settings) -> List[Any]:
        """(runner, its new EngineSettings from `parts`, or None if not
        joined) for every engine not crashed. A token source is made afresh
        only when its options changed, so that running requests keep the
        fast path."""
        new_tokens = found.changed(("token_source", "token_id_range"))
        plans = []
        for runner in self.runners:
            if runner.crashed:
                continue
            engine = None
            if runner.engine is not None:
                known = runner.engine.settings
                source = None if new_tokens else runner.token_source()
                engine = runner.engine_settings(parts, known.num_clients, known.has_coordinator, source)
            plans.append((runner, engine))
        return plans

    def log_summary(self) -> None:
        """One line per engine: its ledger and counters (shutdown, SIGUSR1, --summary-interval)."""
        for rank, counts in self.counters().items():
            logger.bind(engine=rank).info(
                "engine {} summary: {}", rank, " ".join(f"{k}={v}" for k, v in sorted(counts.items())) or "no requests"
            )

    def wait_joined(self, timeout: Optional[float] = None) -> bool:
        """True once every engine finished its handshake."""
        return all(r.joined.wait(timeout) for r in self.runners)

    def run_until_stopped(self) -> int:
        """Block until stop() or a failure; drain if configured; shut down in
        order; exit status."""
        self.supervisor.stop_event.wait()
        if self.supervisor.failure is None and self.settings.process.on_stop != "exit":
            self.drain()
        self.shutdown()
        return 1 if self.supervisor.failure else 0

    def drain(self) -> None:
        """--on-stop abort | finish: end what is in flight before stopping.

        finish waits up to --drain-timeout for every request to end, then
        aborts the rest; abort ends them all at once. The frontends get an
        output for every request either way, so no stream is left hanging.
        """
        process = self.settings.process
        finish = process.on_stop == "finish"
        logger.info("draining: {} in-flight requests", "finishing" if finish else "aborting")
        for runner in self.runners:
            runner.request_drain(finish)
        if finish and not self._wait_drained(process.drain_timeout):
            logger.warning("drain timeout ({} s) reached; aborting what is left", process.drain_timeout)
            for runner in self.runners:
                runner.request_drain(False)
        if not self._wait_drained(DRAIN_ABORT_TIMEOUT_S):
            logger.warning("engines not drained after aborting; stopping anyway")

    def _wait_drained(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not all(r.drained for r in self.runners):
            if time.monotonic() > deadline or self.supervisor.failure is not None:
                return False
            gevent.sleep(0.01)
        return True

    def stop(self) -> None:
        self.supervisor.stop()

    def shutdown(self) -> None:
        """Ordered and bounded: readers+steppers, senders flush, sockets, context."""
        if self.metrics_server is not None:
            self.metrics_server.stop(timeout=KILL_TIMEOUT_S)
        inputs = [g for r in self.runners for g in r.input_greenlets()]
        gevent.killall(inputs, block=True, timeout=KILL_TIMEOUT_S)
        flushers = [gevent.spawn(r.flush_output, self.settings.process.send_dead_on_exit) for r in self.runners]
        gevent.joinall(flushers, timeout=SENDER_FLUSH_TIMEOUT_S + 2 * KILL_TIMEOUT_S)
        # No sender may still be in `send` when its socket closes (a ZMQError
        # there would turn a clean stop into a failure).
        gevent.killall(flushers, block=True, timeout=KILL_TIMEOUT_S)
        gevent.killall([r.sender for r in self.runners if r.sender is not None], block=True, timeout=KILL_TIMEOUT_S)
        for runner in self.runners:
            runner.close()
        # Everything is closed with a bounded linger, so term() returns.
        self.supervisor.group.kill(block=True, timeout=KILL_TIMEOUT_S)
        self.ctx.term()

    def counters(self) -> Dict[int, Dict[str, int]]:
        """Per-rank ledger summary (started, finished by reason, active,
        violations, ...) plus steps, tokens, utility calls and bad frames."""
        out = {}
        for runner in self.runners:
            counts: Dict[str, int] = {"bad_frames": runner.bad_frames, "contained_failures": runner.contained_failures}
            if runner.engine is not None:
                engine = runner.engine
                counts.update(engine.ledger.summary())
                for key in ("steps", "tokens", "utility_calls", "preemptions", "rejected"):
                    counts[key] = engine.counters[key]
            counts.update(runner.faults.summary())
            if runner.kv_events is not None:
                counts.update(runner.kv_events.summary())
            out[runner.rank] = counts
        return out


def _malloc_trim() -> Optional[Callable[[int], int]]:
    """glibc's malloc_trim, or None (another libc)."""
    import ctypes

    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None


def _trim_heap(trim: Callable[[int], int], interval: float) -> None:
    """Hand freed heap pages back to the OS every `interval` seconds.

    glibc keeps memory that was freed (message buffers, finished requests)
    mapped, so a long run's RSS rises in steps to its high-water mark and
    stays there; a soak reading RSS for leaks then sees growth that is not
    held by anything. One malloc_trim(0) returns that free heap, and the
    call is cheap enough to make at a soak's pace.
    """
    while True:
        gevent.sleep(interval)
        trim(0)
