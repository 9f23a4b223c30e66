"""Engines on another host than the frontend (wire/handshake.py): the INIT
that names the engine's own host (a frontend started with
--data-parallel-address 127.0.0.1 / localhost / 0.0.0.0), and the texts for
what a TCP connect to the handshake address found. The real thing, with
network namespaces: tests/e2e/test_multihost_e2e.py."""

import pytest

from gmock_engine.wire.handshake import (
    COORDINATOR_WAIT_HINT,
    InitMessage,
    init_address_problem,
    names_this_host,
    reach_hint,
    tcp_host_port,
)


def init(host: str, coordinator: bool = False) -> InitMessage:
    coord = (f"tcp://{host}:39871", f"tcp://{host}:33673") if coordinator else (None, None)
    return InitMessage([f"tcp://{host}:42483"], [f"tcp://{host}:33863"], *coord, "ipc:///tmp/stats")


@pytest.mark.parametrize("address, expected", [
    ("tcp://10.0.0.1:29550", ("10.0.0.1", 29550)),
    ("tcp://frontend.svc:1", ("frontend.svc", 1)),
    ("tcp://[::1]:5", ("::1", 5)),
    ("ipc:///tmp/hs", None),
    ("tcp://nohost", None),
    ("tcp://host:port", None),
])  # fmt: skip
def test_tcp_host_port(address, expected):
    assert tcp_host_port(address) == expected


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "localhost", "LOCALHOST", "0.0.0.0", "::", "::1", "*"])
def test_names_this_host(host):
    assert names_this_host(host)


@pytest.mark.parametrize("host", ["10.0.0.1", "frontend.svc", "192.168.1.127", "fd00::1"])
def test_names_another_host(host):
    assert not names_this_host(host)


@pytest.mark.parametrize("advertised", ["127.0.0.1", "0.0.0.0", "localhost"])
def test_init_naming_this_host_from_a_remote_handshake_names_the_flag(advertised):
    text = init_address_problem("tcp://10.0.0.1:29550", init(advertised, coordinator=True))
    assert text is not None
    assert f"tcp://{advertised}:42483" in text and f"tcp://{advertised}:39871" in text
    assert f"started with --data-parallel-address {advertised}" in text
    assert "--data-parallel-address <the frontend host's IP as the engine hosts reach it> (here perhaps 10.0.0.1)" in text
    assert "vllm serve: --data-parallel-address IP --data-parallel-rpc-port PORT" in text
    assert "vllm-rs serve: --data-parallel-address IP (alias --handshake-host) --handshake-port PORT" in text
    assert "ipc://" not in text  # the stats address is frontend-internal


@pytest.mark.parametrize("handshake, advertised", [
    ("tcp://127.0.0.1:29550", "127.0.0.1"),  # one host: loopback is right
    ("tcp://localhost:29550", "127.0.0.1"),
    ("tcp://10.0.0.1:29550", "10.0.0.1"),  # several hosts, done right
    ("tcp://frontend.svc:29550", "10.1.2.3"),  # a name for the frontend host
    ("ipc:///tmp/hs", "127.0.0.1"),
])  # fmt: skip
def test_no_problem(handshake, advertised):
    assert init_address_problem(handshake, init(advertised, coordinator=True)) is None


def test_reach_hint_open_points_at_the_dp_size():
    text = reach_hint("tcp://10.0.0.1:29550", "open", "engines 2..3", 4, 3)
    assert text.startswith("10.0.0.1:29550 accepts connections, but sent no INIT to engines 2..3")
    assert "--data-parallel-size must be 4 like this process's" in text and "covers 0..3 exactly once" in text


def test_reach_hint_refused_names_the_address_and_the_frontend_flags():
    text = reach_hint("tcp://10.0.0.1:29550", "refused", "engines 0..1", 4, 1)
    assert text.startswith("nothing listens at 10.0.0.1:29550 (connection refused)")
    assert "already has all its engines (both frontends close the handshake then: is its --data-parallel-size 4 " \
           "like this process's?)" in text
    assert "--data-parallel-address 127.0.0.1 or localhost listens on its loopback only" in text
    assert "vllm serve: --data-parallel-address IP --data-parallel-rpc-port PORT" in text


@pytest.mark.parametrize("outcome, why", [("timeout", "TCP connect timed out"), ("unreachable", "no route to host")])
def test_reach_hint_unreachable_names_routes_and_firewalls(outcome, why):
    text = reach_hint("tcp://10.0.0.1:29550", outcome, "engine 0", 1, 0)
    assert text.startswith(f"10.0.0.1:29550 is not reachable from this host ({why}: ")
    assert "firewall" in text and "ephemeral ports" in text


def test_reach_hint_other_errors():
    text = reach_hint("tcp://nowhere.invalid:29550", "Name or service not known", "engine 0", 1, 0)
    assert text == ("connecting to nowhere.invalid:29550 failed (Name or service not known): "
                    "check the address of --handshake-address")  # fmt: skip


def test_coordinator_hint_names_the_dp_size():
    assert "--data-parallel-size" in COORDINATOR_WAIT_HINT and "ranks missing" in COORDINATOR_WAIT_HINT
