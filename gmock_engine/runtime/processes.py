"""--processes N: engine ranks spread over N worker processes, supervised.

gevent runs on one core. To use more, the parent starts N copies of this
program, each with its slice of ranks (`--data-parallel-start-rank`,
`--engine-count`) and its own hub, and supervises them: a worker that exits
on its own stops the whole run with a clear message and status 1 (except
a crash injected by --fault-crash: the other workers go on, as the other
engines of a real deployment would); SIGINT or SIGTERM is passed on to every
worker, which then have a bounded time to exit. SIGHUP (a reload) is checked
here and passed on: each worker reads the configuration again and applies
it to its engines (config/reload.py).
"""

from __future__ import annotations

import ctypes
import signal
import sys
from typing import Any, Callable, List, Optional, Sequence, Tuple

import gevent
import gevent.event
from gevent import subprocess
from loguru import logger

from gmock_engine.utils import logs
from gmock_engine.config import reload
from gmock_engine.faults.specs import CRASH_EXIT_STATUS

#: How long workers get to exit after SIGTERM before they are killed.
WORKER_EXIT_TIMEOUT_S = 3.0


def split_ranks(first: int, count: int, processes: int) -> List[Tuple[int, int]]:
    """(start rank, engine count) per worker, as even as possible, in order."""
    base, extra = divmod(count, processes)
    slices, start = [], first
    for index in range(processes):
        size = base + (1 if index < extra else 0)
        slices.append((start, size))
        start += size
    return slices


def _worker_preexec() -> None:
    """In the worker, before exec: die with the parent (Linux PR_SET_PDEATHSIG),
    so a SIGKILLed parent leaves no engines behind. SIGHUP is ignored until
    the worker installs its own handler (cli.py): the default action of a
    SIGHUP passed on while it starts would end it (an ignored signal stays
    ignored across exec)."""
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        pass  # not Linux: the parent's signal handling still stops the workers


def worker_command(
    argv: Sequence[str], start: int, count: int, dp_size: int, metrics_port: Optional[int] = None
) -> List[str]:
    """This program's own argv with the worker's slice; the command line wins
    over environment and file, so the appended flags decide."""
    extra = ["--metrics-port", str(metrics_port)] if metrics_port is not None else []
    return [
        sys.executable,
        "-m",
        "gmock_engine",
        *argv,
        "--processes",
        "1",
        "--data-parallel-start-rank",
        str(start),
        "--engine-count",
        str(count),
        "--data-parallel-size",
        str(dp_size),
        *extra,
    ]


def reload_workers(config: Any, read: Callable[[], Any], workers: Sequence[Any]) -> Any:
    """SIGHUP in the supervisor: read the parsed options as the workers will
    (`read`, the loader stage of this command line; a bad file is refused
    here, once, and not passed on); name the options
    the workers cannot see change because their command lines fix them
    (worker_command); then pass the signal on to every live worker, which
    logs and applies its own changes. Returns the configuration in force."""
    found = reload.check(config, read)
    if found.error is not None:
        logger.error("{} (not passed on to the workers)", found.refused_line(engines="supervisor"))
        return config
    mine = found.fixed_among(name for name in reload.WORKER_COMMAND_LINE if name != "metrics_port" or config.metrics_port)
    if mine:
        logger.warning(reload.fixed_line(mine))
    if found.changed(("log_level", "log_json")):
        logs.set_level(found.config.log_level, found.config.log_json)
    live = [w for w in workers if w.poll() is None]
    logger.info("SIGHUP received; passed on to {} worker(s)", len(live))
    for worker in live:
        worker.send_signal(signal.SIGHUP)
    return found.config


def _reloader(config: Any, read: Callable[[], Any], workers: Sequence[Any], wanted: Any, stop: Any) -> None:
    """The supervisor's reloads, one at a time: each SIGHUP (`wanted`) re-enters
    at the parsed options (reload_workers), until the run stops; `config`
    is the configuration in force at start."""
    current = config
    while True:
        wanted.wait()
        wanted.clear()
        if stop.is_set():
            continue
        try:
            current = reload_workers(current, read, workers)
        except Exception:  # noqa: BLE001 - a reload must not end the run; say why
            logger.exception("config reload failed in the supervisor; the workers go on as they are")


