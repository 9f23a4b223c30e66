"""runtime/steptimer.py: the wake-up at an absolute monotonic deadline."""

import time

import gevent
import gevent.event

from gmock_engine.runtime.steptimer import StepTimer


def _recording_timer():
    """A StepTimer whose callback records when it ran: (timer, times, event set on each)."""
    fired = []
    done = gevent.event.Event()

    def callback():
        fired.append(time.monotonic())
        done.set()

    return StepTimer(callback), fired, done


def test_fires_once_not_before_the_deadline_and_rearm_replaces():
    timer, fired, done = _recording_timer()
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


def test_timerfd_turns_readable_at_its_deadline_and_rearming_resets_it():
    """The bench driver's send timer (no gevent): a poll that watches the
    FD wakes at the deadline, not at its own whole-millisecond timeout."""
    import select

    from gmock_engine.runtime.steptimer import TimerFD

    timer = TimerFD.create()
    assert timer is not None  # Linux
    try:
        poll = select.poll()
        poll.register(timer.fileno(), select.POLLIN)
        deadline = time.monotonic() + 0.02
        assert timer.arm(deadline)
        assert poll.poll(5000)  # woken by the timer, long before the timeout
        assert time.monotonic() >= deadline
        assert timer.consume()
        assert not poll.poll(0) and not timer.consume()  # read: not readable again
        # fired but not read, then re-armed into the future: not due any more
        assert timer.arm(time.monotonic() - 1)
        assert poll.poll(1000)
        assert timer.arm(time.monotonic() + 10)
        assert not poll.poll(0) and not timer.consume()
    finally:
        timer.close()


def test_arming_the_deadline_it_waits_for_again_costs_nothing_and_a_fired_one_rearms():
    """A paced stepper woken by input re-arms the deadline it already waits
    for: no second timerfd_settime; once that deadline has fired, arming it
    again (a step that is still due) fires again."""
    timer, fired, done = _recording_timer()
    settimes = []
    real_arm = timer._timer.arm
    timer._timer.arm = lambda deadline: settimes.append(deadline) or real_arm(deadline)
    try:
        deadline = time.monotonic() + 0.03
        for _ in range(5):
            timer.arm(deadline)
        assert settimes == [deadline]
        assert done.wait(5) and len(fired) == 1
        done.clear()
        timer.arm(deadline)  # fired already: armed again, fires at once
        assert done.wait(5) and len(fired) == 2
        assert settimes == [deadline, deadline]
        done.clear()
        later = time.monotonic() + 0.02
        timer.arm(later)
        timer.arm(later + 10)  # another deadline: replaces it
        assert settimes[-1] == later + 10 and not done.wait(0.1)
    finally:
        timer.close()
