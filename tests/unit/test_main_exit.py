"""__main__.end: the engine process's exit once its ordered shutdown is done.
A thread still inside llguidance must not meet the interpreter's teardown
(pthread_exit through Rust frames: SIGSEGV), so the process then ends with
os._exit, its logs flushed; otherwise with an ordinary sys.exit."""

import pytest

import gmock_engine.__main__ as entry
from gmock_engine.runtime import grammar_pool


class Exited(Exception):
    pass


def fake_exit(calls):
    def _exit(status):
        calls.append(status)
        raise Exited

    return _exit


@pytest.mark.parametrize("status", [0, 1])
def test_a_busy_grammar_pool_ends_the_process_without_the_teardown(monkeypatch, status):
    calls = []
    monkeypatch.setattr(grammar_pool, "busy", lambda: True)
    monkeypatch.setattr(entry.os, "_exit", fake_exit(calls))
    with pytest.raises(Exited):
        entry.end(status)
    assert calls == [status]


def test_an_idle_grammar_pool_exits_as_usual(monkeypatch):
    calls = []
    monkeypatch.setattr(grammar_pool, "busy", lambda: False)
    monkeypatch.setattr(entry.os, "_exit", fake_exit(calls))
    with pytest.raises(SystemExit) as exited:
        entry.end(0)
    assert exited.value.code == 0 and calls == []
