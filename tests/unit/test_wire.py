"""gmock_engine.wire against real frames captured from the frontends (tests/data/frames.json).

§N: section N of docs/protocol.md."""

import json
import os

import re

import msgpack
import pytest

from gmock_engine.wire.eras import DEFAULT_PROTOCOL_VERSION, WIRE_LAYOUTS
from gmock_engine.wire.handshake import decode_init, hello_message, ready_message, ready_response
from gmock_engine.wire.inputs import _RARE_SAMPLING_KEYS, AbortRequests, EngineCoreRequest, InvalidRequest, StartDPWave, UtilityCall, decode_add, decode_coordinator, decode_input, unpack
from gmock_engine.wire.outputs import Packer, engine_core_output, engine_core_outputs, request_error, utility_reply
from gmock_engine.wire.types import FinishReason, ProtocolError, engine_identity

LAYOUT = WIRE_LAYOUTS[DEFAULT_PROTOCOL_VERSION]
DATA = os.path.join(os.path.dirname(__file__), "..", "data", "frames.json")
with open(DATA) as _f:
    RECORDS = json.load(_f)["records"]


def _frames(record):
    return [bytes.fromhex(h) for h in record["frames_hex"]]


def _records(socket_prefix, direction, note=None):
    return [
        r
        for r in RECORDS
        if r["socket"].startswith(socket_prefix) and r["dir"] == direction and (note is None or r["note"] == note)
    ]


INPUTS = _records("input", "recv")


def test_trace_inputs_cover_every_kind():
    kinds = {r["decoded"][0]["request_type"] for r in INPUTS}
    assert kinds == {"ADD", "ABORT", "UTILITY"}
    assert {r["trace"] for r in INPUTS} >= {"dp1.json", "rust_frontend_dp1.json", "dp4_api2.json"}


@pytest.mark.parametrize("record", INPUTS, ids=lambda r: f"{r['trace']}-{r['decoded'][0]['request_type']}")
def test_decode_real_input_frames(record):
    """Every input frame the real frontends sent decodes to what the trace's
    independent decoder saw."""
    message = decode_input(_frames(record), LAYOUT)
    kind = record["decoded"][0]["request_type"]
    payload = record["decoded"][1]
    if kind == "ADD":
        assert isinstance(message, EngineCoreRequest)
        assert message.request_id == payload[0]
        assert message.prompt_len == len(payload[1])
        assert message.client_index == payload[11]
        sampling = payload[3]
        # §3.3: Py-FE omits max_tokens when it equals the default 16.
        assert message.max_tokens == sampling.get("max_tokens", 16)
        assert message.has_sampling_params
        assert message.abort_immediately is False
        assert message.external_req_id == payload[16]
    elif kind == "ABORT":
        assert message == AbortRequests(payload)
    else:
        assert isinstance(message, UtilityCall)
        assert [message.client_index, message.call_id, message.method, message.args] == payload


def test_uint64_call_ids_survive_a_round_trip():
    big = [r for r in INPUTS if r["decoded"][0]["request_type"] == "UTILITY" and r["decoded"][1][1] > 2**63]
    assert big, "traces should hold a call id above 2**63"
    call = decode_input(_frames(big[0]), LAYOUT)
    reply = msgpack.unpackb(Packer().pack(utility_reply(0, call.call_id, 1.0, None)))
    assert reply[4][0] == call.call_id > 2**63


def test_stop_params_from_both_frontends():
    adds = [r for r in INPUTS if r["decoded"][0]["request_type"] == "ADD"]
    for record in adds:
        request = decode_input(_frames(record), LAYOUT)
        assert request.eos_token_id == 31999 and request.all_stop_token_ids == (31999,)
        assert request.stop_token_ids == () and request.ignore_eos is False and request.min_tokens == 0


def test_py_frontend_absent_max_tokens_means_16():
    adds = [r for r in INPUTS if r["decoded"][0]["request_type"] == "ADD" and "max_tokens" not in r["decoded"][1][3]]
    assert adds, "the dp1 trace has a chat request with max_tokens 16 (key absent)"
    assert decode_input(_frames(adds[0]), LAYOUT).max_tokens == 16


def test_decode_init_from_traces():
    inits = _records("handshake", "recv", "INIT")
    assert len(inits) >= 3
    for record in inits:
        init = decode_init(_frames(record))
        addresses = record["decoded"][0]["addresses"]
        assert init.inputs == addresses["inputs"] and init.outputs == addresses["outputs"]
        assert init.coordinator_input == addresses["coordinator_input"]
        assert init.frontend_stats_publish_address == addresses["frontend_stats_publish_address"]
    dp4 = [r for r in inits if r["trace"] == "dp4_api2.json"][0]
    init = decode_init(_frames(dp4))
    assert len(init.inputs) == 2 and init.has_coordinator


