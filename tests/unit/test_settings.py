"""The typed path from flag to part (config/settings.py): one frozen dataclass per
part, built from the parsed configuration, and one engine's EngineSettings
from those parts."""

import dataclasses

import pytest

from gmock_engine.config import options, settings
from gmock_engine.wire.eras import Wire
from gmock_engine.config.loader import parse_config
from gmock_engine.core.engine import EngineSettings
from gmock_engine.content.tokens import EchoTokens, RandomTokens


def parts(*argv):
    return settings.from_config(parse_config(list(argv), env={}))


def test_a_limit_is_enforced_only_when_given():
    default = parts()
    assert (default.scheduler.max_num_seqs, default.scheduler.max_num_batched_tokens, default.kv.kv_blocks) == (None, None, None)
    given = parts("--max-num-seqs", "8", "--num-gpu-blocks", "100")
    assert (given.scheduler.max_num_seqs, given.scheduler.max_num_batched_tokens, given.kv.kv_blocks) == (8, None, 100)
    assert given.kv.num_gpu_blocks == 100 and default.kv.num_gpu_blocks == 65536


def test_each_part_gets_its_flags():
    p = parts(
        "--itl-ms", "5", "--lora-load-ms", "7", "--enable-lora", "--max-loras", "2", "--kv-role", "producer",
        "--eos-probability", "0.1", "--strict-ledger", "--log-level", "debug", "--scheduling-policy", "priority",
        "--prefix-caching", "--token-id-range", "10:20", "--fault-crash", "at=60",
    )  # fmt: skip
    assert (p.latency.itl_ms, p.latency.lora_load_ms) == (5.0, 7.0)
    assert p.lora == settings.LoRASettings(True, 2, None, 16, True)
    assert p.pd is not None and p.pd.role == "producer"
    assert p.generation.output_lengths is not None and p.generation.token_id_range == (10, 20)
    assert (p.logging.strict_ledger, p.logging.log_level) == (True, "DEBUG")
    assert (p.scheduler.scheduling_policy, p.kv.prefix_caching, p.kv.kv_events) == ("priority", True, False)
    assert [spec.kind for spec in p.faults] == ["crash"]
    assert parts().pd is None and parts().generation.output_lengths is None


def test_the_process_part_carries_what_the_app_and_its_runners_run_by():
    p = parts(
        "--handshake-address", "tcp://10.0.0.5:29999", "--data-parallel-start-rank", "2", "--engine-count", "3",
        "--data-parallel-size", "8", "--frontend-heartbeat", "0.5", "--exit-when-frontend-gone", "9",
        "--metrics-port", "9100", "--metrics-host", "0.0.0.0", "--on-stop", "finish", "--drain-timeout", "4",
        "--send-dead-on-exit", "--prefix-caching", "--kv-events-config", '{"enable_kv_cache_events": true, "publisher": "zmq"}',
    )  # fmt: skip
    assert p.process == settings.ProcessSettings(
        handshake_address="tcp://10.0.0.5:29999", first_rank=2, engine_count=3, data_parallel_size=8,
        protocol_version=p.process.protocol_version, frontend_heartbeat=0.5, exit_when_frontend_gone=9.0,
        kv_events_config=p.process.kv_events_config, metrics_port=9100, metrics_host="0.0.0.0", on_stop="finish",
        drain_timeout=4.0, send_dead_on_exit=True,
    )  # fmt: skip
    assert p.process.ranks == range(2, 5) and p.process.kv_events_config.enabled and p.kv.kv_events
    default = parts().process
    assert (default.first_rank, default.engine_count, default.data_parallel_size, default.metrics_port) == (0, 1, 1, None)
    assert (default.on_stop, default.exit_when_frontend_gone, default.kv_events_config) == ("exit", None, None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        default.on_stop = "abort"


def test_the_parts_are_frozen():
    p = parts()
    for part in (p, p.generation, p.scheduler, p.kv, p.lora, p.logging, p.latency):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(part, dataclasses.fields(part)[0].name, None)


def test_engine_settings_carry_the_parts_to_one_engine():
    p = parts("--itl-ms", "5", "--max-num-seqs", "8", "--seed", "3", "--token-id-range", "10:20", "--enable-lora", "--max-cpu-loras", "4")
    wire = Wire()
    s = settings.engine_settings(p, 1, 2, True, wire)
    assert isinstance(s, EngineSettings)
    assert (s.rank, s.num_clients, s.has_coordinator, s.wire) == (1, 2, True, wire)
    assert (s.latency, s.max_num_seqs, s.max_num_batched_tokens, s.kv_blocks) == (p.latency, 8, None, None)
    assert (s.seed, s.enable_lora, s.max_loras, s.max_cpu_loras, s.reuse_outputs) == (3, True, 1, 4, True)
    assert isinstance(s.token_source, RandomTokens) and (s.token_source.low, s.token_source.span) == (10, 10)
    echo = EchoTokens()
    assert settings.engine_settings(p, 0, 1, False, wire, echo).token_source is echo


def test_every_reloadable_setting_is_an_engine_setting_fed_by_a_reloadable_option():
    fields = set(EngineSettings.__dataclass_fields__)
    for option in options.OPTIONS.values():
        if option.setting is not None:
            assert option.setting in fields and option.reload is not None, option.flag
    assert set(options.RELOADABLE_SETTINGS) == {o.setting for o in options.OPTIONS.values() if o.setting}
