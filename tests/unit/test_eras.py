"""The wire layouts of every vLLM era (WIRE_LAYOUTS, docs/protocol.md §8):
version -> era, ADD fingerprints and `auto`, and outputs each era decodes.

The golden frames of each version's own msgspec types are checked in
test_golden_frames.py; these tests pin the rules the table encodes."""

from __future__ import annotations

import array

import pytest

from fake_frontend import era_request as era_add
from gmock_engine.config.loader import ConfigError, parse_config
from gmock_engine.wire.eras import WIRE_LAYOUTS, _ABSENT, _OUTS_0_11, _OUT_HEAD, Wire, fingerprint, layout_for_version
from gmock_engine.wire.inputs import InvalidRequest, decode_add
from gmock_engine.wire.outputs import engine_core_event, engine_core_output, logprobs_lists, prefill_stats, request_error
from gmock_engine.wire.types import EngineCoreEventType, FinishReason, ProtocolError

@pytest.mark.parametrize("version, era", [
    ("0.11", "0.11.0"), ("0.11.0", "0.11.0"), ("0.11.1", "0.11.1"), ("0.11.2", "0.11.1"), ("0.12.0", "0.11.1"),
    ("0.13", "0.13"), ("0.14.1", "0.14"), ("0.15.1", "0.15"), ("0.16.0", "0.16"), ("0.17.1", "0.17"),
    ("0.19.1", "0.17"), ("0.20", "0.20.0"), ("0.20.0", "0.20.0"),
    ("0.20.1", "0.20.1"), ("0.20.2", "0.20.1"), ("0.21.0", "0.21"), ("0.23.0", "0.21"), ("0.24.0", "0.24"),
    ("0.25", "0.24"), ("0.25.1", "0.24"),
    ("0.26.0", "0.26"), ("0.27.1", "0.26"), ("0.28.0", "0.28"), ("0.30", "0.29"), ("0.31.0", "0.31"),
    ("0.32.0", "0.32"), ("0.33", "0.33"), ("0.33.7", "0.33"),
])
def test_a_version_maps_to_its_era(version, era):
    assert layout_for_version(version) is WIRE_LAYOUTS[era]


@pytest.mark.parametrize("version", ["0.10.2", "0.9", "0.34", "1.0", "abc", "0.25.x", "", "0.2.5.1"])
def test_a_version_without_a_layout_is_refused_naming_the_known_range(version):
    with pytest.raises(ValueError, match="vLLM version|no wire layout"):
        layout_for_version(version)


def test_every_era_has_the_fields_the_mock_reads_where_it_reads_them():
    for layout in WIRE_LAYOUTS.values():
        ix = layout.request_index
        assert [ix["request_id"], ix["prompt_token_ids"], ix["sampling_params"]] == [0, 1, 3]
        assert layout.request_fields[ix["client_index"]] == "client_index"
        assert ix["current_wave"] == ix["client_index"] + 1  # §8.1
        assert layout.output_fields[:9] == _OUT_HEAD  # §8.1: unchanged 0.11..0.33
        assert layout.outputs_fields[:8] == _OUTS_0_11
    assert WIRE_LAYOUTS["0.17"].request_index["client_index"] == 10
    assert WIRE_LAYOUTS["0.16"].request_index["eos_token_id"] == 5
    assert WIRE_LAYOUTS["0.21"].request_index["abort_immediately"] == 19
    assert WIRE_LAYOUTS["0.15"].request_index["abort_immediately"] == _ABSENT


@pytest.mark.parametrize("era", sorted(WIRE_LAYOUTS))
def test_an_add_of_each_era_decodes_by_its_layout(era):
    layout = WIRE_LAYOUTS[era]
    eos = {"eos_token_id": 7} if "eos_token_id" in layout.request_fields else {}
    sampling = {"max_tokens": 9, "stop_token_ids": [5]} if eos else {"max_tokens": 9, "stop_token_ids": [5], "_eos_token_id": 7}
    payload = era_add(layout, "req-1", prompt=(4, 5), sampling=sampling, client_index=1, current_wave=2, priority=-3, **eos)
    request = decode_add(payload, layout)
    assert (request.request_id, request.prompt_len, request.max_tokens) == ("req-1", 2, 9)
    assert (request.client_index, request.current_wave, request.priority) == (1, 2, -3)
    assert request.eos_token_id == 7 and request.stop_token_ids == (5,)
    assert isinstance(request.arrival_time, float)


def test_an_eos_id_at_index_5_is_checked_like_the_sampling_one():
    layout = WIRE_LAYOUTS["0.16"]
    bad = decode_add(era_add(layout, eos_token_id=2**40), layout)
    assert isinstance(bad, InvalidRequest) and "eos_token_id 1099511627776" in bad.reason