def test_coordinator_frames():
    coord = _records("coord_in", "recv")
    ready = [r for r in coord if r["note"] == "coordinator READY"]
    waves = [r for r in coord if r["note"] != "coordinator READY"]
    assert ready and waves
    assert decode_coordinator(_frames(ready[0]), LAYOUT) is None
    wave = decode_coordinator(_frames(waves[0]), LAYOUT)
    # ≤ 0.32 coordinators send the 2-byte identity as exclude (§3.6).
    assert isinstance(wave, StartDPWave) and wave.wave == waves[0]["decoded"][1][0]
    assert wave.exclude_engine_index == b"\x00\x00"


def test_ready_response_has_every_key_the_real_frontends_saw():
    """The registration our layout sends is a superset of what a working
    engine sent (0.32 trace), with the same value types."""
    sent = _records("input", "send")[0]["decoded"][0]
    ours = {key: None for key in LAYOUT.ready_response_keys}
    assert set(sent) <= set(ours)
    assert len(LAYOUT.ready_response_keys) == 28  # the 0.33 key set (§2.5)
    with pytest.raises(KeyError):
        ready_response({"max_model_len": 1}, LAYOUT)


BAD_FRAMES = [
    ([b"\x00"], "at least 2 frames"),
    ([], "at least 2 frames"),
    ([b"\x07", msgpack.packb([])], "unknown request type byte 07"),
    ([b"\x00\x00", msgpack.packb([])], "unknown request type"),
    ([b"\x00", b"\xc1"], "undecodable msgpack"),
    ([b"\x00", msgpack.packb([1, 2, 3])], "EngineCoreRequest array"),
    ([b"\x00", msgpack.packb({"a": 1})], "EngineCoreRequest array"),
    ([b"\x00", msgpack.packb([7, [1], None, {}, None])], "request_id"),
    ([b"\x00", msgpack.packb(["r", [1], None, {}, None, 0.0, None, None, None, None, None, "x"])], "client_index"),
    ([b"\x01", msgpack.packb("r")], "ABORT payload"),
    ([b"\x01", msgpack.packb(["r", 5])], "ABORT payload"),
    ([b"\x03", msgpack.packb([0, 1, "m"])], "4-array"),
    ([b"\x03", msgpack.packb([0, "1", "m", []])], "call_id"),
    ([b"\x03", msgpack.packb([0, 1, 5, []])], "method name"),
    ([b"\x03", msgpack.packb([0, 1, "m", 5])], "args"),
    ([b"\x03", msgpack.packb([-1, 1, "m", []])], "client_index"),
    ([b"\x02", msgpack.packb(["w", None])], "START_DP_WAVE"),
    ([b"\x00", msgpack.packb(msgpack.ExtType(1, b"cos\nsystem\n"))], "pickle ext type"),
    ([b"\x03", msgpack.packb([0, 1, "m", [msgpack.ExtType(2, b"x")]])], "pickle ext type"),
]


@pytest.mark.parametrize("frames,reason", BAD_FRAMES, ids=[r for _, r in BAD_FRAMES])
def test_bad_frames_raise_a_clear_protocol_error(frames, reason):
    with pytest.raises(ProtocolError, match=reason):
        decode_input(frames, LAYOUT)


def _add(sampling=None, prompt=(1,), **fields):
    array = ["r", list(prompt) if isinstance(prompt, tuple) else prompt, None, {} if sampling is None else sampling, None]
    array += [0.0, None, None, None, None, None, 1, 0, 0, None, False, None, None, None, False, None, None]
    for index, value in fields.items():
        array[int(index[1:])] = value
    return [b"\x00", msgpack.packb(array)]


