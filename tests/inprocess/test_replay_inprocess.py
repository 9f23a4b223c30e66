"""--replay: one gmock_engine App serving a recorded run back to the fake
frontend, in one hub (docs/record.md, Replay).

The trace is written by the test (known ids, counts, finishes and offsets).
Times: an output may not come before its recorded offset from the ADD; the
upper bound only allows for one step and the hub's latency (generous, for
a loaded machine). The exact "first step at or after the offset" is
checked on the engine's own clock in tests/unit/test_replay.py.
"""

import json
import time

import gevent

from fake_frontend import FakeFrontend
from gmock_engine.timing import trace
from gmock_engine.runtime.app import App
from gmock_engine.config.settings import from_config
from gmock_engine.config.loader import parse_config
from gmock_engine.wire.types import FinishReason

#: an output later than its offset by more than this failed the "first step at or after" rule
LATE = 0.25


def add(t, rid):
    return {"kind": "add", "t": t, "rank": 0, "client": 0, "request_id": rid, "arrival_time": t, "prompt_len": 3, "max_tokens": 16}


def out(t, rid, ids=None, count=None, finish=None, stop_reason=None):
    entry = {"id": rid, "tokens": len(ids) if ids is not None else count, "finish_reason": finish}
    if ids is not None:
        entry["token_ids"] = ids
    if stop_reason is not None:
        entry["stop_reason"] = stop_reason
    return {"kind": "output", "t": t, "rank": 0, "client": 0, "engine_index": 0, "requests": [entry], "finished_requests": None, "stats": None}


#: rec-a: ids recorded, three outputs, STOP on 15; rec-b: counts only, LENGTH
#: after 3 (the client asks 2: LENGTH at 2); the third ADD is not covered.
RECORDS = [
    add(50.0, "rec-a"),
    add(50.05, "rec-b"),
    out(50.25, "rec-b", count=1),
    out(50.55, "rec-b", count=2, finish=1),
    out(50.9, "rec-a", ids=[11, 12]),
    out(51.2, "rec-a", ids=[13]),
    out(51.4, "rec-a", ids=[14, 15], finish=0, stop_reason=15),
]
#: (offset from the ADD, tokens) of each output the client gets
EXPECTED_A = [(0.9, [11, 12]), (1.2, [13]), (1.4, [14, 15])]
EXPECTED_B_OFFSETS = [0.2]  # its second output is cut to 1 token by max_tokens 2: it ends there


def write_trace(path):
    lines = [trace.header(record_token_ids=True, ranks=[0]), *RECORDS]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return str(path)


def test_a_recorded_run_comes_back_with_its_ids_counts_finishes_and_times(tmp_path):
    frontend = FakeFrontend(num_clients=1, dp=1)
    config = parse_config(["--handshake-address", frontend.handshake_address, "--replay", write_trace(tmp_path / "t.jsonl")], env={})
    app = App(from_config(config), config)
    waiter = gevent.spawn(app.run)
    assert app.started.wait(10)
    try:
        frontend.accept_engines()
        assert app.wait_joined(5)
        sent = {}
        for rid, max_tokens in (("a", 16), ("b", 2), ("c", 3)):
            sent[rid] = time.monotonic()
            frontend.add(0, rid, max_tokens=max_tokens)
            if rid == "a":
                # b and c come while a waits for its first output: they are
                # admitted at once, not when a's wait is over
                gevent.sleep(0.15)
        received = {"a": [], "b": [], "c": []}
        with gevent.Timeout(10):
            while not all(outputs and outputs[-1][1][5:6] and outputs[-1][1][5] is not None for outputs in received.values()):
                message = frontend.recv()
                now = time.monotonic()
                for output in message[1]:
                    received[output[0]].append((now - sent[output[0]], output))
    finally:
        app.stop()
        assert waiter.get(timeout=5) == 0
        frontend.close()
    a = received["a"]
    why = f"(offset from the ADD, output) per request: {received}"
    assert [output[1] for _, output in a] == [ids for _, ids in EXPECTED_A], why
    assert a[-1][1][5] == FinishReason.STOP and a[-1][1][6] == 15, why
    for (offset, _), (elapsed, _) in zip(EXPECTED_A, a):
        assert offset <= elapsed < offset + LATE, why
    b = received["b"]
    assert [len(output[1]) for _, output in b] == [1, 1] and b[-1][1][5] == FinishReason.LENGTH, why
    assert EXPECTED_B_OFFSETS[0] <= b[0][0] < EXPECTED_B_OFFSETS[0] + LATE, why
    assert 0.5 <= b[1][0] < 0.5 + LATE, why  # its recorded second output's time
    c = received["c"]  # not in the trace: the model's (unpaced: at once, one token a step)
    assert [len(output[1]) for _, output in c] == [1, 1, 1] and c[-1][1][5] == FinishReason.LENGTH, why
    assert c[-1][0] < LATE, why
    assert all(counts["violations"] == 0 for counts in app.counters().values())
