"""The process-level wiring: all engines of one gmock_engine process.

`App` owns the ZMQ context, the `Supervisor` and one `runner.EngineRunner`
per engine (DP rank), and everything that concerns them together: building
and starting them (and the metrics endpoint, the summary line, the heap
trim), the --fault-crash exit when no engine is left, reloads, and the end:
each engine's life (engine_life.py: its drain and ordered, bounded
shutdown) runs in a greenlet of its own, and the App waits for them all.

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
from gmock_engine.runtime import engine_life, frontend_hint, frontend_link, grammar_pool, kv_publisher
from gmock_engine.utils import logs
from gmock_engine.config import reload
from gmock_engine.config.settings import Settings, from_config
from gmock_engine.wire.eras import Wire
from gmock_engine.config.reload import Reconfiguration
from gmock_engine.runtime.runner import KILL_TIMEOUT_S, EngineRunner
from gmock_engine.runtime.supervisor import Supervisor

#: How long the ordered shutdown waits for a structured answer still being
#: made in the grammar pool's thread (the warm-up of a large vocabulary, a
#: compile within --grammar-timeout-ms).
GRAMMAR_SETTLE_S = 5.0

#: How often freed heap memory is handed back to the OS (glibc malloc_trim).
HEAP_TRIM_INTERVAL_S = 60.0


class StartError(Exception):
    """The process could not start as configured: `flag` names the option
    (cli.py says so and exits with status 2)."""

    def __init__(self, flag: str, message: str) -> None:
        super().__init__(message)
        self.flag = flag


class App:
    """All engines of this process, their supervisor and the ZMQ context.

    `settings` are what the settings stage made of `config`, the parsed
    options (config/parsed.py): the App runs by them (`run`). It keeps
    `config` only for what goes on from the parsed options: a reload
    compares what `load` reads again with them (cli.py gives the loader
    bound to the process's command line, config.reader), and READY reports
    them as configured (runner.py)."""

    def __init__(self, settings: Settings, config: Any, load: Optional[Callable[[], Any]] = None) -> None:
        #: The parsed options in force (a reload compares with them).
        self.config = config
        self.load = load
        #: The settings in force: the engines' typed parts and the process's; a reload makes them anew.
        self.settings = settings
        self.ctx = zmq.Context()
        self.supervisor = Supervisor()
        #: The wire layout of every engine of the process, and the engines, once `run` built them.
        self.wire: Optional[Wire] = None
        self.runners: List[EngineRunner] = []
        self.metrics_server: Optional[Any] = None
        #: Set once `run` started every engine.
        self.started = gevent.event.Event()
        #: The configuration generation: 1 as started, +1 per reload that took.
        self.generation = 1
        #: When the configuration in force was read (time.time()).
        self.loaded_at = time.time()
        #: Reloads by result: "applied" or "refused".
        self.reloads: Counter = Counter()
        self._reload_wanted = gevent.event.Event()
        self.summary: Optional[gevent.Greenlet] = None

    def run(self) -> int:
        """Build and start every engine, serve until stop() or a failure, then
        close; the exit status (1 after a failure).

        Start-up raises StartError (nothing served then) when the KV event
        sockets or the metrics endpoint cannot listen. Each engine lives in a
        supervised greenlet (engine_life.live): after the stop it drains as
        --on-stop says and shuts down in order, bounded; the App waits for
        every life, then ends the greenlets left and the ZMQ context."""
        process = self.settings.process
        #: One layout for all engines of the process: they serve one frontend (§8.2).
        self.wire = Wire.from_setting(process.protocol_version, logger.info)
        try:
            self.runners = [
                EngineRunner(self.ctx, self.supervisor, rank, self.config, self.settings, self.wire, self._on_crash, self._on_frontend_gone)
                for rank in process.ranks
            ]
            if process.metrics_port is not None:
                from gmock_engine.runtime import metrics  # prometheus_client only when asked for

                try:
                    self.metrics_server = metrics.server(process.metrics_host, process.metrics_port, self.runners, self)
                except OSError as exc:
                    where = f"{process.metrics_host}:{process.metrics_port}"
                    raise StartError("--metrics-port", f"cannot listen on {where}: {exc}") from exc
        except (kv_publisher.BindError, StartError) as exc:
            # Nothing was served: close what was opened, so the process can exit.
            for runner in self.runners:
                runner.close()
            self.ctx.destroy(linger=0)
            if isinstance(exc, StartError):
                raise
            raise StartError("--kv-events-config", str(exc)) from exc
        if self.metrics_server is not None:
            self.supervisor.spawn("metrics-server", self.metrics_server.serve_forever)
        lives = [self.supervisor.spawn(f"engine-{r.rank}-life", engine_life.live, r, self.supervisor, process) for r in self.runners]
        interval = self.settings.logging.summary_interval
        if interval:
            self.summary = self.supervisor.spawn("summary", summary_loop, self, interval)
        self.supervisor.spawn("config-reloader", self._reloader)
        self.supervisor.spawn("no-frontend-hint", frontend_hint.hint_if_no_frontend, self.runners, self.config)
        trim = _malloc_trim()
        if trim is not None:
            self.supervisor.spawn("heap-trim", _trim_heap, trim, HEAP_TRIM_INTERVAL_S)
        self.started.set()

        self.supervisor.stop_event.wait()
        if self.metrics_server is not None:
            self.metrics_server.stop(timeout=KILL_TIMEOUT_S)
        gevent.joinall(lives, timeout=engine_life.life_after_stop_s(process) + KILL_TIMEOUT_S)
        # Everything is closed with a bounded linger, so term() returns.
        self.supervisor.group.kill(block=True, timeout=KILL_TIMEOUT_S)
        self.ctx.term()
        if not grammar_pool.settle(GRAMMAR_SETTLE_S):
            logger.warning("a structured answer is still being made in a thread after {:g} s; the process ends without waiting for it", GRAMMAR_SETTLE_S)
        return 1 if self.supervisor.failure else 0

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
            if parts.logging.summary_interval:
                self.summary = self.supervisor.spawn("summary", summary_loop, self, parts.logging.summary_interval)
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
        """One line per engine: its ledger and counters (SIGUSR1, --summary-interval;
        each engine's life logs its own at shutdown)."""
        for runner in self.runners:
            engine_life.log_books(runner.rank, runner.counters())

    def wait_joined(self, timeout: Optional[float] = None) -> bool:
        """True once every engine finished its handshake."""
        return all(r.joined.wait(timeout) for r in self.runners)

    def stop(self) -> None:
        """Stop the process: every engine drains (--on-stop) and shuts down."""
        self.supervisor.stop()

    def counters(self) -> Dict[int, Dict[str, int]]:
        """Every engine's books by rank (EngineRunner.counters)."""
        return {runner.rank: runner.counters() for runner in self.runners}


def summary_loop(app: App, interval: float) -> None:
    """Log one line of every engine's books every `interval` seconds (long runs)."""
    while True:
        gevent.sleep(interval)
        app.log_summary()


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
