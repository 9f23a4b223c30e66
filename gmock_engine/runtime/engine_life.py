"""One engine's life in its process, once its runner is built: start, serve
until the process stops, drain (--on-stop), the ordered and bounded
shutdown, and its summary line.

Each engine lives in a supervised greenlet of its own (app.App spawns one per
runner). The engines of a process share only the ZMQ context, so each ends
on its own, at the same pace as the others: the App closes the context once
every life has ended (or `LIFE_AFTER_STOP_S` past the drain has gone by).
"""

from __future__ import annotations

import time
from typing import Any, Dict

import gevent
from loguru import logger

from gmock_engine.runtime.runner import KILL_TIMEOUT_S, SENDER_FLUSH_TIMEOUT_S, EngineRunner
from gmock_engine.runtime.supervisor import Supervisor

#: How long an abort drain may take to get its outputs out.
DRAIN_ABORT_TIMEOUT_S = 2.0

#: What the shutdown after the drain may take at most: the inputs' kill, the
#: sender's flush and its kill, the sender's kill, the sockets' linger.
SHUTDOWN_S = SENDER_FLUSH_TIMEOUT_S + 5 * KILL_TIMEOUT_S


def life_after_stop_s(process: Any) -> float:
    """The longest an engine's life may go on after the stop: the drain
    (--on-stop finish: --drain-timeout, then the abort) and the shutdown."""
    drain = 0.0
    if process.on_stop != "exit":
        drain = DRAIN_ABORT_TIMEOUT_S + (process.drain_timeout if process.on_stop == "finish" else 0.0)
    return drain + SHUTDOWN_S


def live(runner: EngineRunner, supervisor: Supervisor, process: Any) -> None:
    """The engine's life: spawn its handshake, wait for the process's stop
    (a signal, --exit-when-frontend-gone, or a failure anywhere), drain as
    --on-stop says unless a failure stopped it, shut down, log its books."""
    runner.start()
    supervisor.stop_event.wait()
    if supervisor.failure is None and process.on_stop != "exit":
        drain(runner, supervisor, process.on_stop == "finish", process.drain_timeout)
    shut_down(runner, process.send_dead_on_exit)
    log_books(runner.rank, runner.counters())


def drain(runner: EngineRunner, supervisor: Supervisor, finish: bool, timeout: float) -> None:
    """--on-stop abort | finish: end what is in flight before stopping.

    finish waits up to --drain-timeout for every request to end, then
    aborts the rest; abort ends them all at once. The frontend gets an
    output for every request either way, so no stream is left hanging.
    """
    runner.log.info("draining: {} in-flight requests", "finishing" if finish else "aborting")
    runner.request_drain(finish)
    if finish and not _wait_drained(runner, supervisor, timeout):
        runner.log.warning("drain timeout ({} s) reached; aborting what is left", timeout)
        runner.request_drain(False)
    if not _wait_drained(runner, supervisor, DRAIN_ABORT_TIMEOUT_S):
        runner.log.warning("engine not drained after aborting; stopping anyway")


def _wait_drained(runner: EngineRunner, supervisor: Supervisor, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not runner.drained:
        if time.monotonic() > deadline or supervisor.failure is not None:
            return False
        gevent.sleep(0.01)
    return True


def shut_down(runner: EngineRunner, send_dead: bool) -> None:
    """Ordered and bounded: the readers, stepper and watches; the sender's
    flush (and the dead-engine sentinel if asked); the sender; the sockets."""
    gevent.killall(runner.input_greenlets(), block=True, timeout=KILL_TIMEOUT_S)
    flusher = gevent.spawn(runner.flush_output, send_dead)
    flusher.join(timeout=SENDER_FLUSH_TIMEOUT_S + 2 * KILL_TIMEOUT_S)
    # No sender may still be in `send` when its socket closes (a ZMQError
    # there would turn a clean stop into a failure).
    flusher.kill(block=True, timeout=KILL_TIMEOUT_S)
    if runner.sender is not None:
        runner.sender.kill(block=True, timeout=KILL_TIMEOUT_S)
    runner.close()


def log_books(rank: int, counts: Dict[str, int]) -> None:
    """One line of an engine's books: its ledger and counters (shutdown,
    SIGUSR1, --summary-interval)."""
    logger.bind(engine=rank).info(
        "engine {} summary: {}", rank, " ".join(f"{k}={v}" for k, v in sorted(counts.items())) or "no requests"
    )
