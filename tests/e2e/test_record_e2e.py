"""The record tap (docs/record.md) between a real frontend and the mock engine:
the frontend serves streams with exact token counts through it, and the
trace holds every ADD and every request's tokens and finish. §N: section N of
docs/protocol.md."""

from __future__ import annotations

import concurrent.futures
import os
import re
import time

import pytest

import e2e_harness as h
from gmock_engine.timing.trace import read_trace

PROMPT = "The quick brown fox jumps over the lazy dog"
LENGTHS = (4, 6, 9)


class TapStack(h.Stack):
    """A stack whose engines join the tap, which joins the frontend."""

    #: the tap's further options (test_replay_e2e: --record-token-ids)
    tap_args: tuple = ()

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        (self.tap_port,) = h.free_ports(1)
        self.trace_path = self.log_dir / "trace.jsonl"
        self.tap = None

    def engine_argv(self, process_args=None):
        argv = super().engine_argv(process_args)
        return [a.replace(f":{self.hs_port}", f":{self.tap_port}") if a.startswith("tcp://") else a for a in argv]

    def start_engine(self):
        t = self.topology
        argv = [h.RUN_SH, "record", "--handshake-address", f"tcp://127.0.0.1:{self.hs_port}",
                "--engine-handshake-address", f"tcp://127.0.0.1:{self.tap_port}",
                "--engine-count", str(t.dp), "-o", self.trace_path, *self.tap_args]  # fmt: skip
        self.tap = h.ProcessGroup("record-tap", argv, self.log_dir / "tap.log", env={"PYTHONUNBUFFERED": "1", **_env()}, cwd=h.REPO)
        super().start_engine()
        self.engines.append(self.tap)


def _env():
    """The tap's environment: without the harness's own variables."""
    return {k: v for k, v in os.environ.items() if not k.startswith("GMOCK_E2E_") and k != "GMOCK_FRONTENDS_HOME"}


@pytest.fixture(scope="module", params=[h.Topology("python", dp=1), h.Topology("python", dp=2, api_servers=2), h.Topology("rust", dp=2)], ids=lambda t: t.id)
def tapped(request, frontends, model_dir, tmp_path_factory):
    s = TapStack(request.param, frontends, model_dir, tmp_path_factory.mktemp(f"record-{request.param.id}"), engine_args=["--itl-ms", "2"])
    s.start()
    try:
        yield s
    finally:
        problems = s.stop()
    assert not problems, problems
    assert s.tap.popen.returncode == 0, s.logs_report()


def completion(stack, max_tokens):
    """(text, completion tokens, finish reasons) of one streamed completion."""
    body = {"model": h.MODEL_NAME, "prompt": PROMPT, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    with stack.post("/v1/completions", body) as r:
        assert r.status_code == 200, r.text[:500]
        chunks, done = h.read_stream(r)
    assert done
    choices = [c["choices"][0] for c in chunks if c.get("choices")]
    text = "".join(c.get("text") or "" for c in choices)
    return text, chunks[-1]["usage"]["completion_tokens"], [c["finish_reason"] for c in choices if c.get("finish_reason")]


def stream(stack, max_tokens):
    """(completion tokens, finish reasons) of one streamed completion."""
    _, tokens, finishes = completion(stack, max_tokens)
    return tokens, finishes


def test_streams_through_the_tap_are_exact_and_traced(tapped):
    with concurrent.futures.ThreadPoolExecutor(len(LENGTHS)) as pool:
        results = list(pool.map(lambda n: stream(tapped, n), LENGTHS))
    assert results == [(n, ["length"]) for n in LENGTHS]

    tapped.stop()
    assert tapped.tap.popen.returncode == 0, tapped.logs_report()
    head, records = read_trace(str(tapped.trace_path))
    assert head["ranks"] == list(range(tapped.topology.dp))
    adds = [r for r in records if r["kind"] == "add"]
    assert sorted(r["max_tokens"] for r in adds) == sorted(LENGTHS)
    assert len({r["prompt_len"] for r in adds}) == 1 and adds[0]["prompt_len"] > 0
    outputs = [r for r in records if r["kind"] == "output"]
    for add in adds:
        mine = [(r["rank"], q) for r in outputs for q in r["requests"] if q["id"] == add["request_id"]]
        assert sum(q["tokens"] for _, q in mine) == add["max_tokens"]
        assert mine[-1][1]["finish_reason"] == 1
        assert {rank for rank, _ in mine} == {add["rank"]}
    # what each engine counted itself (its summary line at exit) is what the trace holds for its rank
    summaries = re.findall(r"engine (\d+) summary: .*\btokens=(\d+) utility_calls=(\d+)", tapped.engine_log_text())
    assert sorted(int(rank) for rank, _, _ in summaries) == head["ranks"], tapped.engine_log_text()[-2000:]
    for rank, tokens, calls in summaries:
        assert sum(q["tokens"] for r in outputs if r["rank"] == int(rank) for q in r["requests"]) == int(tokens)
        assert sum(1 for r in records if r["kind"] == "utility" and r["rank"] == int(rank)) == int(calls)
    if tapped.topology.frontend == "python":
        # its API server's startup utility calls (§5) went through the tap as well
        assert {"reset_mm_cache", "get_supported_tasks"} <= {r["method"] for r in records if r["kind"] == "utility"}


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def tapped_scheduling(request, frontends, model_dir, tmp_path_factory):
    """The mock scheduling each step as the one before ends, or a step ahead
    (--async-scheduling), behind the real Python frontend and the tap."""
    engine_args = ["--itl-ms", "5", "--prefill-ms-per-token", "0.05"] + (["--async-scheduling"] if request.param else [])
    topology = h.Topology("python", dp=1)
    s = TapStack(topology, frontends, model_dir, tmp_path_factory.mktemp(f"record-sched-{request.param}"), engine_args=engine_args)
    s.start()
    try:
        yield s, request.param
    finally:
        problems = s.stop()
    assert not problems, problems


def test_the_fit_reads_from_a_trace_whether_the_engine_scheduled_a_step_ahead(tapped_scheduling, tmp_path):
    """Requests that come while the batch runs get their first token one
    step after the boundary they were scheduled at, or two when the engine
    schedules a step ahead: what `./run.sh fit` reads (docs/latency-profile.md)."""
    from gmock_engine.tools import fit
    from gmock_engine.tools.steps import schedules_ahead, scheduling_lags

    stack, ahead = tapped_scheduling

    def staggered(i):
        time.sleep(0.03 * i)  # each comes while the ones before decode
        return stream(stack, 40)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        assert list(pool.map(staggered, range(8))) == [(40, ["length"])] * 8
    stack.stop()
    _, records = read_trace(str(stack.trace_path))
    lags = scheduling_lags(records)
    assert schedules_ahead(lags) is ahead, lags
    assert lags.get(2 if ahead else 1, 0) >= 5, lags
    profile = tmp_path / "profile.ini"
    assert fit.main([str(stack.trace_path), "--model", "linear", "-o", str(profile)]) == 0
    assert ("serve with --async-scheduling" in profile.read_text()) is ahead
