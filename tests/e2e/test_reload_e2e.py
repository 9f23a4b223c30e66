"""Live reconfiguration behind a real frontend: SIGHUP while a stream runs.

gmock_engine runs with a --config file; a client streams a long completion
through the frontend. Mid-stream the file changes (--itl-ms 2 -> 20 and
--fault-error-mid-stream turned on) and the engine gets SIGHUP: the open
stream goes on to exactly its tokens, now 20 ms apart, while a new request
fails by the fault; a bad file is refused while the fault stays; the next
good file turns the fault off. The frontend never notices anything else.
"""

from __future__ import annotations

import signal
import threading
import time

import pytest

import e2e_harness as h
from test_frontends import COMPLETIONS, DP1_TOPOLOGIES, completion_body

pytestmark = pytest.mark.e2e

MAX_TOKENS = 300


@pytest.fixture(params=DP1_TOPOLOGIES, ids=lambda t: t.id)
def live(request, frontends, model_dir, tmp_path):
    """A stack whose engine reads tmp_path/live.ini (this module's own: it rewrites the file)."""
    path = tmp_path / "live.ini"
    path.write_text("[gmock_engine]\nitl-ms = 2\n")
    stack = h.Stack(request.param, frontends, model_dir, tmp_path / "logs", engine_args=["--config", str(path)])
    stack.start()
    try:
        yield stack, path
    finally:
        problems = stack.stop()
        if stack.engine.popen.returncode != 0:
            problems.append(f"gmock-engine exited rc={stack.engine.popen.returncode} after SIGTERM (expected 0)")
        assert not problems, f"{problems}\n{stack.logs_report()}"


def reload(stack, path, body, expect, offset):
    """Rewrite the file, SIGHUP the engine, wait for `expect` in its log after `offset`."""
    path.write_text("[gmock_engine]\n" + body)
    stack.engine.popen.send_signal(signal.SIGHUP)
    h.wait_until(lambda: expect in stack.engine_log_since(offset), 15, f"{expect!r} in the engine log", interval=0.1)
    return stack.engine_log_since(offset)


def short_request(stack):
    return stack.post(COMPLETIONS, completion_body(10, stream=False, prompt="short"))


def test_sighup_mid_stream(live):
    stack, path = live
    result = {}

    def stream():
        body = completion_body(MAX_TOKENS, stream=True, prompt="a long stream")
        with stack.post(COMPLETIONS, body, timeout=120) as r:
            r.raise_for_status()
            chunks, done = h.read_stream(r)
            result.update(chunks=chunks, done=done)

    reader = threading.Thread(target=stream, daemon=True)
    offset = stack.engine_log_size()
    started = time.monotonic()
    reader.start()
    h.wait_until(lambda: "mock request started" in stack.engine_log_since(offset), 15, "the stream to start", interval=0.05)
    time.sleep(0.1)  # ~50 tokens at 2 ms
    text = reload(stack, path, "itl-ms = 20\nfault-error-mid-stream = every=1\n", "config reload (generation 2", offset)
    reloaded = time.monotonic()
    assert f"--itl-ms 2 -> 20 (config file {path}, key itl-ms); --fault-error-mid-stream unset -> every=1" in text
    # a new request fails by the fault (half its tokens, then ERROR); the open stream does not
    assert short_request(stack).status_code == 500
    # a bad file: refused, the fault stays on
    text = reload(stack, path, "itl-ms = 2\nfault-error-mid-stream = often\n", "config reload refused", offset)
    assert "nothing changed (generation 2 stays, engines 0..0): argument --fault-error-mid-stream" in text
    assert short_request(stack).status_code == 500
    reader.join(timeout=60)
    assert not reader.is_alive(), "the stream did not end"
    ended = time.monotonic()
    chunks = result["chunks"]
    assert result["done"], f"no [DONE] after {len(chunks)} chunks"
    usage = [c["usage"] for c in chunks if c.get("usage")]
    finishes = [ch["finish_reason"] for c in chunks for ch in c.get("choices", []) if ch.get("finish_reason")]
    assert usage and usage[-1]["completion_tokens"] == MAX_TOKENS and finishes == ["length"], (usage, finishes)
    # most of the stream came after the reload, 20 ms a token: at least 100 of them
    assert ended - reloaded >= 100 * 0.020, (started, reloaded, ended)
    # the next good file turns the fault off
    reload(stack, path, "itl-ms = 2\n", "config reload (generation 3", offset)
    r = short_request(stack)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 10, r.text[:300]
