"""The supervisor of a gmock_engine process: every greenlet runs in its
group, and an exception anywhere is logged with its traceback and stops the
whole process with a non-zero status, never a half-alive engine (STYLE:
no greenlet dies silently)."""

from __future__ import annotations

from typing import Any, Callable, Optional

import gevent
import gevent.event
import gevent.pool
from loguru import logger


class Supervisor:
    """Owns every greenlet; the first failure stops the process (exit 1)."""

    def __init__(self) -> None:
        self.group = gevent.pool.Group()
        self.stop_event = gevent.event.Event()
        self.failure: Optional[str] = None

    def spawn(self, name: str, func: Callable, *args: Any) -> gevent.Greenlet:
        greenlet = gevent.Greenlet(func, *args)
        greenlet.name = name
        greenlet.link_exception(self._on_failure)
        self.group.start(greenlet)
        return greenlet

    def _on_failure(self, greenlet: gevent.Greenlet) -> None:
        if self.failure is None:
            self.failure = f"{greenlet.name} failed: {greenlet.exception!r}"
        logger.opt(exception=greenlet.exc_info).critical("greenlet {} died; stopping gmock_engine", greenlet.name)
        self.stop_event.set()

    def stop(self) -> None:
        self.stop_event.set()
