"""Logging: loguru sinks, configured once by the entry point (modules only
`from loguru import logger`, bound with `engine=<rank>` per component)."""

from __future__ import annotations

import sys

from loguru import logger

_TEXT_FORMAT = (
    "<green>{time:YYYY-MM-DD HH:mm:ss.SSS}</green> <level>{level: <8}</level> "
    "<cyan>{extra[engine]: >3}</cyan> {message}"
)


#: The sink setup_logging added: (loguru handler id, sink), for set_level.
_configured: list = []


def setup_logging(level: str = "INFO", json: bool = False, sink=None) -> None:
    """Replace loguru's default sink with one stderr sink.

    enqueue stays False: under gevent a logging thread would be a real
    thread fighting the hub; writes to stderr are short and synchronous.
    """
    logger.remove()
    logger.configure(extra={"engine": "-"})
    _configured[:] = [(_add_sink(sink or sys.stderr, level, json), sink or sys.stderr)]


def _add_sink(sink, level: str, json: bool) -> int:
    return logger.add(
        sink,
        level=level,
        format=_TEXT_FORMAT,
        serialize=json,
        colorize=None if not json else False,
        enqueue=False,
        backtrace=False,
        diagnose=False,
    )


def set_level(level: str, json: bool) -> bool:
    """A reload (--log-level, --log-json): the sink of setup_logging, again
    with these settings (loguru cannot change a sink's level in place; other
    sinks, e.g. a test's, stay). False when setup_logging made none (an App
    run in-process): then the caller's logging is left alone."""
    if not _configured:
        return False
    handler, sink = _configured[0]
    try:
        logger.remove(handler)
    except ValueError:  # removed by someone else meanwhile: add it afresh
        pass
    _configured[:] = [(_add_sink(sink, level, json), sink)]
    return True


#: Characters of a client-chosen string (a request id) that a log line keeps.
LOG_ID_CHARS = 120


def short(text: object, limit: int = LOG_ID_CHARS) -> str:
    """`text` for a log line, cut to `limit` characters with the length said:
    request ids come from clients (X-Request-Id), and a 1 MB id must not
    become a 1 MB log line."""
    text = str(text)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}…({len(text)} chars)"


class Throttle:
    """Rate-limited warnings, per kind: at most `per_window` lines of one kind
    in `window_s` seconds, then one line saying how many were left out.

    Anything a client controls (a bad frame, a duplicate id, a bad
    `vllm_xargs` value, an unknown utility) can come in floods; the log must
    stay readable and cheap while the engine goes on serving."""

    def __init__(self, log, per_window: int = 20, window_s: float = 10.0, clock=None) -> None:
        import time

        self.log = log
        self.per_window = per_window
        self.window_s = window_s
        self.clock = clock or time.monotonic
        #: kind -> [window start, lines written, lines left out]
        self._kinds: dict = {}

    def warning(self, kind: str, message: str, *args, exception: bool = False) -> bool:
        """Log `message.format(*args)` unless this kind is over its budget;
        True when the line was written."""
        now = self.clock()
        state = self._kinds.get(kind)
        if state is None or now - state[0] >= self.window_s:
            if state is not None and state[2]:
                self.log.warning("{} more '{}' warnings left out in the last {:.0f} s", state[2], kind, now - state[0])
            state = self._kinds[kind] = [now, 0, 0]
        if state[1] >= self.per_window:
            state[2] += 1
            return False
        state[1] += 1
        self.log.opt(depth=1, exception=exception).warning(message, *args)
        return True
