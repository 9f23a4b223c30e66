"""Engines on other hosts, tested as hosts: network namespaces (netns.py) give
a frontend host and two engine hosts their own IPs on one bridge, and the
stack is started exactly as docs/operations.md "Engines on several hosts"
says (multihost.py): DP 4, ranks 0..1 on host 2 and 2..3 on host 3, the
Python frontend with 2 API servers, and vllm-rs.

* exact streams on every rank, each host's process serving its own slice,
  inside its own namespace;
* one engine host's link down for 2 s and 10 s while streams run (60 s with
  GMOCK_E2E_LONG_OUTAGE=1): every stream and every request sent meanwhile
  ends exact, the engines' books balance with no violation
  (link_faults.py, which also prints the docs' table);
* misconfigurations, each answered by the engine with what to change: the
  frontend advertising 0.0.0.0 or 127.0.0.1, a handshake port nothing listens
  on, a handshake address not reachable, DP sizes that disagree.

Needs root and `ip netns` (skipped otherwise, with the reason).
"""

from __future__ import annotations

import collections
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import e2e_harness as h
import link_faults
import multihost
import netns
from test_frontends import CHAT, COMPLETIONS, chat_body, check_stream, completion_body

ENGINE_ARGS = link_faults.ENGINE_ARGS
STREAMS = 32
#: How long the misconfiguration tests wait for the engine's message: the
#: one-time hint comes after 5 s, plus its 3 s TCP probe.
MESSAGE_WAIT_S = 30.0

RE_JOINED = re.compile(r"engine (\d+) joined the frontend: (\d+) client\(s\)")
RE_FINISHED = re.compile(r"mock request finished engine=(\d+) request_id=(\S+) output_tokens=(\d+)")


@pytest.fixture(scope="session")
def netns_ok():
    why = netns.unavailable()
    if why:
        pytest.skip(f"multi-host tests need network namespaces: {why}")
    netns.remove_leftovers()


@pytest.fixture(scope="module", params=["python", "rust"])
def stack(request, netns_ok, frontends, model_dir, tmp_path_factory):
    """A frontend host and two engine hosts running the docs' recipe (one per frontend kind)."""
    kind = request.param
    with netns.Hosts(3) as hosts:
        s = multihost.MultiHostStack(link_faults.topology(kind), frontends, model_dir,
                                     tmp_path_factory.mktemp(f"multihost-{kind}"), hosts, engine_args=ENGINE_ARGS)
        s.start()
        try:
            yield s
        finally:
            problems = s.stop()
            problems += [f"{g.name} exited rc={g.popen.returncode} after SIGTERM" for g in s.engines
                         if g.popen.returncode != 0]
            if problems:
                pytest.fail(f"teardown: {problems}\n{s.logs_report()}", pytrace=False)


