"""The runtime's GrammarExecutor: jobs in a native thread, outcomes back on the loop.

A request's structured answer (core/grammar_wait.py) is made in a native
thread of one process-wide gevent ThreadPool, so the engine's loop, and
every stream of the process, goes on meanwhile. A thread is enough:
llguidance releases the GIL while it compiles and computes masks (a
greenlet ticking every millisecond saw at most 30 ms between ticks while a
1 MB regex compiled in a thread, a whole second inline), and the answer's
walk is short Python between those calls, which the interpreter's switch
interval (5 ms) shares with the loop. vLLM compiles in a thread pool too
(StructuredOutputManager: (CPUs + 1) // 2 threads).

One thread for the process, as vLLM's pool on a 2-core machine: the
generator's caches (content/structured_output.py: its compiled matchers; content/answer.py
its markers) then have one owner, and jobs run in arrival order. Each job
has a greenlet of the runner's supervisor that waits for it without
blocking the loop, with the time limit, then hands the engine its outcome
(`deliver`, then `wake`: the stepper applies it as the next input, in order
with the ABORTs and ADDs that came before it).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import gevent
import gevent.threadpool

from gmock_engine.content import answer as content, structured_output
from gmock_engine.core.grammar_wait import GrammarExecutor, GrammarReady, Job
from gmock_engine.content.tokenizer import ContentUnavailable, load_tokenizer

#: Threads that make structured answers, for the whole process.
THREADS = 1

_pool: Optional[gevent.threadpool.ThreadPool] = None


def thread_pool() -> gevent.threadpool.ThreadPool:
    """The process's pool, made on first use (a process that serves no
    constraint starts no thread)."""
    global _pool
    if _pool is None:
        _pool = gevent.threadpool.ThreadPool(THREADS)
    return _pool


def warm(tokenizer_path: str) -> None:
    """Build the generator of the served tokenizer in the pool now, at the
    engine's start: llguidance holds the GIL while it reads a tokenizer
    (about a third of a second for a 32 000-id vocabulary), which the first
    structured request would otherwise cost every stream then running."""

    def build() -> None:
        try:
            tokenizer = load_tokenizer(tokenizer_path)
            structured_output.for_tokenizer(tokenizer)
            content.markers(tokenizer)
        except (ContentUnavailable, ValueError):
            pass  # the first request that needs it says why (content.shape)

    thread_pool().spawn(build)


def settle(timeout_s: float) -> bool:
    """The last step of an ordered shutdown: wait up to `timeout_s` for the
    pool's jobs to end, then let its idle threads go. True when no thread is
    left inside llguidance (`busy` says the same afterwards)."""
    if _pool is None:
        return True
    with gevent.Timeout(timeout_s, False):
        _pool.join()
    if busy():
        return False
    _pool.kill()
    return True


def busy() -> bool:
    """A job (a structured answer, the warm-up) still runs in a native thread.
    Python's teardown must not run then: it ends such a thread with
    pthread_exit, whose forced unwind through llguidance's Rust frames
    crashes the process (SIGSEGV after the last log line). __main__ ends the
    process without the teardown instead."""
    return _pool is not None and len(_pool) > 0


class ThreadedExecutor(GrammarExecutor):
    """Jobs of one engine in the process's thread pool; each outcome
    delivered to that engine's stepper as an input."""

    def __init__(self, spawn: Callable[..., Any], deliver: Callable[[Any], None], wake: Callable[[], None]) -> None:
        self._spawn = spawn
        self._deliver = deliver
        self._wake = wake

    def submit(self, job: Job, timed_out: GrammarReady, timeout_s: Optional[float]) -> Optional[GrammarReady]:
        self._spawn(f"grammar-{timed_out.request_id[:40]}", self._await, job, timed_out, timeout_s)
        return None

    def _await(self, job: Job, timed_out: GrammarReady, timeout_s: Optional[float]) -> None:
        result = thread_pool().spawn(job)
        # (a job that passes the limit runs on in its thread, which cannot
        # be stopped; its outcome is dropped: the engine holds it no longer)
        result.wait(timeout_s)
        ready = result.get(block=False) if result.ready() else timed_out
        self._deliver(ready)
        self._wake()