@pytest.mark.parametrize("era, detected", [
    ("0.11.0", "0.11–0.13"), ("0.11.1", "0.11–0.13"), ("0.13", "0.11–0.13"), ("0.14", "0.14"), ("0.15", "0.15"),
    ("0.16", "0.16"), ("0.17", "0.17–0.20.0"), ("0.20.0", "0.17–0.20.0"), ("0.20.1", "0.20.1"), ("0.21", "0.21–0.27"), ("0.24", "0.21–0.27"),
    ("0.26", "0.21–0.27"),
    ("0.28", "0.28–0.30"), ("0.29", "0.28–0.30"), ("0.31", "0.31–0.33"), ("0.32", "0.31–0.33"), ("0.33", "0.31–0.33"),
])
def test_auto_detects_the_era_from_the_first_add_and_says_why(era, detected):
    said = []
    wire = Wire(report=said.append)
    assert not wire.settled
    request = decode_add(era_add(WIRE_LAYOUTS[era], client_index=1), wire)
    assert wire.settled and wire.layout.version == detected
    assert request.client_index == 1
    assert len(said) == 1 and f"speaks vLLM {wire.layout.versions}, detected from the first ADD" in said[0]


def test_ambiguous_lengths_get_a_layout_every_era_of_them_decodes():
    old = Wire()
    decode_add(era_add(WIRE_LAYOUTS["0.11.0"]), old)
    assert old.layout.max_finish_reason is FinishReason.ABORT  # 0.11/0.12 lack ERROR
    assert old.layout.wire_finish_reason(FinishReason.ERROR) == FinishReason.ABORT
    mid = Wire()
    decode_add(era_add(WIRE_LAYOUTS["0.21"]), mid)
    # 0.21-0.25 want prefill_stats at 10, 0.26-0.27 at 11: neither is sent
    final = engine_core_output("r", [1], FinishReason.ERROR, request_error("x", "y"), mid.layout,
                                        prefill_stats=prefill_stats(5))
    assert len(final) <= 9


def test_hostile_or_short_adds_settle_nothing():
    wire = Wire()
    for payload in (["r", [1], None, {"max_tokens": 1}], ["r", [1], None, {}, None, "x", 1.0] + [None] * 15, [None] * 22):
        try:
            decode_add(payload, wire)
        except ProtocolError:
            pass
    assert not wire.settled and wire.layout is WIRE_LAYOUTS["0.33"]


def test_a_later_add_of_another_era_is_said_once_and_the_layout_stays():
    said = []
    wire = Wire(report=said.append)
    decode_add(era_add(WIRE_LAYOUTS["0.28"]), wire)
    for _ in range(3):
        decode_add(era_add(WIRE_LAYOUTS["0.17"]), wire)
    assert wire.layout.version == "0.28–0.30"
    assert len(said) == 2 and "has the shape of vLLM 0.17–0.20.0" in said[1]


@pytest.mark.parametrize("settled, other", [("0.15", "0.17"), ("0.17", "0.15"), ("0.16", "0.20.1"), ("0.33", "0.28")])
def test_an_add_of_another_era_after_many_of_the_settled_one_is_still_said(settled, other):
    # Wire.for_add skips `fingerprint` for an ADD shaped as the last one of
    # the settled era; 0.15 and 0.17 (0.16 and 0.20.1) have the same length
    # and differ only in the types of elements 5 and 6
    said = []
    wire = Wire(report=said.append)
    for _ in range(3):
        decode_add(era_add(WIRE_LAYOUTS[settled]), wire)
    assert len(said) == 1
    detected = wire.layout
    payload = era_add(WIRE_LAYOUTS[other])
    decode_add(payload, wire)
    assert len(said) == 2 and f"has the shape of vLLM {fingerprint(payload)[0].versions}" in said[1]
    assert wire.layout is detected


def test_an_explicit_version_always_wins_and_a_mismatch_is_said_once():
    said = []
    wire = Wire.from_setting("0.25.1", said.append)
    assert wire.settled and wire.layout is WIRE_LAYOUTS["0.24"]
    decode_add(era_add(WIRE_LAYOUTS["0.33"]), wire)
    decode_add(era_add(WIRE_LAYOUTS["0.33"]), wire)
    assert wire.layout is WIRE_LAYOUTS["0.24"] and len(said) == 1
    decode_add(era_add(WIRE_LAYOUTS["0.24"]), Wire.from_setting("0.25", said.append))
    assert len(said) == 1  # the same shape: nothing to say


