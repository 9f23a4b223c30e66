"""The handshake maps built from a configuration (wire/handshake.py):
engine_ready_response's key set and value types in every era,
engine_ready_message, and decode_init on malformed frames
(tests/unit/test_wire.py covers the plain maps and INIT from traces)."""

from types import SimpleNamespace

import msgpack
import pytest

from gmock_engine.config.loader import parse_config
from gmock_engine.wire.eras import WIRE_LAYOUTS
from gmock_engine.wire.handshake import InitMessage, decode_init, engine_ready_message, engine_ready_response
from gmock_engine.wire.types import ProtocolError

INIT = InitMessage(["tcp://in:1"], ["tcp://out:1"], "tcp://ci:2", "tcp://co:3", "tcp://stats:4")
BARE_INIT = InitMessage(["tcp://in:1"], ["tcp://out:1"])

INTS = ("max_model_len", "num_gpu_blocks", "block_size", "world_size", "data_parallel_size", "tensor_parallel_size",
        "pipeline_parallel_size", "decode_context_parallel_size", "data_parallel_rank", "max_num_seqs",
        "max_num_batched_tokens", "max_loras", "kv_cache_size_tokens", "effective_attention_block_size", "coord_store_port")


def config(**changes):
    base = parse_config([], {})
    values = dict(vars(base))
    values.update(changes)
    return SimpleNamespace(**values)


@pytest.mark.parametrize("era", sorted(WIRE_LAYOUTS))
def test_key_set_and_value_types_per_era(era):
    layout = WIRE_LAYOUTS[era]
    response = engine_ready_response(config(), INIT, layout, 0, "inst-1", None)
    assert tuple(response) == layout.ready_response_keys  # every key, in the layout's order
    for key in INTS:
        if key in response:
            assert type(response[key]) is int, key
    for key in ("supports_lora", "enable_sleep_mode", "supports_draft_weight_updates"):
        if key in response:
            assert type(response[key]) is bool, key
    for key in ("dtype", "vllm_version", "instance_id"):
        if key in response:
            assert isinstance(response[key], str), key
    msgpack.packb(response, use_bin_type=True)


def test_values_come_from_config_init_and_the_process():
    layout = WIRE_LAYOUTS["0.33"]
    c = config(max_model_len=4096, num_gpu_blocks=100, block_size=32, dtype="float16", max_num_seqs=7,
               max_num_batched_tokens=512, data_parallel_size=4)
    events = {"endpoint": "tcp://x:9"}
    r = engine_ready_response(c, INIT, layout, 3, "inst-9", events)
    assert r["max_model_len"] == 4096 and r["num_gpu_blocks"] == 100 and r["block_size"] == 32
    assert r["kv_cache_size_tokens"] == 3200 and r["effective_attention_block_size"] == 32
    assert r["dtype"] == "float16" and r["max_num_seqs"] == 7 and r["max_num_batched_tokens"] == 512
    assert r["data_parallel_size"] == 4 and r["data_parallel_rank"] == 3 and r["instance_id"] == "inst-9"
    assert r["world_size"] == r["tensor_parallel_size"] == r["pipeline_parallel_size"] == 1
    assert r["dp_stats_address"] == "tcp://stats:4"  # the frontend's own, echoed
    assert r["coordinator_input_address"] == "tcp://ci:2" and r["coordinator_output_address"] == "tcp://co:3"
    assert r["kv_events_config"] is events
    assert r["mamba_block_size"] is None and r["kv_cache_max_concurrency"] is None


def test_without_coordinator_or_stats_address_they_are_nil():
    r = engine_ready_response(config(), BARE_INIT, WIRE_LAYOUTS["0.33"], 0, "i", None)
    assert r["dp_stats_address"] is None
    assert r["coordinator_input_address"] is None and r["coordinator_output_address"] is None
    assert r["kv_events_config"] is None


def test_lora_fields_follow_enable_lora():
    layout = WIRE_LAYOUTS["0.33"]
    off = engine_ready_response(config(enable_lora=False, max_loras=4), INIT, layout, 0, "i", None)
    assert off["supports_lora"] is False and off["max_loras"] == 0
    on = engine_ready_response(config(enable_lora=True, max_loras=4), INIT, layout, 0, "i", None)
    assert on["supports_lora"] is True and on["max_loras"] == 4


def test_engine_ready_message():
    ready = engine_ready_message(config(num_gpu_blocks=77), INIT)
    assert ready == {"status": "READY", "local": False, "headless": True, "num_gpu_blocks": 77, "dp_stats_address": "tcp://stats:4"}
    hashed = engine_ready_message(config(parallel_config_hash="abc"), BARE_INIT)
    assert hashed["parallel_config_hash"] == "abc" and hashed["dp_stats_address"] is None


ADDRS = {"inputs": ["tcp://a:1"], "outputs": ["tcp://b:1"]}


@pytest.mark.parametrize(
    "frames, reason",
    [
        ([], "exactly one frame, got 0"),
        ([msgpack.packb({"addresses": ADDRS})] * 2, "exactly one frame, got 2"),
        ([msgpack.packb([1, 2])], "not a map with an `addresses` map"),
        ([msgpack.packb({"addresses": ["tcp://a:1"]})], "not a map with an `addresses` map"),
        ([msgpack.packb({"addresses": {"inputs": "tcp://a:1", "outputs": ["tcp://b:1"]}})], "addresses.inputs is not a non-empty list"),
        ([msgpack.packb({"addresses": {"inputs": ["tcp://a:1"], "outputs": [5]}})], "addresses.outputs is not a non-empty list"),
        ([msgpack.packb({"addresses": {"inputs": ["tcp://a:1"]}})], "addresses.outputs is not a non-empty list"),
        ([msgpack.packb({"addresses": dict(ADDRS, coordinator_output="tcp://c:1")})], "only one of coordinator_input"),
    ],
)
def test_decode_init_refuses_malformed_frames(frames, reason):
    with pytest.raises(ProtocolError) as info:
        decode_init(frames)
    assert reason in str(info.value)


def test_decode_init_garbage_bytes_are_a_protocol_error():
    with pytest.raises(ProtocolError):
        decode_init([b"\xc1\xc1"])


def test_decode_init_ignores_a_stats_address_that_is_not_text():
    init = decode_init([msgpack.packb({"addresses": dict(ADDRS, frontend_stats_publish_address=5)})])
    assert init.frontend_stats_publish_address is None and not init.has_coordinator
    assert init.inputs == ["tcp://a:1"] and init.outputs == ["tcp://b:1"]
