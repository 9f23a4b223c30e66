"""End-to-end scenarios: OpenAI API requests through a real vLLM frontend into gmock_engine.

Every test runs once per topology of the matrix (`stack` fixture, one
frontend + engine pair per topology, shared by the scenarios): Python frontend
DP1 / 1 API server, Python DP4 / 2 API servers, Rust frontend DP1, Rust DP4.

§N: section N of docs/protocol.md.
"""

from __future__ import annotations

import collections
import http.client
import json
import re
import subprocess
import threading
import time

import pytest
import requests

import e2e_harness as h

pytestmark = pytest.mark.e2e

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "Say something about mock engines."}]
PROMPT = "The quick brown fox jumps over the lazy dog"

#: run.sh arguments for this module's stacks (after --log-requests; GMOCK_E2E_ENGINE_ARGS
#: comes later and wins). A paced engine: with the default --itl-ms 0 one long stream
#: floods the Python frontend with outputs, and its API server then handles no
#: HTTP event (the client disconnect, /metrics) until it has worked off the backlog.
ENGINE_ARGS = ["--itl-ms", "1"]

#: Bounded waits for things the engine/frontend do asynchronously.
LOG_WAIT_S = 30.0
IDLE_WAIT_S = 30.0


def chat_body(max_tokens: int, stream: bool, **extra) -> dict:
    body = {"model": h.MODEL_NAME, "messages": MESSAGES, "max_tokens": max_tokens, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    body.update(extra)
    return body


def completion_body(max_tokens: int, stream: bool, **extra) -> dict:
    body = {"model": h.MODEL_NAME, "prompt": PROMPT, "max_tokens": max_tokens, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    body.update(extra)
    return body


def check_stream(stack: h.Stack, path: str, body: dict, max_tokens: int) -> list[dict]:
    """POST a streaming request and assert the OpenAI stream contract with `length` finish."""
    with stack.post(path, body) as r:
        assert r.status_code == 200, f"{path}: HTTP {r.status_code}: {r.text[:500]}"
        assert r.headers.get("content-type", "").startswith("text/event-stream"), r.headers
        chunks, done = h.read_stream(r)
    assert done, f"{path}: stream did not end with data: [DONE] ({len(chunks)} chunks)"
    assert chunks, f"{path}: no chunks before [DONE]"
    usage_chunks = [c for c in chunks if c.get("usage")]
    assert usage_chunks, f"{path}: no usage chunk although include_usage was set; last: {chunks[-1]}"
    assert chunks[-1].get("usage"), f"{path}: the usage chunk is not the last one: {chunks[-1]}"
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens"] == max_tokens, usage
    assert usage["prompt_tokens"] > 0, usage
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"], usage
    with_choices = [c for c in chunks if c.get("choices")]
    assert with_choices, f"{path}: no chunk carried choices"
    finishes = [ch["finish_reason"] for c in with_choices for ch in c["choices"] if ch.get("finish_reason")]
    assert finishes == ["length"], f"{path}: finish reasons in the stream: {finishes}"
    assert with_choices[-1]["choices"][-1]["finish_reason"] == "length", with_choices[-1]
    return chunks


#: The DP 1 topologies, for modules whose expectations need one engine.
DP1_TOPOLOGIES = [h.Topology("python", dp=1, api_servers=1), h.Topology("rust", dp=1)]


def metric_total(text: str, name: str) -> float:
    """Sum of a metric over all its label sets."""
    return sum(v for _, v in h.metric_samples(text, name))


def streams_while_sampling(stack: h.Stack, count: int, max_tokens: int, sample, timeout: float = 120) -> None:
    """Run `count` concurrent streaming completions of exactly `max_tokens`
    tokens, calling `sample(metrics_text)` every 0.1 s while they run; fail
    if any stream is wrong or still running after `timeout` seconds."""
    errors: list = []

    def one(i: int) -> None:
        try:
            check_stream(stack, COMPLETIONS, completion_body(max_tokens, stream=True, prompt=f"stream {i}"), max_tokens)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(f"request {i}: {exc}")

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(count)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
        sample(stack.metrics())
        time.sleep(0.1)
    for t in threads:
        t.join(timeout=max(0.1, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), f"streams still running after {timeout} s"
    assert not errors, errors[:5]


# --------------------------------------------------------------------------- single requests


def test_chat_stream_usage(stack):
    chunks = check_stream(stack, CHAT, chat_body(7, stream=True), 7)
    first = next(c for c in chunks if c.get("choices"))
    assert first["object"] == "chat.completion.chunk", first
    assert first["model"] == h.MODEL_NAME, first


def test_chat_non_stream(stack):
    r = stack.post(CHAT, chat_body(5, stream=False))
    assert r.status_code == 200, f"HTTP {r.status_code}: {r.text[:500]}"
    body = r.json()
    assert body["object"] == "chat.completion", body
    assert len(body["choices"]) == 1, body
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length", choice
    assert choice["message"]["role"] == "assistant", choice
    assert isinstance(choice["message"]["content"], str), choice
    assert body["usage"]["completion_tokens"] == 5, body["usage"]


def test_completion_plain(stack):
    r = stack.post(COMPLETIONS, completion_body(6, stream=False))
    assert r.status_code == 200, f"HTTP {r.status_code}: {r.text[:500]}"
    body = r.json()
    assert body["object"] == "text_completion", body
    assert len(body["choices"]) == 1, body
    assert body["choices"][0]["finish_reason"] == "length", body["choices"][0]
    assert isinstance(body["choices"][0]["text"], str), body["choices"][0]
    assert body["usage"]["completion_tokens"] == 6, body["usage"]


def test_completion_stream_usage(stack):
    chunks = check_stream(stack, COMPLETIONS, completion_body(4, stream=True), 4)
    assert next(c for c in chunks if c.get("choices"))["object"] == "text_completion", chunks[0]


def test_completion_n2(stack):
    max_tokens = 5
    if stack.topology.frontend == "python":
        r = stack.post(COMPLETIONS, completion_body(max_tokens, stream=False, n=2, return_token_ids=True))
        assert r.status_code == 200, f"HTTP {r.status_code}: {r.text[:500]}"
        body = r.json()
        choices = sorted(body["choices"], key=lambda c: c["index"])
        assert [c["index"] for c in choices] == [0, 1], body
        for c in choices:
            assert c["finish_reason"] == "length", c
            assert len(c["token_ids"]) == max_tokens, c
        assert body["usage"]["completion_tokens"] == 2 * max_tokens, body["usage"]
    else:
        # vllm-rs 0.33 does not implement n > 1 and says so with a 400.
        r = stack.post(COMPLETIONS, completion_body(max_tokens, stream=False, n=2))
        assert r.status_code == 400, f"HTTP {r.status_code}: {r.text[:500]}"
        err = r.json()
        assert "error" in err, err
        print(f"rust frontend, n=2: HTTP 400 {json.dumps(err)[:300]}")


# --------------------------------------------------------------------------- load


def _engine_started(text: str) -> list[tuple[int, str]]:
    return [(int(m.group(1)), m.group(2)) for m in h.RE_STARTED.finditer(text)]


def test_concurrent_streams_spread_over_ranks(stack):
    """64 concurrent streams, each with its own max_tokens; every DP rank serves some."""
    n = 64
    offset = stack.engine_log_size()
    results: list = [None] * n

    def one(i: int) -> None:
        max_tokens = 8 + i % 9
        try:
            if i % 2:
                check_stream(stack, CHAT, chat_body(max_tokens, stream=True), max_tokens)
            else:
                check_stream(stack, COMPLETIONS, completion_body(max_tokens, stream=True), max_tokens)
            results[i] = "ok"
        except BaseException as exc:  # reported below, with the request's index
            results[i] = f"request {i} (max_tokens {max_tokens}): {type(exc).__name__}: {exc}"

    t0 = time.monotonic()
    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=max(1.0, 180.0 - (time.monotonic() - t0)))
    hung = [i for i, t in enumerate(threads) if t.is_alive()]
    assert not hung, f"{len(hung)} streams still running after 180 s: {hung[:10]}"
    failures = [r for r in results if r != "ok"]
    assert not failures, f"{len(failures)}/{n} streams failed; first ones:\n" + "\n".join(map(str, failures[:5]))
    print(f"{n} concurrent streams done in {time.monotonic() - t0:.1f}s")

    # The engine logs every request it started (--log-requests); count the new ones.
    started: list = []

    def all_logged() -> bool:
        started[:] = _engine_started(stack.engine_log_since(offset))
        return len(started) >= n

    try:
        h.wait_until(all_logged, LOG_WAIT_S, f"{n} 'mock request started' lines in the engine log")
    except TimeoutError as exc:
        pytest.fail(f"{exc}: found {len(started)}")
    assert len(started) == n, f"expected {n} started requests, engine logged {len(started)}"
    per_rank = collections.Counter(rank for rank, _ in started)
    print(f"requests per engine rank: {dict(sorted(per_rank.items()))}")
    assert set(per_rank) == set(range(stack.topology.dp)), (
        f"ranks that served requests: {dict(per_rank)}, expected all of 0..{stack.topology.dp - 1}")


def _running_total(stack: h.Stack) -> tuple[float, int]:
    """Sum and number of samples of vllm:num_requests_running on the frontend's /metrics."""
    samples = h.metric_samples(stack.metrics(), "vllm:num_requests_running")
    return sum(v for _, v in samples), len(samples)


def _busy_ranks(stack: h.Stack) -> list[int]:
    """The engines (DP ranks) whose vllm:num_requests_running is not 0 on /metrics."""
    samples = h.metric_samples(stack.metrics(), "vllm:num_requests_running")
    return sorted({int(m.group(1)) for labels, v in samples if v and (m := re.search(r'engine="(\d+)"', labels))})


def wait_idle(stack: h.Stack, timeout: float = IDLE_WAIT_S) -> None:
    """Poll /metrics until vllm:num_requests_running sums to 0 (over all label sets).

    With several API servers the gauge is vLLM's multiprocess "mostrecent"
    (the value the last process to set it wrote), and an engine's
    SchedulerStats go to one API server only (vLLM's scheduler: "Return stats
    to only one of the front-ends"). An API server that reads an engine's
    stats of a running step after another has already set the idle stats
    that followed (both loops busy with the burst, the steps close together)
    leaves that engine's gauge stale at a nonzero value, as behind a real
    engine, until that engine sends stats again, though every request has
    finished in the engine. So, with
    several API servers only, after half the wait one short request pinned
    to each such engine (vLLM's X-data-parallel-rank header) makes it send
    stats again, which one API server sets last; the gauge must then reach
    0 as well. An engine that never reports itself idle still fails."""
    last: list = [None]

    def idle() -> bool:
        last[0] = _running_total(stack)
        total, count = last[0]
        return count > 0 and total == 0

    try:
        if stack.topology.frontend == "python" and stack.topology.api_servers > 1:
            try:
                h.wait_until(idle, timeout / 2, "vllm:num_requests_running == 0", interval=0.5)
                return
            except TimeoutError:
                pass
            for rank in _busy_ranks(stack):
                print(f"engine {rank}: vllm:num_requests_running stale at idle; one request pinned to it")
                r = requests.post(stack.url(COMPLETIONS), json=completion_body(2, stream=False),
                                  headers={"X-data-parallel-rank": str(rank)}, timeout=(5, 60))
                assert r.status_code == 200, r.text[:300]
            timeout /= 2
        h.wait_until(idle, timeout, "vllm:num_requests_running == 0", interval=0.5)
    except TimeoutError as exc:
        total, count = last[0]
        hint = ""
        if count == 0:
            # With several API servers vLLM uses Prometheus multiprocess mode, where a
            # gauge only has samples once some process set it from SchedulerStats.
            hint = " (no samples at all: the frontend never received SchedulerStats from the engine)"
        pytest.fail(f"{exc}: last sum {total} over {count} samples{hint}")


def test_metrics_idle_after_load(stack):
    """After a burst of mixed requests, the frontend's gauge of running requests returns to 0."""
    errors: list = []

    def one(i: int) -> None:
        try:
            if i % 3 == 0:
                check_stream(stack, CHAT, chat_body(12, stream=True), 12)
            elif i % 3 == 1:
                r = stack.post(COMPLETIONS, completion_body(9, stream=False))
                assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 9, r.text[:300]
            else:
                check_stream(stack, COMPLETIONS, completion_body(10, stream=True), 10)
        except BaseException as exc:
            errors.append(f"request {i}: {exc}")

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(24)]
    deadline = time.monotonic() + 120
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=max(0.1, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), "requests hung for 120 s"
    assert not errors, errors[:5]
    # With one API server the gauge exists (at 0) even if the engine never sends
    # SchedulerStats; test_running_gauge_counts_open_stream covers that case.
    wait_idle(stack)
    # The frontend counted the generated tokens (from the outputs' new_token_ids).
    gen = h.metric_samples(stack.metrics(), "vllm:generation_tokens_total")
    assert gen and sum(v for _, v in gen) >= 24 * 9, f"vllm:generation_tokens_total samples: {gen}"


def _metric_sum(stack: h.Stack, name: str) -> float:
    return sum(v for _, v in h.metric_samples(stack.metrics(), name))


def test_prompt_tokens_and_request_timings_come_from_the_engine(stack):
    """prefill_stats on each request's first output make vllm:prompt_tokens_total
    count exactly the prompts' tokens; its QUEUED/SCHEDULED events make the queue
    and prefill histograms small positive times, not raw clock values (§4.5)."""
    names = [
        "vllm:prompt_tokens_total",
        "vllm:request_queue_time_seconds_count",
        "vllm:request_queue_time_seconds_sum",
        "vllm:request_prefill_time_seconds_sum",
    ]
    before = {n: _metric_sum(stack, n) for n in names}
    expected_prompt, requests = 0, 6
    for i in range(requests):
        r = stack.post(COMPLETIONS, completion_body(3, stream=False, prompt=PROMPT + " again" * i))
        assert r.status_code == 200, r.text[:300]
        expected_prompt += r.json()["usage"]["prompt_tokens"]
    now: dict = {}

    def counted() -> bool:
        now.update({n: _metric_sum(stack, n) - before[n] for n in names})
        return now["vllm:prompt_tokens_total"] >= expected_prompt and now["vllm:request_queue_time_seconds_count"] >= requests

    try:
        h.wait_until(counted, 15, "the frontend to count the requests' prompt tokens and queue times", interval=0.5)
    except TimeoutError:
        pass
    assert now["vllm:prompt_tokens_total"] == expected_prompt, now
    assert now["vllm:request_queue_time_seconds_count"] == requests, now
    # engine clock differences: well under a second each, never the clock itself
    assert 0 <= now["vllm:request_queue_time_seconds_sum"] < 0.5 * requests, now
    assert 0 <= now["vllm:request_prefill_time_seconds_sum"] < 0.5 * requests, now


# --------------------------------------------------------------------------- abort


#: Far more than the engine makes before a client disconnect reaches it (100 s at
#: --itl-ms 1; about 1.5 s unpaced, where the Python frontend may not keep up, see
#: ENGINE_ARGS). The model dir allows up to 1048576.
DISCONNECT_MAX_TOKENS = 100_000


def stream_then_disconnect(stack: h.Stack, while_open=None):
    """Open a very long chat stream, read 3 chunks, call `while_open()`, then drop the
    connection. Returns (while_open's result, monotonic time of the close)."""
    body = json.dumps(chat_body(DISCONNECT_MAX_TOKENS, stream=True)).encode()
    conn = http.client.HTTPConnection("127.0.0.1", stack.http_port, timeout=30)
    result = None
    try:
        conn.request("POST", CHAT, body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200, f"HTTP {resp.status}: {resp.read(500)!r}"
        got = 0
        while got < 3:
            line = resp.fp.readline()
            assert line, "stream ended before 3 chunks"
            if line.startswith(b"data:"):
                assert b"[DONE]" not in line, "stream finished already"
                got += 1
        if while_open is not None:
            result = while_open()
    finally:
        h.hard_close(conn)
    return result, time.monotonic()


def wait_abort_logged(stack: h.Stack, offset: int, t_close: float) -> tuple[int, str]:
    """Wait for the engine to log the abort of the one request started since `offset`."""
    found: dict = {}

    def ended() -> bool:
        text = stack.engine_log_since(offset)
        found["started"] = _engine_started(text)
        found["aborted"] = [(int(m.group(1)), m.group(2)) for m in h.RE_ABORTED.finditer(text)]
        found["finished"] = [line for line in text.splitlines() if "mock request finished" in line]
        return bool(found["aborted"]) or bool(found["finished"])

    try:
        h.wait_until(ended, LOG_WAIT_S, "a 'mock request aborted' line in the engine log")
    except TimeoutError as exc:
        pytest.fail(f"{exc}; requests started meanwhile: {found.get('started')}")
    assert not found["finished"], (
        f"the engine finished the request instead of getting an abort "
        f"({time.monotonic() - t_close:.1f}s after the client closed): {found['finished']}")
    assert len(found["started"]) == 1, f"expected 1 started request, got {found['started']}"
    assert found["aborted"] == found["started"], (
        f"aborted {found['aborted']} is not the started request {found['started']}")
    return found["aborted"][0]


def test_client_disconnect_aborts(stack):
    """A client that goes away mid-stream makes the frontend abort the request in the
    engine (`mock request aborted` for exactly that request); then nothing runs."""
    offset = stack.engine_log_size()
    _, t_close = stream_then_disconnect(stack)
    rank, rid = wait_abort_logged(stack, offset, t_close)
    print(f"aborted engine={rank} request_id={rid}")
    wait_idle(stack)


def test_running_gauge_counts_open_stream(stack):
    """While a stream is open, the frontend's vllm:num_requests_running (fed by the
    engine's SchedulerStats) counts it; after the disconnect it returns to 0."""
    offset = stack.engine_log_size()
    seen: list = []

    def poll_running():
        def running() -> bool:
            seen.append(_running_total(stack))
            return seen[-1][0] >= 1

        try:
            h.wait_until(running, 5.0, "vllm:num_requests_running >= 1", interval=0.1)
            return True
        except TimeoutError:
            return False

    ok, _ = stream_then_disconnect(stack, poll_running)
    # Let the request end in the engine (abort, or finish if it outran the disconnect).
    h.wait_until(lambda: re.search(r"mock request (aborted|finished) ", stack.engine_log_since(offset)),
                 LOG_WAIT_S, "the request to end in the engine")
    assert ok, (f"vllm:num_requests_running (sum, samples) while the stream was open: {seen[-5:]}: "
                f"the frontend never saw the running request in the engine's SchedulerStats")
    wait_idle(stack)


# --------------------------------------------------------------------------- vllm bench serve


BENCH_PROMPTS = 200


def test_vllm_bench_serve(stack, model_dir, frontends):
    """vLLM's own benchmark client: 200 random prompts at 50 req/s, none may fail."""
    if stack.topology.frontend != "python":
        pytest.skip("bench serve runs against the Python frontend only: it is that frontend's own client")
    argv = [str(frontends.python), str(h.VLLM_CLI), "bench", "serve", "--backend", "openai",
            "--base-url", stack.base_url, "--model", h.MODEL_NAME, "--tokenizer", str(model_dir),
            "--dataset-name", "random", "--random-input-len", "32", "--random-output-len", "32",
            "--num-prompts", str(BENCH_PROMPTS), "--request-rate", "50", "--ignore-eos"]
    t0 = time.monotonic()
    proc = subprocess.run(argv, env=h.frontend_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, timeout=300, cwd=str(h.HERE))
    out = proc.stdout
    start = out.find("Serving Benchmark Result")
    summary = out[out.rfind("\n", 0, start) + 1:] if start >= 0 else out[-3000:]
    print(f"vllm bench serve: rc={proc.returncode} in {time.monotonic() - t0:.1f}s\n{summary}")
    assert proc.returncode == 0, f"rc={proc.returncode}\n--- stderr tail\n{h.tail_text(proc.stderr, 40)}"
    ok = re.search(r"^Successful requests:\s+(\d+)", out, re.M)
    failed = re.search(r"^Failed requests:\s+(\d+)", out, re.M)
    assert ok and failed, f"no summary in the output:\n{out[-3000:]}"
    assert int(failed.group(1)) == 0, summary
    assert int(ok.group(1)) == BENCH_PROMPTS, summary
    tokens = re.search(r"^Total generated tokens:\s+(\d+)", out, re.M)
    assert tokens and int(tokens.group(1)) == BENCH_PROMPTS * 32, summary