def test_streams_exact_on_every_rank_each_host_its_slice(stack):
    """32 concurrent streams, all exact; every rank served some; host 2's process logged
    only ranks 0..1 and host 3's only 2..3."""
    offsets = stack.engine_log_offsets()
    failures: list = []

    def one(i: int) -> None:
        n = 16 + i % 17
        try:
            if i % 2:
                check_stream(stack, CHAT, chat_body(n, stream=True), n)
            else:
                check_stream(stack, COMPLETIONS, completion_body(n, stream=True, prompt=f"host {i}"), n)
        except BaseException as exc:  # noqa: BLE001 - reported below
            failures.append(f"stream {i}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(STREAMS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "streams still running after 120 s"
    assert not failures, failures[:5]
    per_process: dict = {}

    def logged() -> bool:
        per_process.clear()
        for index, offset in enumerate(offsets):
            with open(stack.engine_log_path(index), "rb") as f:
                f.seek(offset)
                text = f.read().decode("utf-8", "replace")
            per_process[index] = collections.Counter(int(m.group(1)) for m in RE_FINISHED.finditer(text))
        return sum(sum(c.values()) for c in per_process.values()) >= STREAMS

    h.wait_until(logged, 30, f"{STREAMS} finished lines in the engine logs")
    print(f"{stack.topology.id}: requests per rank, by host: "
          f"{ {stack.engine_host(i): dict(sorted(c.items())) for i, c in per_process.items()} }")
    assert set(per_process[0]) == {0, 1} and set(per_process[1]) == {2, 3}, per_process
    assert sum(sum(c.values()) for c in per_process.values()) == STREAMS


def test_each_process_runs_in_its_host(stack):
    """The frontend and each engine process run in their host's namespace; each engine
    process joined with exactly its ranks, on every API server's socket."""
    hosts = stack.hosts
    inode = {i: os.stat(f"/run/netns/{hosts.name(i)}").st_ino for i in (1, 2, 3)}
    assert multihost.netns_of(stack.frontend.popen.pid) == inode[1]
    clients = stack.topology.api_servers if stack.topology.frontend == "python" else 1
    for index, g in enumerate(stack.engines):
        # ranks 0..1 on host 2, 2..3 on host 3 (not engine_host(): that is what is checked)
        assert multihost.netns_of(g.popen.pid) == inode[2 + index], g.name
        text = stack.engine_log_text(index)
        assert sorted(int(m.group(1)) for m in RE_JOINED.finditer(text)) == [2 * index, 2 * index + 1], text[-2000:]
        assert {int(m.group(2)) for m in RE_JOINED.finditer(text)} == {clients}
        assert f"--handshake-address tcp://{hosts.address(1)}:{multihost.HANDSHAKE_PORT}" in text


_LONG = pytest.mark.skipif(os.environ.get("GMOCK_E2E_LONG_OUTAGE") != "1",
                           reason="the 60 s outages run with GMOCK_E2E_LONG_OUTAGE=1")
#: (seconds, silent): the link's carrier lost for 2 s; 10 s taken off the bridge silently.
OUTAGES = [(2, False), (10, True), pytest.param(60, False, marks=_LONG), pytest.param(60, True, marks=_LONG)]


@pytest.mark.parametrize("seconds, silent", OUTAGES, ids=lambda v: {True: "silent", False: "carrier"}.get(v, f"{v}s"))
def test_engine_host_link_down_while_streams_run(stack, seconds, silent):
    """Host 3's link down for `seconds` under load, then up: the streams on its ranks pause
    and resume, those on host 2 do not pause while it is down, every stream and every
    request sent meanwhile ends exact, 8 fresh streams are exact, and the engines' books
    balance."""
    offsets = stack.engine_log_offsets()
    result = link_faults.outage(stack, seconds, silent)
    print(link_faults.table([result.row()]))
    assert not result.problems(), "\n".join(result.problems())
    paused = result.paused_while_down()
    assert 0 < len(paused) < len(result.streams), (result.t_down, result.t_up, [s.silences for s in result.streams])
    started = sum(b.get("started", 0) for b in result.books.values())
    assert started == len(result.streams) + len(result.during) + len(result.fresh), result.books
    if seconds >= 10:
        # the cut host's engines saw their outputs wait for ACKs (runtime/frontend_watch.py), and
        # the end of it (read once a second: the line may come after the streams ended)
        assert "no TCP ACK from the frontend for" in result.engine_log, result.engine_lines
        h.wait_until(lambda: "the link to the frontend carries ACKs again" in stack.engine_logs_since(offsets), 10,
                     "the engines' line saying the link carries ACKs again")


# --------------------------------------------------------------------------- misconfigurations


@pytest.fixture
def hosts(netns_ok):
    with netns.Hosts(3) as made:
        yield made


def _misconfigured(kind, hosts, frontends, model_dir, tmp_path, **kw) -> multihost.MultiHostStack:
    s = multihost.MultiHostStack(link_faults.topology(kind), frontends, model_dir, tmp_path, hosts,
                                 engine_args=ENGINE_ARGS, **kw)
    s.start_frontend()
    s.start_engine()
    return s


def _wait_logged(s: multihost.MultiHostStack, needle: str, index=None) -> str:
    """The log of the engine process (any, or `index`) that logged `needle`, once it did."""
    found: dict = {}

    def seen() -> bool:
        for i in range(len(s.engines)) if index is None else [index]:
            text = s.engine_log_text(i)
            if needle in text:
                found["text"] = text
                return True
        return False

    try:
        h.wait_until(seen, MESSAGE_WAIT_S, f"{needle!r} in an engine log")
    except TimeoutError as exc:
        raise AssertionError(f"{exc}\n{s.logs_report(30)}") from None
    return found["text"]


@pytest.mark.parametrize("kind", ["python", "rust"])
def test_frontend_advertising_any_address(kind, hosts, frontends, model_dir, tmp_path):
    """--data-parallel-address 0.0.0.0: the handshake is reachable, but INIT names
    tcp://0.0.0.0:..., which on an engine host is the engine host: the engine says so
    and names the flag to change; the frontend never gets healthy."""
    s = _misconfigured(kind, hosts, frontends, model_dir, tmp_path, advertise="0.0.0.0")
    try:
        text = _wait_logged(s, "sent INIT naming tcp://0.0.0.0:")
        assert "The frontend was started with --data-parallel-address 0.0.0.0: restart it with" in text
        assert f"--data-parallel-address <the frontend host's IP as the engine hosts reach it> (here perhaps " \
               f"{hosts.address(1)})" in text
        if kind == "python":  # no misleading coordinator hint on top
            assert "ranks missing" not in text
        assert h.http_status(s.url("/health")) != 200
    finally:
        s.stop()


def test_frontend_advertising_loopback(hosts, frontends, model_dir, tmp_path):
    """--data-parallel-address 127.0.0.1 binds the handshake on the frontend host's loopback:
    the engines' TCP connect is refused, and their hint says why and which flag."""
    s = _misconfigured("rust", hosts, frontends, model_dir, tmp_path, advertise="127.0.0.1")
    try:
        text = _wait_logged(s, f"nothing listens at {hosts.address(1)}:{multihost.HANDSHAKE_PORT} (connection refused)")
        assert "--data-parallel-address 127.0.0.1 or localhost listens on its loopback only" in text
        assert "vllm-rs serve: --data-parallel-address IP (alias --handshake-host) --handshake-port PORT" in text
    finally:
        s.stop()


def test_handshake_unreachable_then_reachable(hosts, frontends, model_dir, tmp_path):
    """The frontend host's link down when the engines start: their TCP connect finds no
    route to it, the hint names routes and firewalls; link up: they join and /health is 200. A wrong
    port gets "connection refused" naming the address."""
    s = multihost.MultiHostStack(link_faults.topology("rust"), frontends, model_dir, tmp_path, hosts,
                                 engine_args=ENGINE_ARGS)
    try:
        s.start_frontend()
        hosts.link_down(1)
        try:
            s.start_engine()
            # no route (ARP finds nobody) or, should ARP take longer than the probe, a timeout
            text = _wait_logged(s, f"{hosts.address(1)}:{multihost.HANDSHAKE_PORT} is not reachable from this host (")
            assert "firewall" in text
        finally:
            hosts.link_up(1)
        s.wait_healthy()
        check_stream(s, COMPLETIONS, completion_body(8, stream=True), 8)
    finally:
        s.stop()
    wrong = _misconfigured("rust", hosts, frontends, model_dir, tmp_path / "wrong-port", handshake_port=29551)
    try:
        _wait_logged(wrong, f"nothing listens at {hosts.address(1)}:29551 (connection refused)")
    finally:
        wrong.stop()


def test_frontend_dp_larger_than_the_engines(hosts, frontends, model_dir, tmp_path):
    """Python frontend at DP 8, engines 0..3 of DP 4: they get INIT but the coordinator's
    READY waits for 8 engines; the engines say so, naming --data-parallel-size."""
    s = _misconfigured("python", hosts, frontends, model_dir, tmp_path, frontend_dp=8)
    try:
        text = _wait_logged(s, "got INIT but no READY from the frontend's DP coordinator")
        assert "the frontend's --data-parallel-size larger than the engines' --data-parallel-size" in text
    finally:
        s.stop()


def test_frontend_dp_smaller_than_the_engines(hosts, frontends, model_dir, tmp_path):
    """vllm-rs at DP 2, engines 0..3 of DP 4: vllm-rs takes the first two HELLOs, whatever
    their ranks, and then either exits on a third one or closes its handshake and serves
    with two; either way the engines left without INIT find the handshake closed and say
    so, asking whether the frontend's DP size is theirs (4)."""
    s = _misconfigured("rust", hosts, frontends, model_dir, tmp_path, frontend_dp=2)
    try:
        text = _wait_logged(s, f"nothing listens at {hosts.address(1)}:{multihost.HANDSHAKE_PORT} (connection refused)")
        assert "has exited (see its log), already has all its engines (both frontends close the handshake then: " \
               "is its --data-parallel-size 4 like this process's?)" in text
        frontend_log = re.sub(r"\x1b\[[0-9;]*m", "", s.frontend.tail(40))  # vllm-rs colours its log
        if not s.frontend.alive():
            assert "duplicate HELLO" in frontend_log
        else:
            assert "engines connected engine_count=2" in frontend_log
    finally:
        s.stop()


# --------------------------------------------------------------------------- the helper itself


def _netns_names() -> set:
    return {line.split()[0] for line in netns._ip("netns", "list").stdout.splitlines() if line.split()}


def _link_names() -> set:
    return {m.group(1) for m in re.finditer(r"^\d+:\s+([^:@\s]+)", netns._ip("-o", "link", "show").stdout, re.M)}


def test_a_silent_cut_of_any_host_leaves_the_others_reaching_the_client(netns_ok):
    """A silent link_down takes a port off the bridge: the bridge (the client's
    side) keeps its MAC, so the other hosts' ARP entries stay right and they
    keep reaching the client, whichever host's port had the lowest MAC."""
    with netns.Hosts(3) as made, socket.create_server((made.root_address, 0)) as server:
        port = server.getsockname()[1]

        def reaches(i: int) -> str:
            """'' if host i completes a TCP handshake with the client's side, else why not."""
            code = f"import socket; socket.create_connection(({made.root_address!r}, {port}), timeout=2).close()"
            done = subprocess.run(made.run(i, [sys.executable, "-c", code]), capture_output=True, text=True, timeout=20)
            return "" if done.returncode == 0 else done.stderr.strip().splitlines()[-1]

        assert [reaches(i) for i in (1, 2, 3)] == ["", "", ""]
        mac = Path(f"/sys/class/net/{made.bridge}/address").read_text().strip()
        for cut in (1, 2, 3):
            made.link_down(cut, silent=True)
            try:
                assert Path(f"/sys/class/net/{made.bridge}/address").read_text().strip() == mac, f"host {cut} cut"
                assert {i: reaches(i) for i in {1, 2, 3} - {cut}} == {i: "" for i in {1, 2, 3} - {cut}}, f"host {cut} cut"
            finally:
                made.link_up(cut, silent=True)


def test_hosts_are_removed_also_after_a_failure(netns_ok):
    """Leaving Hosts removes its namespaces, bridge and veths, also when the body raised;
    remove_leftovers removes what a process that no longer runs left behind."""
    with pytest.raises(RuntimeError):
        with netns.Hosts(2) as made:
            assert set(made.names) <= _netns_names() and made.bridge in _link_names()
            raise RuntimeError("a failing test")
    assert not set(made.names) & _netns_names()
    assert not {made.bridge, made.veth(1), made.veth(2)} & _link_names()
    dead = 4194304 + 1  # above Linux's pid_max: never a running process
    name = f"{netns.PREFIX}{dead}-1-1"
    netns._ip("netns", "add", name)
    netns._ip("link", "add", f"{netns.PREFIX}{dead}-1b", "type", "bridge")
    try:
        removed = netns.remove_leftovers()
        assert name in removed and f"{netns.PREFIX}{dead}-1b" in removed
        assert name not in _netns_names() and f"{netns.PREFIX}{dead}-1b" not in _link_names()
    finally:
        netns._ip("netns", "del", name, check=False)
        netns._ip("link", "del", f"{netns.PREFIX}{dead}-1b", check=False)
