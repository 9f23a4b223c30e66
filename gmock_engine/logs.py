"""Logging: loguru sinks, configured once by the entry point (modules only
`from loguru import logger`, bound with `engine=<rank>` per component)."""

from __future__ import annotations

import sys

from loguru import logger

_TEXT_FORMAT = (
    "<green>{time:YYYY-MM-DD HH:mm:ss.SSS}</green> <level>{level: <8}</level> "
    "<cyan>{extra[engine]: >3}</cyan> {message}"
)


def setup_logging(level: str = "INFO", json: bool = False, sink=None) -> None:
    """Replace loguru's default sink with one stderr sink.

    enqueue stays False: under gevent a logging thread would be a real
    thread fighting the hub; writes to stderr are short and synchronous.
    """
    logger.remove()
    logger.configure(extra={"engine": "-"})
    logger.add(
        sink or sys.stderr,
        level=level,
        format=_TEXT_FORMAT,
        serialize=json,
        colorize=None if not json else False,
        enqueue=False,
        backtrace=False,
        diagnose=False,
    )
