"""gmock_engine/timing/trace.py: the record tap's trace records, writer and reader (docs/record.md)."""

import io
import json

import msgpack
import pytest

from fake_frontend import engine_core_request, era_request
from gmock_engine.timing import trace
from gmock_engine.tools.frontend import abort_frames, add_frames, utility_frames
from gmock_engine.wire.eras import WIRE_LAYOUTS


def packed(obj):
    return msgpack.packb(obj, use_bin_type=True)


STATS = {
    "num_running_reqs": 3,
    "num_waiting_reqs": 1,
    "kv_cache_usage": 0.25,
    "step_counter": 7,
    "current_wave": 0,
    "prefix_cache_stats": {"reset": False, "requests": 2, "queries": 40, "hits": 16, "preempted_requests": 1,
                           "preempted_queries": 300, "preempted_hits": 256},
    "kv_cache_eviction_events": [],
}


def test_add_record_has_the_timing_fields():
    sampling = {"max_tokens": 9, "temperature": 0.5, "ignore_eos": True, "min_tokens": 2, "stop": ["x"], "seed": 4}
    request = engine_core_request("a-1", prompt_token_ids=[5, 6, 7, 8], sampling_params=sampling, client_index=1, priority=2)
    record = trace.input_record(12.5, 3, 1, add_frames(request))
    assert record == {
        "kind": "add", "t": 12.5, "rank": 3, "client": 1, "request_id": "a-1",
        "arrival_time": 1795975013.91, "prompt_len": 4, "max_tokens": 9,
        "sampling": {"min_tokens": 2, "ignore_eos": True, "temperature": 0.5, "seed": 4},
        "priority": 2, "client_index": 1,
    }  # fmt: skip
    assert "prompt_token_ids" not in record
    assert trace.input_record(0, 0, 0, add_frames(request), token_ids=True)["prompt_token_ids"] == [5, 6, 7, 8]


def test_add_record_absent_max_tokens_is_16_and_old_layouts_read_arrival_time():
    request = engine_core_request("b", sampling_params={"temperature": 1.0})
    assert trace.input_record(0, 0, 0, add_frames(request))["max_tokens"] == 16
    old = era_request(WIRE_LAYOUTS["0.11.0"], "old", prompt=[1, 2], arrival_time=77.0, client_index=0)
    record = trace.input_record(0, 0, 0, add_frames(old))
    assert (record["request_id"], record["arrival_time"], record["prompt_len"], record["max_tokens"]) == ("old", 77.0, 2, 4)


def test_abort_utility_and_undecodable_inputs():
    assert trace.input_record(1, 0, 0, abort_frames(["x", "y"])) == {"kind": "abort", "t": 1, "rank": 0, "client": 0, "request_ids": ["x", "y"]}
    record = trace.input_record(1, 0, 0, utility_frames(0, 99, "get_supported_tasks", []))
    assert (record["kind"], record["call_id"], record["method"]) == ("utility", 99, "get_supported_tasks")
    assert trace.input_record(1, 0, 0, [b"\x07", packed([])])["kind"] == "undecodable"
    assert trace.input_record(1, 0, 0, [b"\x00", b"\xc1"])["kind"] == "undecodable"


def test_output_record_tokens_finishes_and_stats():
    message = [2, [["a", [1, 2, 3]], ["b", [9], None, None, None, 1], ["c", [], None, None, None, 0, 4]], STATS, 5.5, None, ["b", "c"]]
    record = trace.output_record(10.0, 2, 0, [packed(message)])
    assert record == {
        "kind": "output", "t": 10.0, "rank": 2, "client": 0, "engine_index": 2, "engine_timestamp": 5.5,
        "requests": [
            {"id": "a", "tokens": 3, "finish_reason": None},
            {"id": "b", "tokens": 1, "finish_reason": 1},
            {"id": "c", "tokens": 0, "finish_reason": 0, "stop_reason": 4},
        ],
        "finished_requests": ["b", "c"],
        "stats": {"num_running_reqs": 3, "num_waiting_reqs": 1, "kv_cache_usage": 0.25, "step_counter": 7,
                  "current_wave": 0, "prefix_cache": {"requests": 2, "queries": 40, "hits": 16, "preempted_requests": 1,
                                                      "preempted_queries": 300, "preempted_hits": 256}},
    }  # fmt: skip
    with_ids = trace.output_record(0, 0, 0, [packed(message)], token_ids=True)
    assert [r["token_ids"] for r in with_ids["requests"]] == [[1, 2, 3], [9], []]


