"""How the real frontends react when the engine goes away.

With --send-dead-on-exit the engine pushes ENGINE_CORE_DEAD on every output
socket when it stops: both frontends then report it (/health 503, requests
fail fast with 500) instead of hanging. Without it (a crash, SIGKILL) they
keep answering /health 200 and requests hang: see docs/faults.md, "When the
engine goes away".
"""

from __future__ import annotations

import os
import signal
import time

import pytest

import e2e_harness as h
from test_frontends import COMPLETIONS, DP1_TOPOLOGIES, completion_body

ENGINE_ARGS = ["--itl-ms", "1", "--send-dead-on-exit"]

pytestmark = [pytest.mark.e2e, pytest.mark.parametrize("stack", DP1_TOPOLOGIES, indirect=True, ids=lambda t: t.id)]


def test_dead_engine_sentinel_makes_the_frontend_report_it(stack):
    r = stack.post(COMPLETIONS, completion_body(3, stream=False))
    assert r.status_code == 200, r.text[:300]
    os.killpg(stack.engine.popen.pid, signal.SIGTERM)
    h.wait_until(lambda: not stack.engine.alive(), 10, "gmock_engine to exit")
    assert stack.engine.popen.returncode == 0
    h.wait_until(lambda: h.http_status(stack.base_url + "/health") == 503, 15, "/health to report the dead engine")
    started = time.monotonic()
    r = stack.post(COMPLETIONS, completion_body(3, stream=False), timeout=15)
    assert r.status_code == 500 and time.monotonic() - started < 10, r.text[:300]
