"""runtime/grammar_pool.py: a job runs in a native thread while the loop goes on,
its outcome comes back through `deliver` then `wake`; past the time limit
the timed-out outcome comes instead, once."""

import gevent
import gevent.monkey
import gevent.event

from gmock_engine.runtime import grammar_pool
from gmock_engine.core.grammar_wait import GrammarReady

#: the unpatched sleep: it blocks the native thread, as a long compile does
native_sleep = gevent.monkey.get_original("time", "sleep")


def ready(rid, **kw):
    return GrammarReady(rid, object(), None, None, 0.0, **kw)


def executor():
    delivered, woken = [], gevent.event.Event()
    spawn = lambda name, func, *args: gevent.spawn(func, *args)  # noqa: E731 - the Supervisor's signature
    return grammar_pool.ThreadedExecutor(spawn, delivered.append, woken.set), delivered, woken


def ticks_during(seconds_of_work, timeout_s, rid):
    """Run a job that works `seconds_of_work` in the pool; count the loop's 10 ms ticks meanwhile."""
    ex, delivered, woken = executor()
    outcome = ready(rid)
    ticks = [0]

    def job():
        native_sleep(seconds_of_work)
        return outcome

    def ticker():
        while not woken.is_set():
            gevent.sleep(0.01)
            ticks[0] += 1

    counter = gevent.spawn(ticker)
    assert ex.submit(job, ready(rid, timed_out=True), timeout_s) is None
    with gevent.Timeout(10):
        woken.wait()
        counter.join()
    return delivered, ticks[0], outcome


def test_the_loop_goes_on_while_a_job_runs_and_its_outcome_is_delivered():
    delivered, ticks, outcome = ticks_during(0.3, None, "a")
    assert delivered == [outcome]
    assert ticks >= 10  # about 30 ticks of 10 ms; a job on the loop allows none


def test_past_the_limit_the_timed_out_outcome_comes_instead():
    delivered, _, outcome = ticks_during(0.5, 0.05, "b")
    assert len(delivered) == 1 and delivered[0].timed_out and delivered[0].request_id == "b"
    gevent.sleep(0.6)  # the job ends in its thread meanwhile: nothing more is delivered
    assert len(delivered) == 1


def test_settle_waits_for_a_running_job_within_its_bound_then_lets_the_threads_go():
    """The shutdown's last step: a job still running past the bound leaves the
    pool busy (so __main__ ends the process without the teardown that would
    end that thread with pthread_exit); within the bound, the threads go."""
    grammar_pool.thread_pool().spawn(native_sleep, 0.5)
    assert grammar_pool.busy()
    assert grammar_pool.settle(0.05) is False and grammar_pool.busy()
    assert grammar_pool.settle(5) is True
    assert not grammar_pool.busy() and grammar_pool.thread_pool().size == 0
