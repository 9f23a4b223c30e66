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

import errno
import gc
import os
import re
import signal
import sys
from typing import Optional, Sequence

import gevent
import gevent.socket
from loguru import logger

from gmock_engine import __version__
from gmock_engine.runtime import kv_publisher as kv_event_publisher
from gmock_engine.runtime.app import App
from gmock_engine.config.loader import format_config, parse_config, reader
from gmock_engine.config.settings import from_config
from gmock_engine.utils.logs import setup_logging
from gmock_engine.config.parsed import ConfigError
from gmock_engine.wire.handshake import COORDINATOR_WAIT_HINT, reach_hint, tcp_host_port

#: Allocations (net) between young-generation collections; CPython's default is 700.
GC_THRESHOLD = 100_000
#: How long the engines wait for INIT before they say, once, what they wait for.
NO_FRONTEND_HINT_AFTER_S = 5.0
#: How long the hint's TCP connect to the handshake address may take.
PROBE_TIMEOUT_S = 3.0


def _msgpack_is_compiled() -> bool:
    try:
        from msgpack import _cmsgpack  # noqa: F401
    except ImportError:
        return False
    return True


def _ranks(ranks: Sequence[int]) -> str:
    return f"engine {ranks[0]}" if len(ranks) == 1 else f"engines {ranks[0]}..{ranks[-1]}"


def no_frontend_hint(address: str, waiting: Sequence[int], joined: Sequence[int], dp: int, after: float) -> str:
    """What the engines still without INIT wait for, and how to start a frontend for them."""
    if joined:
        # Some ranks joined: a frontend is there, but it does not expect these.
        return (f"{_ranks(waiting)} got no INIT from the frontend at {address} after {after:g} s, while "
                f"{_ranks(joined)} joined: is the frontend's --data-parallel-size {dp}? "
                "(another mock may also hold these ranks)")  # fmt: skip
    text = (f"no frontend answered at {address} after {after:g} s: {_ranks(waiting)} sent HELLO and wait for INIT. "
            "The frontend binds the handshake, the engine only connects; start one there with "
            "--data-parallel-size-local 0")  # fmt: skip
    tcp = re.match(r"^tcp://(.+):(\d+)$", address)
    if tcp:
        host, port = tcp.groups()
        text += (f", e.g.\n  vllm-rs serve MODEL --data-parallel-size-local 0 --data-parallel-size {dp} --handshake-port {port}\n"
                 f"  vllm serve MODEL --data-parallel-size-local 0 --data-parallel-size {dp} --data-parallel-address {host} "
                 f"--data-parallel-rpc-port {port} --api-server-count 1\n")  # fmt: skip
    else:
        text += f" and --data-parallel-size {dp} (README, Pairing with a frontend)\n"
    return text + f"or run ./run.sh serve --dp {dp}: a real frontend and the mock engines in one command"


def probe_handshake(address: str, timeout: float = PROBE_TIMEOUT_S) -> Optional[str]:
    """A plain TCP connect to a tcp:// handshake address: "open", "refused",
    "timeout", "unreachable" (no route) or the error's text (None for other transports). Both frontends'
    handshake ROUTERs take a connection that closes before the ZMTP greeting."""
    parsed = tcp_host_port(address)
    if parsed is None:
        return None
    try:
        conn = gevent.socket.create_connection(parsed, timeout=timeout)
    except ConnectionRefusedError:
        return "refused"
    except TimeoutError:  # socket.timeout too
        return "timeout"
    except OSError as exc:
        if exc.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH):
            return "unreachable"
        return exc.strerror or str(exc)
    conn.close()
    return "open"


def _hint_if_no_frontend(app: App, config) -> None:
    """Once per process: after NO_FRONTEND_HINT_AFTER_S, if engines still
    wait for INIT, say what for, what a TCP connect to the handshake address
    tells, and how to start a frontend; if they got INIT but wait for the
    coordinator's READY, why (the per-engine "still waiting" lines of
    transport.py only say that they wait)."""
    gevent.sleep(NO_FRONTEND_HINT_AFTER_S)
    got_init = [r for r in app.runners if getattr(r, "got_init", None) is not None and r.got_init.is_set()]
    waiting = [r.rank for r in app.runners if not r.joined.is_set() and r not in got_init]
    coordinator = [r.rank for r in got_init if not r.joined.is_set()]
    if waiting:
        joined = [r.rank for r in app.runners if r.rank not in waiting]
        text = no_frontend_hint(config.handshake_address, waiting, joined, config.data_parallel_size, NO_FRONTEND_HINT_AFTER_S)
        outcome = probe_handshake(config.handshake_address)
        if outcome is not None:
            text += "\n" + reach_hint(config.handshake_address, outcome, _ranks(waiting), config.data_parallel_size, waiting[-1])
        logger.warning(text)
    elif coordinator:
        logger.warning("{} got INIT but no READY from the frontend's DP coordinator after {:g} s: {}",
                       _ranks(coordinator), NO_FRONTEND_HINT_AFTER_S, COORDINATOR_WAIT_HINT)  # fmt: skip


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
        try:
            app.start()
        except OSError as exc:  # the metrics endpoint
            print(
                f"gmock-engine: error: argument --metrics-port: cannot listen on "
                f"{config.metrics_host}:{config.metrics_port}: {exc}",
                file=sys.stderr,
            )
            return 2
        except kv_event_publisher.BindError as exc:  # the KV event PUB / replay ROUTER could not bind
            print(f"gmock-engine: error: argument --kv-events-config: {exc}", file=sys.stderr)
            return 2
        app.supervisor.spawn("no-frontend-hint", _hint_if_no_frontend, app, config)
        status = app.run_until_stopped()
    finally:
        for handler in handlers:
            handler.cancel()
    app.log_summary()
    if status:
        logger.error("gmock_engine stopped after a failure: {}", app.supervisor.failure)
    return status
