"""steptimer.py: the wake-up at an absolute monotonic deadline."""

import time

import gevent
import gevent.event

from gmock_engine.steptimer import StepTimer


def test_fires_once_not_before_the_deadline_and_rearm_replaces():
    fired = []
    done = gevent.event.Event()

    def callback():
        fired.append(time.monotonic())
        done.set()

    timer = StepTimer(callback)
    try:
        assert timer.precise  # Linux: timerfd
        start = time.monotonic()
        timer.arm(start + 10.0)  # replaced by the next arm: must not fire
        deadline = start + 0.03
        timer.arm(deadline)
        assert done.wait(5)
        assert fired[0] >= deadline
        gevent.sleep(0.05)
        assert len(fired) == 1
        # a deadline in the past fires at once
        done.clear()
        timer.arm(time.monotonic() - 1)
        assert done.wait(5)
    finally:
        timer.close()