#: An ADD with a readable id and client but a bad value: InvalidRequest (the
#: engine answers that request with ERROR) whose reason names key and value.
BAD_VALUES = [
    (_add(prompt="abc"), "prompt_token_ids is str"),
    (_add(prompt=(1, -1)), r"prompt_token_ids\[1\] = -1 is not a token id"),
    (_add(prompt=(2**32,)), r"prompt_token_ids\[0\] = 4294967296"),
    (_add(prompt=(1, "x")), r"prompt_token_ids\[1\] = 'x'"),
    (_add(prompt=(7, True)), r"prompt_token_ids\[1\] = True is not a token id"),
    (_add(prompt=(7, 2.0)), r"prompt_token_ids\[1\] = 2.0 is not a token id"),
    (_add(sampling=[1]), "sampling_params is list"),
    (_add({"max_tokens": "9"}), "max_tokens '9'"),
    (_add({"max_tokens": -1}), "max_tokens -1"),
    (_add({"max_tokens": True}), "max_tokens True"),
    (_add({"stop_token_ids": ["a"]}), "stop_token_ids"),
    (_add({"_eos_token_id": "x"}), "_eos_token_id 'x'"),
    (_add({"_eos_token_id": 2**32}), "_eos_token_id 4294967296 is not a token id"),
    (_add({"min_tokens": -2}), "min_tokens -2"),
    (_add({"extra_args": [1]}), "extra_args is list"),
    (_add(i13="high"), "priority 'high'"),
    (_add(i12=-1), "current_wave -1"),
]


@pytest.mark.parametrize("frames,reason", BAD_VALUES, ids=[r for _, r in BAD_VALUES])
def test_bad_values_in_an_add_become_an_invalid_request_naming_them(frames, reason):
    message = decode_input(frames, LAYOUT)
    assert isinstance(message, InvalidRequest), message
    assert (message.request_id, message.client_index) == ("r", 1)
    assert re.search(reason, message.reason), message.reason


def test_an_add_with_no_output_socket_to_answer_on_is_a_bad_frame():
    for client in ("x", -1, 2**16, 2**63):
        with pytest.raises(ProtocolError, match="client_index"):
            decode_input(_add(i11=client), LAYOUT)


def test_long_values_are_cut_in_reasons():
    message = decode_input(_add({"max_tokens": "9" * 100_000}), LAYOUT)
    assert len(message.reason) < 200


def test_aux_frames_are_accepted():
    frames = [b"\x00", msgpack.packb(["r-1", [1, 2], None, {"max_tokens": 3}, None]), b"tensor bytes"]
    request = decode_input(frames, LAYOUT)
    assert request.request_id == "r-1" and request.max_tokens == 3 and request.client_index == 0


def test_nil_sampling_params_and_abort_immediately():
    request = decode_add(["r", [1], None, None, None], LAYOUT)
    assert not request.has_sampling_params and request.max_tokens is None
    full = ["r", [1], None, {}, None] + [None] * 6 + [0, 0, 0, None, False, None, None, None, True]
    assert decode_add(full, LAYOUT).abort_immediately is True


@pytest.mark.parametrize(
    "init,reason",
    [
        ({"addresses": {"inputs": [], "outputs": []}}, "non-empty"),
        ({"addresses": {"inputs": ["tcp://a:1"], "outputs": ["tcp://b:1", "tcp://c:1"]}}, "1 inputs but 2 outputs"),
        ({"addresses": {"inputs": ["tcp://a:1"], "outputs": ["tcp://b:1"], "coordinator_input": "tcp://c:1"}}, "only one"),
        ({"no": 1}, "addresses"),
    ],
)
def test_bad_init(init, reason):
    with pytest.raises(ProtocolError, match=reason):
        decode_init([msgpack.packb(init)])


def test_outputs_are_short_and_never_empty():
    running = engine_core_output("r", [5])
    final = engine_core_output("r", [6], FinishReason.LENGTH)
    assert running == ["r", [5]]
    assert final == ["r", [6], None, None, None, 1]
    batch = engine_core_outputs(3, [running], 12.5)
    assert batch == [3, [running], None, 12.5]
    done = engine_core_outputs(3, [final], 13, ["r"])
    assert done == [3, [final], None, 13.0, None, ["r"]] and isinstance(done[3], float)
    assert len(done) <= len(LAYOUT.outputs_fields) == 9
    with pytest.raises(ValueError, match="empty"):
        engine_core_outputs(0, [], 1.0)


def test_error_output_places_request_error_at_its_layout_position():
    error = request_error("engine_paused", "paused", retryable=True)
    out = engine_core_output("r", [], FinishReason.ERROR, error, LAYOUT)
    assert out[5] == 3
    assert out[LAYOUT.output_position("error")] == error
    # num_nans_in_logits must be an int, never nil (Rs-FE rejects nil).
    assert out[LAYOUT.output_position("num_nans_in_logits")] == 0
    assert len(out) == 19


