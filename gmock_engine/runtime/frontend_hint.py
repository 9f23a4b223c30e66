"""What the engines say when no frontend comes: after NO_FRONTEND_HINT_AFTER_S
without INIT, once per process, what they wait for, what a TCP connect to the
handshake address tells, and how to start a frontend for them."""

from __future__ import annotations

import errno
import re
from typing import Any, Optional, Sequence

import gevent
import gevent.socket
from loguru import logger

from gmock_engine.wire.handshake import COORDINATOR_WAIT_HINT, reach_hint, tcp_host_port

#: How long the engines wait for INIT before they say, once, what they wait for.
NO_FRONTEND_HINT_AFTER_S = 5.0
#: How long the hint's TCP connect to the handshake address may take.
PROBE_TIMEOUT_S = 3.0


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


def hint_if_no_frontend(runners: Sequence[Any], config: Any) -> None:
    """Once per process: after NO_FRONTEND_HINT_AFTER_S, if engines still
    wait for INIT, say what for, what a TCP connect to the handshake address
    tells, and how to start a frontend; if they got INIT but wait for the
    coordinator's READY, why (the per-engine "still waiting" lines of
    transport.py only say that they wait)."""
    gevent.sleep(NO_FRONTEND_HINT_AFTER_S)
    got_init = [r for r in runners if getattr(r, "got_init", None) is not None and r.got_init.is_set()]
    waiting = [r.rank for r in runners if not r.joined.is_set() and r not in got_init]
    coordinator = [r.rank for r in got_init if not r.joined.is_set()]
    if waiting:
        joined = [r.rank for r in runners if r.rank not in waiting]
        text = no_frontend_hint(config.handshake_address, waiting, joined, config.data_parallel_size, NO_FRONTEND_HINT_AFTER_S)
        outcome = probe_handshake(config.handshake_address)
        if outcome is not None:
            text += "\n" + reach_hint(config.handshake_address, outcome, _ranks(waiting), config.data_parallel_size, waiting[-1])
        logger.warning(text)
    elif coordinator:
        logger.warning("{} got INIT but no READY from the frontend's DP coordinator after {:g} s: {}",
                       _ranks(coordinator), NO_FRONTEND_HINT_AFTER_S, COORDINATOR_WAIT_HINT)  # fmt: skip
