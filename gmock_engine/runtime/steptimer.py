"""A wake-up at an absolute time.monotonic() deadline, precise to microseconds.

gevent's default libev backend waits in epoll_wait, whose timeout is whole
milliseconds (libev rounds up), so a plain `gevent.sleep` wakes up to 1 ms
late: with `--itl-ms 10` that alone puts the median step 0.6 ms behind its
slot. A Linux timerfd armed at the absolute deadline makes the same
epoll_wait return when the kernel timer fires instead, so the hub is woken
within tens of microseconds. Where timerfd is missing (not Linux) a gevent
timer is used.

`StepTimer(callback).arm(deadline)` calls `callback()` once at the deadline,
in the hub; arming again replaces the previous deadline. `TimerFD` is the
timerfd itself, for a poll loop without gevent (the bench driver's send
schedule, the reference emitter's paced steps): this module imports gevent
only when a StepTimer is built.
"""

from __future__ import annotations

import ctypes
import os
import time
from typing import Any, Callable, Optional

_CLOCK_MONOTONIC = 1  # time.monotonic() is CLOCK_MONOTONIC on Linux
_TFD_NONBLOCK = 0o4000
_TFD_CLOEXEC = 0o2000000
_TFD_TIMER_ABSTIME = 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


def _libc() -> Optional[Any]:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.timerfd_create.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.timerfd_settime.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.POINTER(_Itimerspec), ctypes.c_void_p]
        return libc
    except (OSError, AttributeError):
        return None


class TimerFD:
    """A Linux timerfd armed at absolute time.monotonic() deadlines: its FD
    turns readable when the deadline passes, so any poll that watches it
    (the hub's, zmq.Poller's) wakes within microseconds of the deadline, not
    at its whole-millisecond timeout. `create()` is None where timerfd is
    missing."""

    def __init__(self, libc: Any, fd: int) -> None:
        self._libc, self._fd = libc, fd
        self._spec = _Itimerspec()

    @classmethod
    def create(cls) -> Optional["TimerFD"]:
        libc = _libc()
        if libc is None:
            return None
        fd = libc.timerfd_create(_CLOCK_MONOTONIC, _TFD_NONBLOCK | _TFD_CLOEXEC)
        return cls(libc, fd) if fd >= 0 else None

    def fileno(self) -> int:
        return self._fd

    def arm(self, deadline: float) -> bool:
        """Fire at `deadline` (replaces the previous one); False if the
        kernel refused it."""
        seconds = int(deadline)
        self._spec.it_value.tv_sec = seconds
        self._spec.it_value.tv_nsec = max(1, int((deadline - seconds) * 1e9))
        return self._libc.timerfd_settime(self._fd, _TFD_TIMER_ABSTIME, ctypes.byref(self._spec), None) == 0

    def consume(self) -> bool:
        """Read the expiration: True if the deadline passed, False if the
        timer was re-armed before this read (not due yet)."""
        try:
            os.read(self._fd, 8)
        except BlockingIOError:
            return False
        return True

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def cadence_base(now: float, due: Optional[float], delay: float) -> float:
    """The time a paced step that started at `now` is counted from: when it
    was due, if it started late by less than its own time (`delay`), else
    `now`. A GPU runs its steps back to back while the host schedules
    ahead: a host that is late by less than a step does not lengthen the
    steps (the emulated GPU counts the same way); the mock's late wake-up
    on a loaded machine is such a host."""
    if due is not None and 0.0 <= now - due < delay:
        return due
    return now


class StepTimer:
    """One-shot wake-up at an absolute monotonic deadline (see module doc)."""

    def __init__(self, callback: Callable[[], None]) -> None:
        import gevent  # here, not at the top: TimerFD's users poll without gevent

        self._callback = callback
        self._hub = gevent.get_hub()
        self._fallback: Optional[Any] = None
        self._watcher: Optional[Any] = None
        self._timer = TimerFD.create()
        #: The deadline the timerfd is armed at and has not fired for yet (None: none)
        self._armed: Optional[float] = None
        if self._timer is not None:
            self._watcher = self._hub.loop.io(self._timer.fileno(), 1)  # 1 = readable
            self._watcher.start(self._fired)

    @property
    def precise(self) -> bool:
        return self._timer is not None

    def _fired(self) -> None:
        if self._timer.consume():  # False: re-armed before we got here, not due yet
            self._armed = None
            self._callback()

    def arm(self, deadline: float) -> None:
        """Call the callback at `deadline` (time.monotonic() seconds).

        Arming again at the deadline the timer already waits for does
        nothing: a paced stepper that input wakes between two steps re-arms
        the same deadline each time, and one timerfd_settime call a step
        is all that pacing needs."""
        timer = self._timer
        if timer is not None:
            if deadline == self._armed:
                return
            if timer.arm(deadline):
                self._armed = deadline
                return
            self._armed = None
        if self._fallback is not None:
            self._fallback.close()
        self._fallback = self._hub.loop.timer(max(0.0, deadline - time.monotonic()))
        self._fallback.start(self._callback)

    def close(self) -> None:
        if self._watcher is not None:
            self._watcher.stop()
            self._watcher.close()
            self._watcher = None
        if self._timer is not None:
            self._timer.close()
            self._timer = None
        if self._fallback is not None:
            self._fallback.close()
            self._fallback = None