def run_workers(config: Any, argv: Sequence[str], read: Callable[[], Any]) -> int:
    """Start and supervise the workers (each runs this command line `argv`
    with its slice of ranks); `read` reads the parsed options again for a
    reload (SIGHUP). Returns the exit status."""
    slices = split_ranks(config.data_parallel_start_rank, config.engine_count, config.processes)
    stop = gevent.event.Event()
    failures: List[str] = []
    crashed: List[Any] = []
    workers: List[Any] = []
    for index, (start, count) in enumerate(slices):
        port = None
        if config.metrics_port:  # each worker its own port: port + worker index
            port = config.metrics_port + index
        command = worker_command(argv, start, count, config.data_parallel_size, port)
        # Own session: a terminal's Ctrl-C reaches only the parent, which
        # passes one SIGTERM on (a worker's second signal would mean "exit now").
        workers.append(subprocess.Popen(command, start_new_session=True, preexec_fn=_worker_preexec))
        logger.info("worker pid {} runs engines {}..{}", workers[-1].pid, start, start + count - 1)

    def watch(worker: Any, start: int, count: int) -> None:
        status = worker.wait()
        if stop.is_set():
            return
        what = f"worker pid {worker.pid} (engines {start}..{start + count - 1}) exited with status {status}"
        if status == CRASH_EXIT_STATUS:
            crashed.append(worker)
            if len(crashed) < len(workers):
                logger.warning("{}: a crash injected by --fault-crash; the other workers go on", what)
                return
            logger.warning("{}: every worker crashed (--fault-crash)", what)
        elif status == 0:
            # An orderly stop of a worker (someone signalled it directly):
            # stop the others the same way.
            logger.info("{}; stopping the other workers", what)
        else:
            failures.append(what)
            logger.error("{}; stopping all workers", what)
        stop.set()

    watchers = [gevent.spawn(watch, w, s, c) for w, (s, c) in zip(workers, slices)]
    signals_seen: List[int] = []

    def on_signal(signum: int) -> None:
        if signals_seen:  # a second signal: stop now
            for worker in workers:
                if worker.poll() is None:
                    worker.kill()
            signals_seen.append(signum)
            return
        signals_seen.append(signum)
        logger.info("{} received; stopping {} workers", signal.Signals(signum).name, len(workers))
        stop.set()

    handlers = [gevent.signal_handler(s, on_signal, s) for s in (signal.SIGINT, signal.SIGTERM)]
    reload_wanted = gevent.event.Event()
    # The handler only asks; the check and the passing on run in a greenlet.
    handlers.append(gevent.signal_handler(signal.SIGHUP, reload_wanted.set))
    watchers.append(gevent.spawn(_reloader, config, read, workers, reload_wanted, stop))
    try:
        stop.wait()
        for worker in workers:
            if worker.poll() is None:
                worker.send_signal(signal.SIGTERM)
        with gevent.Timeout(WORKER_EXIT_TIMEOUT_S, False):
            for worker in workers:
                worker.wait()
        for worker in workers:
            if worker.poll() is None:
                failures.append(f"worker pid {worker.pid} did not exit within {WORKER_EXIT_TIMEOUT_S} s; killed")
                logger.error(failures[-1])
                worker.kill()
                worker.wait()
        gevent.killall(watchers, timeout=1)
    finally:
        for handler in handlers:
            handler.cancel()
    if len(signals_seen) > 1:
        return 128 + signals_seen[-1]
    if len(crashed) == len(workers):
        return CRASH_EXIT_STATUS
    # After a requested stop, how a worker ended does not matter (it may have
    # had a signal of its own too, e.g. from a process-group kill), only that
    # it did, in time. Before it, any exit is a failure (see watch()).
    return 1 if failures else 0
