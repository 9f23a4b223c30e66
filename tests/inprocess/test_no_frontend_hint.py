"""The bare engine with no frontend: after NO_FRONTEND_HINT_AFTER_S it says once
what it waits for and how to start a frontend (runtime/frontend_hint.py); the real program: in
tests/test_cli_subprocess.py."""

from types import SimpleNamespace

import gevent
import gevent.event
import pytest

from gmock_engine.runtime import frontend_hint as hints


def test_the_hint_names_the_address_and_both_frontends_commands():
    text = hints.no_frontend_hint("tcp://127.0.0.1:29550", [0, 1, 2, 3], [], 4, 5.0)
    assert text.startswith("no frontend answered at tcp://127.0.0.1:29550 after 5 s: engines 0..3 sent HELLO and wait for INIT.")
    assert "vllm-rs serve MODEL --data-parallel-size-local 0 --data-parallel-size 4 --handshake-port 29550" in text
    assert ("vllm serve MODEL --data-parallel-size-local 0 --data-parallel-size 4 --data-parallel-address 127.0.0.1 "
            "--data-parallel-rpc-port 29550 --api-server-count 1") in text  # fmt: skip
    assert text.endswith("or run ./run.sh serve --dp 4: a real frontend and the mock engines in one command")


def test_an_ipc_address_gets_the_generic_advice():
    text = hints.no_frontend_hint("ipc:///tmp/hs", [0], [], 1, 5.0)
    assert "at ipc:///tmp/hs" in text and "engine 0 sent HELLO" in text and "--handshake-port" not in text
    assert "--data-parallel-size 1 (README, Pairing with a frontend)" in text


def test_some_ranks_joined_points_at_the_dp_size():
    text = hints.no_frontend_hint("tcp://127.0.0.1:29550", [2, 3], [0, 1], 4, 5.0)
    assert text.startswith("engines 2..3 got no INIT from the frontend at tcp://127.0.0.1:29550 after 5 s, while engines 0..1 joined")
    assert "--data-parallel-size 4?" in text


def _runners(joined):
    runners = []
    for rank, is_joined in enumerate(joined):
        event = gevent.event.Event()
        if is_joined:
            event.set()
        runners.append(SimpleNamespace(rank=rank, joined=event))
    return runners


CONFIG = SimpleNamespace(handshake_address="tcp://127.0.0.1:29550", data_parallel_size=2)


@pytest.mark.parametrize("joined, expected", [((False, False), 1), ((True, False), 1), ((True, True), 0)])
def test_once_after_the_delay_and_only_while_an_engine_waits(monkeypatch, joined, expected):
    monkeypatch.setattr(hints, "NO_FRONTEND_HINT_AFTER_S", 0.05)
    warned = []
    monkeypatch.setattr(hints.logger, "warning", lambda text, *a: warned.append(text))
    hint = gevent.spawn(hints.hint_if_no_frontend, _runners(joined), CONFIG)
    gevent.sleep(0.02)
    assert warned == []  # not before the delay
    hint.join(timeout=2)
    gevent.sleep(0.1)
    assert hint.dead and len(warned) == expected
