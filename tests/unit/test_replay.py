"""gmock_engine/timing/replay.py: a trace read into recorded requests, matched to
ADDs, and a pure EngineCore serving them back (docs/record.md, Replay)."""

import argparse
import json

import pytest

from gmock_engine.config import reload
from gmock_engine.timing import trace
from gmock_engine.config.loader import ConfigError, parse_config
from gmock_engine.timing.replay import RecordedOutput, ReplaySettings, load, recorded_requests, settings_from
from gmock_engine.config.settings import from_config
from gmock_engine.config.validators import replay_trace
from gmock_engine.wire.inputs import AbortRequests, EngineCoreRequest
from gmock_engine.wire.types import FinishReason
from engine_steps import Clock, drive, engine_with, outputs_of, tokens_of


def add(t, rid, rank=0, max_tokens=16):
    return {"kind": "add", "t": t, "rank": rank, "client": 0, "request_id": rid, "arrival_time": t, "prompt_len": 3, "max_tokens": max_tokens}


def out(t, rank=0, *requests):
    return {"kind": "output", "t": t, "rank": rank, "client": 0, "engine_index": rank, "requests": list(requests), "finished_requests": None, "stats": None}


def req(rid, ids=None, tokens=None, finish=None, stop_reason=None):
    entry = {"id": rid, "tokens": len(ids) if ids is not None else tokens, "finish_reason": finish}
    if stop_reason is not None:
        entry["stop_reason"] = stop_reason
    if ids is not None:
        entry["token_ids"] = ids
    return entry


#: a: three outputs with ids, STOP on id 7 (stop_reason 7); b (rank 1): LENGTH,
#: counts only; c: aborted by the client after one output; d: an ERROR without tokens
RECORDS = [
    add(10.0, "a"),
    add(10.5, "b", rank=1),
    out(10.2, 0, req("a", [5, 6])),
    add(10.6, "c"),
    out(10.7, 1, req("b", tokens=1)),
    out(10.8, 0, req("a", [], finish=None), req("c", [9])),  # a zero-token output: left out
    {"kind": "abort", "t": 10.9, "rank": 0, "client": 0, "request_ids": ["c"]},
    out(11.0, 0, req("a", [8, 7], finish=0, stop_reason=7)),
    out(11.1, 1, req("b", tokens=3, finish=1)),
    out(11.2, 0, req("c", [1])),  # after the abort: not c's any more
    add(12.0, "d"),
    out(12.25, 0, req("d", [], finish=3)),
    out(13.0, 0, req("zz", [1], finish=1)),  # never added
]


def write_trace(path, records=RECORDS, token_ids=True):
    lines = [json.dumps(trace.header(record_token_ids=token_ids, ranks=[0, 1]))] + [json.dumps(r) for r in records]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_recorded_requests_offsets_counts_ids_and_finishes():
    a, b, c, d = recorded_requests(RECORDS)
    assert [r.request_id for r in (a, b, c, d)] == ["a", "b", "c", "d"]
    assert a.outputs == (RecordedOutput(pytest.approx(0.2), 2, (5, 6)), RecordedOutput(pytest.approx(1.0), 2, (8, 7)))
    assert (a.num_tokens, a.token_ids, a.finish_reason, a.stop_reason, a.ttft) == (4, (5, 6, 8, 7), 0, 7, pytest.approx(0.2))
    assert (b.rank, [o.count for o in b.outputs], b.token_ids, b.finish_reason) == (1, [1, 3], None, 1)
    assert [o.offset for o in b.outputs] == [pytest.approx(0.2), pytest.approx(0.6)]
    assert (c.token_ids, c.finish_reason) == ((9,), None)  # aborted: no end, later outputs not its
    assert d.outputs == (RecordedOutput(pytest.approx(0.25), 0, ()),) and d.finish_reason == 3


def test_load_and_the_arrival_and_id_matches(tmp_path):
    loaded = load(write_trace(tmp_path / "t.jsonl"))
    assert str(loaded) == str(tmp_path / "t.jsonl") and loaded.ranks == {0, 1}
    assert loaded == load(str(tmp_path / "t.jsonl"))  # same content: equal (a reload sees no change)
    across = ReplaySettings(loaded, "arrival", per_rank=False)
    assert [across.take(5, str(i)).request_id for i in range(4)] == ["a", "b", "c", "d"]
    assert across.take(5, "x") is None  # more ADDs than recorded
    per_rank = ReplaySettings(load(loaded.path), "arrival", per_rank=True)
    assert [per_rank.take(0, "x").request_id for _ in range(3)] == ["a", "c", "d"]
    assert per_rank.take(1, "x").request_id == "b" and per_rank.take(1, "x") is None
    by_id = ReplaySettings(loaded, "id")
    assert by_id.take(0, "b").request_id == "b" and by_id.take(0, "b").request_id == "b" and by_id.take(0, "q") is None