def test_output_record_keeps_events_and_num_cached_tokens_of_every_layout():
    events = [{"type": 1, "timestamp": 5.0}, {"type": 2, "timestamp": 5.25}]
    prefill = {"num_prompt_tokens": 96, "num_computed_tokens": 32, "num_cached_tokens": 64}
    tail = [None, None, None, None, None]  # logprobs, prompt logprobs, pooling, finish, stop
    outputs = [
        ["new", [1], *tail, events, None, None, {"traceparent": "x"}, prefill, None, 0],  # 0.26+: index 11
        ["mid", [1], *tail, None, None, None, dict(prefill, num_cached_tokens=32), None, 0],  # 0.20-0.25: index 10
        ["old", [1], *tail, None, None, None, 0],  # 0.11-0.19: an int at index 10, present even when 0
        ["later", [2], *tail, None, None, None, None, None, None, 0],  # no prefill accounting
    ]
    record = trace.output_record(0, 0, 0, [packed([0, outputs, None, 1.0])])
    by_id = {r["id"]: r for r in record["requests"]}
    assert by_id["new"]["events"] == [[1, 5.0], [2, 5.25]]
    assert [by_id[i].get("num_cached_tokens") for i in ("new", "mid", "old", "later")] == [64, 32, 0, None]
    assert "events" not in by_id["later"] and "num_cached_tokens" not in by_id["later"]
    assert trace.num_cached_tokens(["short", []]) is None


def test_utility_reply_dead_sentinel_and_garbage_outputs():
    reply = trace.output_record(0, 0, 0, [packed([0, [], None, 1.0, [42, None, [None, ["generate"]]]])])
    assert (reply["utility_call_id"], reply["requests"], reply["stats"]) == (42, [], None)
    assert trace.output_record(0, 1, 0, [b"ENGINE_CORE_DEAD"]) == {"kind": "dead", "t": 0, "rank": 1, "client": 0}
    assert trace.output_record(0, 0, 0, [b"\xc1"])["kind"] == "undecodable"


def test_writer_then_reader_round_trip():
    stream = io.StringIO()
    writer = trace.TraceWriter(stream, token_ids=False, ranks=[0])
    writer.input(1.0, 0, 0, add_frames(engine_core_request("r", sampling_params={"max_tokens": 2})))
    writer.output(2.0, 0, 0, [packed([0, [["r", [4, 5], None, None, None, 1]], None, 3.0, None, ["r"]])])
    assert writer.records == 2
    head, records = trace.parse_lines(io.StringIO(stream.getvalue()))
    assert head == {"format": "gmock-trace", "version": 1, "record_token_ids": False, "ranks": [0]}
    records = list(records)
    assert [r["kind"] for r in records] == ["add", "output"]
    assert records[1]["requests"] == [{"id": "r", "tokens": 2, "finish_reason": 1}]
    assert all(line == json.dumps(json.loads(line), separators=(",", ":")) for line in stream.getvalue().splitlines())


def test_reader_refuses_foreign_or_newer_files_and_skips_a_cut_last_line(tmp_path):
    with pytest.raises(trace.TraceFormatError):
        trace.parse_lines(io.StringIO('{"format": "other", "version": 1}\n'))
    with pytest.raises(trace.TraceFormatError):
        trace.parse_lines(io.StringIO('{"format": "gmock-trace", "version": 2}\n'))
    with pytest.raises(trace.TraceFormatError):
        trace.parse_lines(io.StringIO("not json\n"))
    path = tmp_path / "t.jsonl"
    path.write_text('{"format":"gmock-trace","version":1}\n{"kind":"abort","request_ids":[]}\n{"kind":"ad')
    head, records = trace.read_trace(str(path))
    assert records == [{"kind": "abort", "request_ids": []}]
    _, broken = trace.parse_lines(io.StringIO('{"format":"gmock-trace","version":1}\n{"kind":\n{}\n'))
    with pytest.raises(trace.TraceFormatError):
        list(broken)
