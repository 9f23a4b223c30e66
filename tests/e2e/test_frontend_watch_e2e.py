"""The bare engine watches its real frontend (runtime/frontend_watch.py): a frontend
killed with SIGKILL (its kernel closes its connections) is noticed within a
few seconds, with one "frontend gone" line and gmock_frontend_connected 0 on
the engine's /metrics, and with --exit-when-frontend-gone the engine exits 0
after the timeout. Both frontends (DP1), default heartbeats (off).
"""

from __future__ import annotations

import os
import re
import signal
import time

import pytest
import requests

import e2e_harness as h
from test_frontends import COMPLETIONS, DP1_TOPOLOGIES, completion_body

EXIT_AFTER_S = 3.0
#: "frontend gone" comes this soon after the kill, at most.
NOTICED_WITHIN_S = 3.0
ENGINE_ARGS = ["--itl-ms", "1", "--metrics-port", "0", "--exit-when-frontend-gone", str(EXIT_AFTER_S)]

pytestmark = [pytest.mark.e2e, pytest.mark.parametrize("stack", DP1_TOPOLOGIES, indirect=True, ids=lambda t: t.id)]


def _engine_metric(stack: h.Stack, name: str) -> float:
    port = re.search(r"metrics at http://127\.0\.0\.1:(\d+)/metrics", stack.engine_log_text()).group(1)
    text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    return sum(value for _, value in h.metric_samples(text, name))


def test_a_killed_frontend_is_noticed_and_the_engine_exits_0_after_the_timeout(stack):
    log = stack.engine_log_text
    r = stack.post(COMPLETIONS, completion_body(3, stream=False), timeout=30)
    assert r.status_code == 200, r.text[:300]
    assert _engine_metric(stack, "gmock_frontend_connected") == 1
    assert "frontend gone" not in log()

    os.killpg(stack.frontend.pgid, signal.SIGKILL)
    killed = time.monotonic()
    h.wait_until(lambda: "frontend gone" in log(), NOTICED_WITHIN_S, "the 'frontend gone' line")
    assert _engine_metric(stack, "gmock_frontend_connected") == 0
    assert _engine_metric(stack, "gmock_frontend_outages_total") == 1
    h.wait_until(lambda: not stack.engine.alive(), EXIT_AFTER_S + 5, "gmock_engine to exit")
    assert stack.engine.popen.returncode == 0, stack.logs_report()
    assert time.monotonic() - killed >= EXIT_AFTER_S
    text = log()
    assert text.count("frontend gone") == 1 and "--exit-when-frontend-gone" in text, text[-2000:]