def test_per_rank_only_when_the_trace_has_the_deployments_ranks(tmp_path):
    loaded = load(write_trace(tmp_path / "t.jsonl"))
    assert settings_from(loaded, "arrival", [0, 1], 2).per_rank
    assert settings_from(loaded, "arrival", [1], 2).per_rank  # a worker process with rank 1 of 2
    assert not settings_from(loaded, "arrival", [0], 1).per_rank  # DP 1 replaying a DP 2 trace
    assert not settings_from(loaded, "arrival", [0, 1, 2], 3).per_rank
    assert settings_from(None, "arrival", [0], 1) is None


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "No such file"),
        ("hello\n", "not a JSON header"),
        ('{"format": "other", "version": 1}\n', "not a gmock-trace file"),
        (json.dumps(trace.header()) + "\n" + json.dumps(out(1.0, 0, req("a", [1]))) + "\n", "records no request"),
    ],
)
def test_a_bad_trace_stops_the_configuration_naming_flag_and_file(tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    if content is not None:
        path.write_text(content)
    with pytest.raises(argparse.ArgumentTypeError, match=message):
        replay_trace(str(path))
    with pytest.raises(ConfigError) as error:
        parse_config(["--replay", str(path)], env={})
    assert "--replay" in str(error.value) and str(path) in str(error.value) and message in str(error.value)


def test_configuration_reaches_the_engine_settings(tmp_path):
    path = write_trace(tmp_path / "t.jsonl")
    config = parse_config(["--replay", path, "--replay-match", "id", "--engine-count", "2"], env={})
    settings = from_config(config)
    assert settings.replay == ReplaySettings(load(path), "id", per_rank=True)
    assert from_config(parse_config([], env={})).replay is None
    with pytest.raises(ConfigError, match="--replay-match"):
        parse_config(["--replay", path, "--replay-match", "order"], env={})


def test_a_reload_finds_an_unchanged_trace_unchanged_and_keeps_a_changed_one_out(tmp_path):
    path = write_trace(tmp_path / "t.jsonl")
    current = parse_config(["--replay", path], env={})
    found = reload.check(current, lambda: parse_config(["--replay", path], env={}))
    assert found.error is None and not found.fixed and not found.changes
    write_trace(tmp_path / "t.jsonl", RECORDS[:2])  # --replay is fixed while running
    found = reload.check(current, lambda: parse_config(["--replay", path], env={}))
    assert [c.flag for c in found.fixed] == ["--replay"] and found.config.replay is current.replay


# -- a pure EngineCore replaying ----------------------------------------------------


def request(rid, max_tokens=16, eos=2, **kw):
    return EngineCoreRequest(request_id=rid, prompt_len=3, max_tokens=max_tokens, client_index=0, has_sampling_params=True, eos_token_id=eos, **kw)


def engine_replaying(tmp_path, match="arrival", records=RECORDS, **settings):
    clock = Clock(100.0)
    trace_settings = ReplaySettings(load(write_trace(tmp_path / "t.jsonl", records)), match)
    return engine_with(clock, replay=trace_settings, **settings), clock


def timed_outputs(sent, rid):
    return [(t, o) for t, m in sent for o in m[1] if o[0] == rid]


def test_engine_emits_the_recorded_ids_counts_and_finish_at_their_offsets(tmp_path):
    engine, clock = engine_replaying(tmp_path, output_token_chunk_size=1)
    engine.apply(request("a"))  # the 1st ADD: recording a
    sent = drive(engine, clock)
    timed = timed_outputs(sent, "a")
    assert [o[1] for _, o in timed] == [[5, 6], [8, 7]]  # the recorded outputs, not chunk 1
    assert [t - 100.0 for t, _ in timed] == [pytest.approx(0.2), pytest.approx(1.0)]  # at their offsets, no sooner
    last = timed[-1][1]
    assert last[5] == FinishReason.STOP and last[6] == 7


def test_counts_only_recording_draws_from_the_source_and_the_client_cap_wins(tmp_path):
    engine, clock = engine_replaying(tmp_path, seed=3)
    engine.apply(request("x1"))  # recording a
    engine.apply(request("x2", max_tokens=2))  # recording b (4 tokens, LENGTH): capped at 2
    sent = drive(engine, clock)
    assert [len(o[1]) for o in outputs_of(sent, "x2")] == [1, 1]
    assert outputs_of(sent, "x2")[-1][5] == FinishReason.LENGTH
    plain = engine_with(Clock(), seed=3)
    plain.apply(request("x2", max_tokens=2))
    assert tokens_of(sent, "x2") == tokens_of(drive(plain, plain.clock), "x2")  # the token source's own ids


def test_stop_without_recorded_ids_ends_on_the_stop_id_and_eos(tmp_path):
    records = [add(0.0, "s"), out(0.1, 0, req("s", tokens=3, finish=0, stop_reason=11)), add(0.2, "e"), out(0.3, 0, req("e", tokens=2, finish=0))]
    engine, clock = engine_replaying(tmp_path, records=records)
    engine.apply(request("s"))
    engine.apply(request("e", eos=99))
    sent = drive(engine, clock)
    assert tokens_of(sent, "s")[-1] == 11 and outputs_of(sent, "s")[-1][6] == 11 and len(tokens_of(sent, "s")) == 3
    assert tokens_of(sent, "e")[-1] == 99 and outputs_of(sent, "e")[-1][5] == FinishReason.STOP


@pytest.mark.parametrize("ids", [True, False], ids=["recorded ids", "counts only"])
def test_a_stop_of_exactly_max_tokens_stays_a_stop_and_one_token_less_is_length(tmp_path, ids):
    """The boundary of the client's cap: a recorded STOP of max_tokens tokens
    ended by its own stop (finish STOP, its stop_reason), not by the cap."""
    recorded = req("s", [4, 5, 11], finish=0, stop_reason=11) if ids else req("s", tokens=3, finish=0, stop_reason=11)
    records = [add(0.0, "s"), out(0.1, 0, recorded), add(0.2, "t"), out(0.3, 0, dict(recorded, id="t"))]
    engine, clock = engine_replaying(tmp_path, records=records)
    engine.apply(request("s", max_tokens=3))  # recording s: 3 tokens, STOP on 11
    engine.apply(request("t", max_tokens=2))  # recording t: the same, capped one short
    sent = drive(engine, clock)
    last = outputs_of(sent, "s")[-1]
    assert len(tokens_of(sent, "s")) == 3 and tokens_of(sent, "s")[-1] == 11
    assert last[5] == FinishReason.STOP and last[6] == 11
    last = outputs_of(sent, "t")[-1]
    assert len(tokens_of(sent, "t")) == 2 and last[5] == FinishReason.LENGTH and last[6] is None


def test_uncovered_requests_fall_back_to_the_model_and_aborted_recordings_go_on(tmp_path):
    engine, clock = engine_replaying(tmp_path, match="id")
    engine.apply(request("c", max_tokens=5))  # recorded: one output [9], then the client aborted
    engine.apply(request("unknown", max_tokens=4))
    sent = drive(engine, clock)
    assert tokens_of(sent, "c")[0] == 9 and len(tokens_of(sent, "c")) == 5
    assert outputs_of(sent, "c")[-1][5] == FinishReason.LENGTH
    assert [len(o[1]) for o in outputs_of(sent, "unknown")] == [1, 1, 1, 1]
    # the fallback request is not held back by the replayed one's wait
    assert timed_outputs(sent, "unknown")[-1][0] == 100.0


def test_an_unknown_finish_reason_counts_as_no_end(tmp_path):
    records = [add(0.0, "u"), out(0.1, 0, req("u", [4, 5], finish=9))]
    engine, clock = engine_replaying(tmp_path, records=records)
    engine.apply(request("u", max_tokens=3))
    sent = drive(engine, clock)
    assert tokens_of(sent, "u")[:2] == [4, 5] and len(tokens_of(sent, "u")) == 3
    assert outputs_of(sent, "u")[-1][5] == FinishReason.LENGTH


def test_an_end_without_tokens_and_an_error(tmp_path):
    engine, clock = engine_replaying(tmp_path, match="id")
    engine.apply(request("d"))
    sent = drive(engine, clock)
    ((t, output),) = timed_outputs(sent, "d")
    assert output[1] == [] and output[5] == FinishReason.ERROR and t == pytest.approx(100.25)


def test_a_replayed_request_waits_in_the_engine_not_in_a_busy_loop(tmp_path):
    engine, clock = engine_replaying(tmp_path, match="id")
    engine.apply(request("a"))
    engine.step()  # admitted: its first output is due at +0.2
    assert engine.next_step_time(clock.now) == pytest.approx(100.2)
    engine.apply(AbortRequests(["a"]))
    assert not engine.has_work