def test_utility_reply_envelopes():
    ok = utility_reply(1, 2**64 - 1, 5.0, ["generate"])
    assert ok == [1, [], None, 5.0, [2**64 - 1, None, [None, ["generate"]]]]
    unit = utility_reply(1, 7, 5.0)
    assert unit[4] == [7, None, [None, None]]  # the envelope is always there (§4.6)
    failed = utility_reply(1, 7, 5.0, failure_message="nope")
    assert failed[4] == [7, "nope", None]
    packed = Packer().pack(ok)
    assert msgpack.unpackb(packed)[4][0] == 2**64 - 1


def test_handshake_messages():
    assert hello_message() == {"status": "HELLO", "local": False, "headless": True}
    ready = ready_message(1024)
    assert ready == {"status": "READY", "local": False, "headless": True, "num_gpu_blocks": 1024, "dp_stats_address": None}
    assert ready_message(1, parallel_config_hash="ab")["parallel_config_hash"] == "ab"
    assert [engine_identity(r) for r in (0, 1, 258)] == [b"\x00\x00", b"\x01\x00", b"\x02\x01"]


ADDS = [r for r in INPUTS if r["decoded"][0]["request_type"] == "ADD"]


@pytest.mark.parametrize("record", ADDS, ids=lambda r: r["trace"])
@pytest.mark.parametrize(
    "stops",
    [
        {},
        {"min_tokens": 3, "stop_token_ids": [5, 6], "_all_stop_token_ids": [5, 6, 9], "_eos_token_id": 9},
        {"stop_token_ids": None, "_all_stop_token_ids": None, "_eos_token_id": None, "min_tokens": None},
    ],
    ids=["as-sent", "stops", "nil-stops"],
)
def test_the_short_reading_of_sampling_params_is_the_full_one(record, stops):
    """An ADD whose SamplingParams name none of the rare keys (every traced
    one) takes _decode_stops' short reading: the request is the one the full
    reading makes of the same ADD, which a rare key with its absent value
    forces (the short reading keeps the ADD path cheap)."""
    payload = unpack(_frames(record)[1])
    payload[3].update(stops)
    assert _RARE_SAMPLING_KEYS.isdisjoint(payload[3])
    short = decode_add(payload, LAYOUT)
    for key, absent in (("logit_bias", None), ("extra_args", {}), ("ignore_eos", False), ("logprobs", None)):
        forced = [*payload[:3], {**payload[3], key: absent}, *payload[4:]]
        assert decode_add(forced, LAYOUT) == short, key
    assert short.stop_token_ids == tuple(payload[3].get("stop_token_ids") or ())
    assert short.all_stop_token_ids == tuple(payload[3].get("_all_stop_token_ids") or ())
    assert short.eos_token_id == payload[3].get("_eos_token_id")
    assert short.min_tokens == (payload[3].get("min_tokens") or 0)


@pytest.mark.parametrize("key", ["stop_token_ids", "_all_stop_token_ids"])
@pytest.mark.parametrize("value", [[1, True], [1, "2"], [1.5], "12", {"a": 1}])
def test_stop_id_lists_of_non_ints_are_refused_on_the_short_reading(key, value):
    """The short reading checks the stop id lists as the full one does: a
    bool, a string or a float in them, or no list at all, is a BadValue
    naming the key."""
    payload = unpack(_frames(ADDS[0])[1])
    payload[3][key] = value
    result = decode_add(payload, LAYOUT)
    assert isinstance(result, InvalidRequest)
    assert key in result.reason


def test_steady_adds_do_not_keep_rebuilding_the_table_of_interned_strings(monkeypatch):
    """msgpack interns every map key it decodes; a SamplingParams key that
    nothing holds leaves the interpreter's table of interned strings with its
    frame and takes a new slot of it with the next one, and the table (about
    a megabyte) is rebuilt whenever its slots run out: a rebuild allocates the
    new table while the old one is still there, so traced memory peaks a
    megabyte above where it started. The decoder holds the keys it has seen,
    so a steady stream of ADDs rebuilds nothing."""
    import tracemalloc

    from gmock_engine.wire import inputs

    monkeypatch.setattr(inputs, "_HELD_KEYS", set())  # whatever earlier tests' frames filled it with
    # keys built at run time: a literal here would be held by this module's code
    unheld = {"".join(("unheld_key_", str(i))): i for i in range(8)}
    frames = _add({"max_tokens": 4, **unheld})
    assert isinstance(decode_input(frames, LAYOUT), EngineCoreRequest)
    tracemalloc.start()
    try:
        start, _ = tracemalloc.get_traced_memory()
        for _ in range(20_000):
            decode_input(frames, LAYOUT)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak - start < 256 * 1024, f"traced memory peaked {(peak - start) / 2**20:.2f} MiB above its start"