@pytest.mark.parametrize("era", sorted(WIRE_LAYOUTS))
def test_a_final_output_puts_each_field_where_its_era_reads_it(era):
    layout = WIRE_LAYOUTS[era]
    error = request_error("mock_failure", "boom")
    out = engine_core_output("r", [1], FinishReason.ERROR, error, layout, prefill_stats=prefill_stats(8, 4),
                                      stop_reason=None, events=[engine_core_event(EngineCoreEventType.QUEUED, 1.0)])
    fields = layout.output_fields
    assert len(out) <= len(fields)
    assert out[5] == (3 if layout.max_finish_reason >= FinishReason.ERROR else 2)
    assert out[7][0]["type"] == 1
    for position, value in enumerate(out):
        name = fields[position]
        if name in ("num_nans_in_logits", "num_external_computed_tokens"):
            assert value == 0, name  # an int field: nil does not decode
        elif name == "num_cached_tokens":
            assert value == 4  # the prefill accounting before 0.20
        elif name == "prefill_stats":
            assert value["num_cached_tokens"] == 4
        elif name == "error":
            assert value == error
    assert ("prefill_stats" in out_names(layout, out)) == ("prefill_stats" in fields)


def out_names(layout, out):
    return [layout.output_fields[i] for i, value in enumerate(out) if value is not None]


@pytest.mark.parametrize("era", sorted(WIRE_LAYOUTS))
def test_a_plain_length_end_is_the_eras_defaults_up_to_finish_reason(era):
    """engine_core_output's fast path for the common end (layout.length_tail)
    is the output its general path builds: the era's defaults before
    finish_reason (nil or, for int fields, 0), then LENGTH as the era knows it."""
    layout = WIRE_LAYOUTS[era]
    out = engine_core_output("r", [7, 8], FinishReason.LENGTH, layout=layout)
    assert out == ["r", [7, 8], *layout.output_defaults[2:5], layout.wire_finish_reason(FinishReason.LENGTH)]
    assert out[5] == 1 and len(out) == 6
    # anything more than a plain end takes the general path and keeps its fields
    stats = engine_core_output("r", [7], FinishReason.LENGTH, layout=layout, prefill_stats=prefill_stats(4))
    assert stats[:6] == ["r", [7], *layout.output_defaults[2:5], 1] and len(stats) > 6


def test_repetition_is_stop_before_0_17():
    assert engine_core_output("r", [], FinishReason.REPETITION, layout=WIRE_LAYOUTS["0.16"])[5] == 0
    assert engine_core_output("r", [], FinishReason.REPETITION, layout=WIRE_LAYOUTS["0.17"])[5] == 4


def test_logprob_tuples_follow_their_era():
    ids = array.array("i", [11, 12, 21, 22]).tobytes()
    lps = array.array("f", [-0.5, -1.5, -0.25, -2.0]).tobytes()
    ranks = array.array("q", [1, 2]).tobytes()
    lists = logprobs_lists(2, 2, ids, lps, ranks, WIRE_LAYOUTS["0.11.0"])
    assert lists == [[[11, 12], [21, 22]], [[-0.5, -1.5], [-0.25, -2.0]], [1, 2]]  # 0.11.0: plain lists
    assert len(logprobs_lists(2, 2, ids, lps, ranks, WIRE_LAYOUTS["0.11.1"])) == 4
    assert len(logprobs_lists(2, 2, ids, lps, ranks, WIRE_LAYOUTS["0.15"], tensors=True)) == 3
    assert len(logprobs_lists(2, 2, ids, lps, ranks, WIRE_LAYOUTS["0.16"], tensors=True)) == 4


def test_the_flag_takes_auto_or_a_version_and_names_itself_when_wrong():
    assert parse_config([], env={}).protocol_version == "auto"
    assert parse_config(["--protocol-version", "0.25.1"], env={}).protocol_version == "0.25.1"
    assert parse_config([], env={"GMOCK_PROTOCOL_VERSION": "0.18"}).protocol_version == "0.18"
    with pytest.raises(ConfigError, match=r"--protocol-version: vLLM 0.9 has no wire layout here: known are 0.11.0 to 0.33.x; or auto"):
        parse_config(["--protocol-version", "0.9"], env={})


@pytest.mark.parametrize("version, maps, topic, group", [
    ("0.19.1", False, False, False), ("0.20.2", False, False, True), ("0.23.0", False, False, True),
    ("0.24.0", True, False, True), ("0.25.1", True, False, True), ("0.26.0", True, True, True), ("0.33", True, True, True),
])
def test_kv_event_formats_follow_the_era(version, maps, topic, group):
    """Appendix D, as each release's vllm/distributed/kv_events.py has it."""
    layout = layout_for_version(version)
    assert (layout.kv_events_tagged_maps, layout.kv_events_replay_topic, layout.kv_events_group_idx) == (maps, topic, group)
