"""`./run.sh calibrate`'s sweep (tools/calibrate_plan.py) and its client
(tools/calibrate.py) against a small HTTP server standing in for a
frontend: what it plans covers what the fit needs, and what it sends is
what it planned."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from gmock_engine.config.loader import ConfigError
from gmock_engine.tools import calibrate
from gmock_engine.tools.calibrate_plan import ladder, prompt_lengths, sweep


def test_the_sweep_covers_every_batch_prompts_beyond_the_budget_mixed_steps_and_arrivals():
    phases = sweep(32, 2048, 8192)
    names = [p.name for p in phases]
    assert names == ["batch c1", "batch c2", "batch c3", "batch c4", "batch c6", "batch c8", "batch c12", "batch c16",
                     "batch c24", "batch c32", "prompt c1", "mixed c32", "poisson"]
    for p in phases[:10]:
        assert len(p.requests) >= p.concurrency and all(r.output >= 64 for r in p.requests), p
    prompts = sorted({r.prompt for r in phases[10].requests})
    assert prompts[0] <= 16 and 2047 in prompts and prompts[-1] > 2 * 2048, prompts  # chunked: 3 chunks
    mixed = phases[11].requests
    assert min(r.prompt for r in mixed) < 64 and max(r.prompt for r in mixed) > 1024, "mixed: short and long prompts"
    assert phases[12].rate is None and not phases[12].closed_loop  # its rate from the mixed phase's
    assert all(r.prompt + r.output <= 8192 for p in phases for r in p.requests)
    # the same seed, the same sweep; another, other lengths
    assert sweep(32, 2048, 8192, seed=0) == phases and sweep(32, 2048, 8192, seed=1) != phases


def test_a_short_model_len_caps_the_prompts_and_quick_is_small():
    phases = sweep(4, 2048, 1024, quick=True)
    assert all(r.prompt + r.output <= 1024 for p in phases for r in p.requests)
    assert sum(len(p.requests) for p in phases) <= 40
    assert max(r.prompt for r in phases[-3].requests) == 1024 - 8  # as long as the engine takes
    assert ladder(6) == [1, 2, 3, 4, 6] and ladder(1) == [1] and ladder(10) == [1, 2, 3, 4, 6, 8, 10]
    assert prompt_lengths(512, 10_000) == [16, 64, 256, 511, 768, 1280]
    with pytest.raises(ValueError):
        sweep(0, 2048, 1024)


def test_options_need_the_frontend_and_the_taps_addresses():
    with pytest.raises(ConfigError, match="--base-url"):
        calibrate.parse_args([], env={})
    with pytest.raises(ConfigError, match="--handshake-address"):
        calibrate.parse_args(["--base-url", "http://127.0.0.1:1"], env={})
    with pytest.raises(ConfigError, match="not an http"):
        calibrate.parse_args(["--base-url", "127.0.0.1:8000", "--drive-only"], env={})
    args = calibrate.parse_args(["--drive-only"], env={"GMOCK_CALIBRATE_BASE_URL": "http://127.0.0.1:1"})
    assert args.base_url == "http://127.0.0.1:1" and args.max_concurrency == 16 and args.output == "trace.jsonl"
    argv = calibrate._tap_argv(calibrate.parse_args(["--base-url", "http://h:1", "--handshake-address", "tcp://127.0.0.1:5",
                                                     "--engine-handshake-address", "tcp://127.0.0.1:6", "-o", "t.jsonl"], env={}))  # fmt: skip
    assert argv[2:5] == ["gmock_engine", "record", "--handshake-address"] and argv[-2:] == ["-o", "t.jsonl"]


class FakeFrontend(BaseHTTPRequestHandler):
    """/health, /v1/models and /v1/completions as vLLM's frontend answers
    them; each completion takes `delay` s and is recorded with the number in
    flight when it arrived."""

    delay = 0.02
    seen: list = []
    in_flight = 0
    lock = threading.Lock()

    def log_message(self, *args):  # quiet
        pass

    def _json(self, status, body):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/health":
            self._json(200, {})
        elif self.path == "/v1/models":
            self._json(200, {"data": [{"id": "served", "max_model_len": 600}]})
        else:
            self._json(404, {})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        cls = type(self)
        with cls.lock:
            cls.in_flight += 1
            cls.seen.append((body, cls.in_flight, time.monotonic()))
        time.sleep(cls.delay)
        with cls.lock:
            cls.in_flight -= 1
        if len(body["prompt"]) + body["max_tokens"] > 600:
            self._json(400, {"error": "too long"})
        else:
            self._json(200, {"usage": {"completion_tokens": body["max_tokens"]}})


@pytest.fixture
def frontend():
    FakeFrontend.seen = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeFrontend)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_the_client_sends_the_plan_as_planned(frontend, capsys):
    code = calibrate.main(["--base-url", frontend, "--drive-only", "--quick", "--max-concurrency", "4",
                           "--max-num-batched-tokens", "256"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    assert "max_model_len 600" in out and "calibrate: next: ./run.sh fit" in out
    phases = sweep(4, 256, 600, quick=True)
    planned = sorted((r.prompt, r.output) for p in phases for r in p.requests)
    sent = sorted((len(b["prompt"]), b["max_tokens"]) for b, _, _ in FakeFrontend.seen)
    assert sent == planned
    for body, _, _ in FakeFrontend.seen:
        assert body["model"] == "served" and body["ignore_eos"] is True and body["min_tokens"] == body["max_tokens"]
        assert all(calibrate.PROMPT_TOKEN_IDS[0] <= i < calibrate.PROMPT_TOKEN_IDS[1] for i in body["prompt"])
    # the closed loops: never more in flight than the phase's clients, and the ladder reaches 4
    closed = FakeFrontend.seen[: sum(len(p.requests) for p in phases[:-1])]
    assert max(n for _, n, _ in closed) == 4
    assert max(n for _, n, _ in closed[:1]) == 1


def test_failed_requests_are_counted_and_named(frontend, capsys):
    code = calibrate.main(["--base-url", frontend, "--drive-only", "--quick", "--max-concurrency", "2",
                           "--max-model-len", "4096", "--max-num-batched-tokens", "256"])  # fmt: skip
    captured = capsys.readouterr()
    assert code == 1
    assert "failed: " in captured.out and "status 400" in captured.out and "requests failed" in captured.err


def test_a_frontend_that_does_not_come_up_stops_it():
    code = calibrate.main(["--base-url", "http://127.0.0.1:9", "--drive-only", "--start-timeout", "1"])
    assert code == 2
