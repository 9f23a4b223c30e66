"""The program: configuration -> logging -> engines -> signals -> exit status.

Start-up is a pipeline, and `main` runs its stages in order, each once:
argv -> the parsed options (the loader, config.parse_config: command line >
environment > config file > default) -> logging -> the settings
(settings.from_config) -> the app (app.App, which runs by the settings).
With --processes the parsed options go to a pipeline of their own instead:
processes.run_workers starts one process per slice of ranks, each running
this one. The loader bound to this command line (config.reader) is handed
on: a reload (SIGHUP) reads the parsed options again with it and goes on
from there (config/reload.py) without starting over.

Exit status: 0 after SIGINT/SIGTERM (or --exit-when-frontend-gone), 1 when any
greenlet failed, 2 for a bad configuration (nothing was connected then). A
second signal exits at once. SIGUSR1 logs every engine's books; SIGHUP reads
the configuration again and applies what may change while requests run
(config/reload.py).
"""

from __future__ import annotations

import gc
import os
import signal
import sys
from typing import Optional, Sequence

import gevent
from loguru import logger

from gmock_engine import __version__
from gmock_engine.runtime.app import App, StartError
from gmock_engine.config.loader import format_config, parse_config, reader
from gmock_engine.config.settings import from_config
from gmock_engine.utils.logs import setup_logging
from gmock_engine.config.parsed import ConfigError

#: Allocations (net) between young-generation collections; CPython's default is 700.
GC_THRESHOLD = 100_000
def _msgpack_is_compiled() -> bool:
    try:
        from msgpack import _cmsgpack  # noqa: F401
    except ImportError:
        return False
    return True


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run gmock_engine until a signal or a failure; return the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    # Until the reload handler is installed (below, or in processes.py), a
    # SIGHUP is dropped instead of ending the process (its default action).
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        config = parse_config(argv)  # argv -> the parsed options
    except ConfigError as exc:
        print(f"gmock-engine: error: {exc}", file=sys.stderr)
        return 2
    # The loader bound to this command line: each reload (SIGHUP) reads the
    # parsed options again with it and goes on from there.
    read = reader(argv)
    if config.print_config:
        print(format_config(config))
        return 0

    setup_logging(config.log_level, config.log_json)
    if not _msgpack_is_compiled():
        logger.warning("msgpack's C extension is not loaded; packing will be several times slower")
    last = config.data_parallel_start_rank + config.engine_count - 1
    logger.info(
        "gmock_engine {} pid {}: engines {}..{} of DP {} joining {} (chunk {}, vocab {}, seed {})",
        __version__,
        os.getpid(),
        config.data_parallel_start_rank,
        last,
        config.data_parallel_size,
        config.handshake_address,
        config.output_token_chunk_size,
        config.vocab_size,
        config.seed,
    )

    if config.processes > 1:
        from gmock_engine.runtime.processes import run_workers

        return run_workers(config, argv, read)

    # Each step allocates thousands of short-lived, acyclic lists that
    # reference counting frees at once; with CPython's default thresholds the
    # cyclic GC still runs every few hundred allocations and, every ~16 steps,
    # walks the whole request table: a stall that grows with the number of
    # requests and shows as step lateness. Freeze what startup built and
    # collect rarely.
    gc.freeze()
    gc.set_threshold(GC_THRESHOLD, 50, 100)
    settings = from_config(config)  # the parsed options -> the settings
    app = App(settings, config, load=read)  # the settings -> the app
    signals_seen = []

    def on_signal(signum: int) -> None:
        # The handler only sets the stop event; a second signal exits now.
        if signals_seen:
            os._exit(128 + signum)
        signals_seen.append(signum)
        logger.info("{} received; shutting down", signal.Signals(signum).name)
        app.stop()

    handlers = [gevent.signal_handler(s, on_signal, s) for s in (signal.SIGINT, signal.SIGTERM)]
    # On demand during a long run: kill -USR1 <pid> logs every engine's books.
    handlers.append(gevent.signal_handler(signal.SIGUSR1, app.log_summary))
    # kill -HUP <pid>: the handler only asks; the reload runs in its own greenlet.
    handlers.append(gevent.signal_handler(signal.SIGHUP, app.request_reload))
    try:
        status = app.run()
    except StartError as exc:  # nothing was served: a configuration error
        print(f"gmock-engine: error: argument {exc.flag}: {exc}", file=sys.stderr)
        return 2
    finally:
        for handler in handlers:
            handler.cancel()
    if status:
        logger.error("gmock_engine stopped after a failure: {}", app.supervisor.failure)
    return status
