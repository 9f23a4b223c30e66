"""Self-tests of the e2e harness itself (no gmock_engine involved).

They prove the plumbing the scenario tests rely on: the install check is quick,
a frontend's handshake port is seen listening without connecting to it, and
teardown leaves no process behind even when the Python frontend is still waiting
for engines (vLLM 0.32 swallows SIGTERM then; the harness repeats it).
"""

from __future__ import annotations

import socket
import time

import pytest

import e2e_harness as h

pytestmark = pytest.mark.e2e


def test_install_rerun_is_fast(frontends):
    t0 = time.monotonic()
    again = h.install_frontends()
    elapsed = time.monotonic() - t0
    assert again == frontends
    assert elapsed < 1.0, f"re-checking an existing install took {elapsed:.2f}s"
    assert frontends.python.exists() and frontends.vllm_rs.exists()


def test_is_listening_reads_proc():
    (port,) = h.free_ports(1)
    assert not h.is_listening(port)
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        assert not h.is_listening(port)  # bound is not listening
        s.listen(1)
        assert h.is_listening(port)
    assert not h.is_listening(port)


@pytest.mark.parametrize("topology", [h.Topology("python", dp=2, api_servers=1), h.Topology("rust", dp=2)],
                         ids=lambda t: t.id)
def test_frontend_waiting_for_engines_stops_cleanly(topology, frontends, model_dir, tmp_path):
    stack = h.Stack(topology, frontends, model_dir, tmp_path, with_engine=False)
    try:
        stack.start()
        assert h.is_listening(stack.hs_port)
        assert stack.frontend.alive()
        pgid = stack.frontend.pgid
    finally:
        problems = stack.stop()
    assert problems == [], f"{problems}\n{stack.logs_report()}"
    assert h.group_members(pgid) == []
    assert not h.is_listening(stack.hs_port)
    print(f"{topology.id}: {stack.timings}")
