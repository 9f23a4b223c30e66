"""P/D disaggregation (kv/transfer.py) in the pure engine: the producer's
kv_transfer_params, the consumer's transfer wait, failed loads, bad params,
the config flags and the kv-transfer-* faults (no sockets).

§N: section N of docs/protocol.md."""

import pytest
from loguru import logger

from gmock_engine.runtime import fault_injection
from gmock_engine.kv import transfer as kv_transfer
from gmock_engine.config.loader import ConfigError, parse_config
from gmock_engine.core.engine import EngineCore, EngineSettings
from gmock_engine.faults.specs import parse_spec
from gmock_engine.kv.transfer import KVTransferSettings, parse_kv_transfer_config
from gmock_engine.wire.checks import check_kv_transfer_params
from gmock_engine.wire.eras import layout_for_version
from gmock_engine.wire.inputs import EngineCoreRequest
from gmock_engine.wire.outputs import engine_core_output
from gmock_engine.wire.types import FinishReason
from engine_steps import Clock, outputs_of, run_due, tokens_of

#: What vLLM's disaggregated-serving proxy sends the prefill server (toy_proxy_server.py).
PROXY_PREFILL_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def make(role="both", clock=None, **kw):
    settings = None if role is None else KVTransferSettings(role=role, **kw)
    clock = clock or Clock()
    return EngineCore(EngineSettings(rank=0, num_clients=1, kv_transfer=settings, block_size=16), clock=clock), clock


def add(rid, max_tokens=8, prompt_len=40, **extra_args):
    return EngineCoreRequest(request_id=rid, prompt_len=prompt_len, max_tokens=max_tokens, has_sampling_params=True, extra_args=extra_args)


def decode_params(**over):
    """What a producer answered, as the proxy passes it to the decode side."""
    params = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [[0, 1, 2]],
        "remote_engine_id": "gmock",
        "remote_request_id": "p-1",
        "remote_host": "localhost",
        "remote_port": 5600,
        "tp_size": 1,
    }
    params.update(over)
    return params


# -- producer -----------------------------------------------------------------


def test_producer_ends_after_the_first_token_with_the_params_the_decode_side_needs():
    engine, _ = make("producer", engine_id="eng-a", host="10.0.0.1", port=7000)
    engine.apply(add("p-1", max_tokens=50, prompt_len=40, kv_transfer_params=PROXY_PREFILL_PARAMS))
    sent = run_due(engine)
    outs = outputs_of(sent, "p-1")
    assert len(outs) == 1 and len(outs[0][1]) == 1
    assert outs[0][5] == FinishReason.LENGTH
    params = outs[0][8]  # §4.3: kv_transfer_params at index 8 in every era
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_engine_id"] == "eng-a"
    assert params["remote_host"] == "10.0.0.1" and params["remote_port"] == 7000
    assert params["remote_request_id"] == "p-1"
    assert [len(group) for group in params["remote_block_ids"]] == [3]  # ceil(40 / 16)
    assert params["remote_num_tokens"] == 40
    # and the decode side accepts exactly that
    assert kv_transfer.complete(params)
    check_kv_transfer_params(params)


def test_producer_block_ids_differ_between_requests_and_dp_ranks_get_their_own_engine_id():
    settings = KVTransferSettings(role="producer", engine_id="e", data_parallel_size=2)
    engine = EngineCore(EngineSettings(rank=1, num_clients=1, kv_transfer=settings, num_gpu_blocks=100), clock=Clock())
    engine.apply(add("a", kv_transfer_params={"do_remote_decode": True}))
    engine.apply(add("b", kv_transfer_params={"do_remote_decode": True}))
    sent = run_due(engine)
    a, b = outputs_of(sent, "a")[-1][8], outputs_of(sent, "b")[-1][8]
    assert a["remote_engine_id"] == "e_dp1" and a["remote_port"] == 5601
    assert not set(a["remote_block_ids"][0]) & set(b["remote_block_ids"][0])


@pytest.mark.parametrize("era", ["0.11.0", "0.17.1", "0.20.0", "0.26.0", "0.33.0"])
def test_kv_transfer_params_sit_at_index_8_in_every_era(era):
    layout = layout_for_version(era)
    out = engine_core_output("r", [1], FinishReason.LENGTH, layout=layout, kv_transfer_params={"x": 1})
    assert layout.output_fields[8] == "kv_transfer_params" and out[8] == {"x": 1}


def test_a_producer_request_that_errors_returns_no_params():
    engine, _ = make("producer")
    engine.apply(add("p", kv_transfer_params={"do_remote_decode": True}, mock_finish="error"))
    out = outputs_of(run_due(engine), "p")[-1]
    assert out[5] == FinishReason.ERROR and (len(out) <= 8 or out[8] is None)


# -- consumer -----------------------------------------------------------------


def test_consumer_waits_the_transfer_time_then_decodes_without_prefill():
    engine, clock = make("consumer", ms_per_token=10.0, ms_per_block=100.0)
    engine.apply(add("d", max_tokens=5, prompt_len=40, kv_transfer_params=decode_params()))
    # 40 tokens * 10 ms + 3 blocks * 100 ms = 0.7 s
    assert engine.next_step_time(clock.now) == pytest.approx(clock.now)
    sent = engine.step()  # admitted: waits for its KV
    assert tokens_of(sent, "d") == []
    assert engine.next_step_time(clock.now) == pytest.approx(clock.now + 0.7)
    clock.now += 0.69
    assert tokens_of(engine.step(), "d") == []
    clock.now += 0.02
    sent = run_due(engine)
    outs = outputs_of(sent, "d")
    assert len(tokens_of(sent, "d")) == 5 and outs[-1][5] == FinishReason.LENGTH
    stats = outs[0][11]  # 0.33: prefill_stats at 11; the loaded tokens are external hits
    assert stats["num_external_cached_tokens"] == 40 and stats["num_computed_tokens"] == 0


def test_a_request_waiting_for_its_kv_counts_as_waiting_as_in_vllm():
    engine, clock = make("consumer", ms_per_token=10.0)
    engine.apply(add("d", prompt_len=10, kv_transfer_params=decode_params()))
    engine.step()
    stats = engine.scheduler_stats()
    assert (stats["num_running_reqs"], stats["num_waiting_reqs"]) == (0, 1)  # vLLM: kv_holding_waiting
    clock.now += 0.2
    engine.step()
    stats = engine.scheduler_stats()
    assert (stats["num_running_reqs"], stats["num_waiting_reqs"]) == (1, 0)


def test_consumer_failed_load_ends_with_error_and_no_tokens():
    engine, _ = make("consumer", ms_per_token=1.0)
    engine.apply(add("d", kv_transfer_params=decode_params(), mock_kv_load="fail"))
    engine.apply(add("ok", kv_transfer_params=decode_params()))
    sent = run_due(engine)
    out = outputs_of(sent, "d")
    assert tokens_of(sent, "d") == [] and out[-1][5] == FinishReason.ERROR
    assert out[-1][18]["code"] == "kv_load_failed"  # 0.33: RequestError at 18
    assert len(tokens_of(sent, "ok")) == 8  # the other request is not affected
    assert engine.ledger.summary().get("finished_error", 0) == 1


def test_consumer_failed_load_with_recompute_policy_prefills_itself():
    engine, _ = make("consumer", load_failure_policy="recompute")
    engine.apply(add("d", kv_transfer_params=decode_params(), mock_kv_load="fail"))
    sent = run_due(engine)
    assert len(tokens_of(sent, "d")) == 8 and outputs_of(sent, "d")[-1][5] == FinishReason.LENGTH


def test_slow_transfer_delay_adds_to_the_transfer_time():
    engine, clock = make("consumer", ms_per_token=10.0)
    engine.apply(add("d", prompt_len=10, kv_transfer_params=decode_params(), mock_kv_transfer_delay_ms=500))
    engine.step()
    assert engine.next_step_time(clock.now) == pytest.approx(clock.now + 0.6)


def test_abort_during_the_transfer_wait_ends_the_request_with_abort():
    engine, clock = make("consumer", ms_per_token=1000.0)
    engine.apply(add("d", kv_transfer_params=decode_params()))
    assert tokens_of(engine.step(), "d") == []
    sent = engine.abort_requests(["d"])
    assert outputs_of(sent, "d")[-1][5] == FinishReason.ABORT and not engine.has_work
    assert "d" not in engine.scheduler.prefilling


def test_incomplete_consumer_params_compute_locally_as_nixl():
    engine, clock = make("consumer", ms_per_token=1000.0)
    engine.apply(add("d", kv_transfer_params=decode_params(remote_host=None)))
    sent = engine.step()
    assert len(tokens_of(sent, "d")) == 1  # no transfer wait


def test_a_direction_the_role_does_not_serve_and_pd_off_run_plain_requests():
    for role, params in (("consumer", {"do_remote_decode": True}), ("producer", decode_params()), (None, {"do_remote_decode": True})):
        engine, _ = make(role, ms_per_token=1000.0)
        engine.apply(add("r", max_tokens=4, kv_transfer_params=params))
        sent = run_due(engine)
        assert len(tokens_of(sent, "r")) == 4, role
        assert all(len(o) <= 8 or o[8] is None for o in outputs_of(sent, "r")), role


@pytest.mark.parametrize(
    "params,needle",
    [
        ("yes", "must be a map"),
        ({"do_remote_decode": "true"}, "do_remote_decode must be a bool"),
        ({"do_remote_decode": True, "do_remote_prefill": True}, "both"),
        (dict(decode_params(), remote_port="5600"), "remote_port"),
        (dict(decode_params(), remote_port=70000), "remote_port"),
        (dict(decode_params(), remote_block_ids=[1.5]), "remote_block_ids"),
        (dict(decode_params(), remote_block_ids=[[1, -2]]), "remote_block_ids"),
        (dict(decode_params(), remote_block_ids="0,1"), "remote_block_ids"),
        (dict(decode_params(), remote_engine_id=7), "remote_engine_id"),
    ],
)
def test_bad_params_end_that_request_with_error_only(params, needle):
    engine, _ = make("both")
    sent = engine.apply(add("bad", kv_transfer_params=params))
    sent += engine.apply(add("good", max_tokens=3))
    sent += run_due(engine)
    out = outputs_of(sent, "bad")
    assert len(out) == 1 and out[0][5] == FinishReason.ERROR
    assert needle in out[0][18]["message"] and out[0][18]["code"] == "validation_error"
    assert len(tokens_of(sent, "good")) == 3


@pytest.mark.parametrize("xargs", [{"mock_kv_load": "maybe"}, {"mock_kv_transfer_delay_ms": -1}, {"mock_kv_transfer_delay_ms": "5"}])
def test_bad_pd_xargs_end_the_request_with_error(xargs):
    engine, _ = make("consumer")
    out = outputs_of(engine.apply(add("bad", kv_transfer_params=decode_params(), **xargs)), "bad")
    assert out[-1][5] == FinishReason.ERROR and out[-1][18]["code"] == "validation_error"


# -- configuration -------------------------------------------------------------


def test_kv_transfer_config_json_as_vllm_users_write_it():
    config = parse_kv_transfer_config('{"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}')
    settings = kv_transfer.settings_from(None, config, 1.0, 0.0, 1)
    assert settings.role == "both" and settings.load_failure_policy == "recompute"
    assert kv_transfer.settings_from(None, None, 0.0, 0.0, 1) is None  # off by default


@pytest.mark.parametrize(
    "text,needle",
    [
        ("{not json", "not JSON"),
        ("[1]", "JSON object"),
        ('{"kv_rol": "kv_both"}', "unknown key 'kv_rol'"),
        ('{"kv_role": "kv_prefill"}', "kv_role"),
        ('{"kv_connector": "NixlConnector"}', "kv_role"),
        ('{"kv_role": "kv_both", "kv_port": 0}', "kv_port"),
        ('{"kv_role": "kv_both", "kv_load_failure_policy": "retry"}', "kv_load_failure_policy"),
    ],
)
def test_bad_kv_transfer_config_stops_at_start_naming_the_flag(text, needle):
    with pytest.raises(ConfigError) as info:
        parse_config(["--kv-transfer-config", text], env={})
    assert "--kv-transfer-config" in str(info.value) and needle in str(info.value)


def test_kv_role_flag_env_and_contradiction():
    assert parse_config(["--kv-role", "consumer"], env={}).kv_role == "consumer"
    assert parse_config([], env={"GMOCK_KV_ROLE": "producer"}).kv_role == "producer"
    with pytest.raises(ConfigError, match="--kv-role"):
        parse_config(["--kv-role", "sender"], env={})
    with pytest.raises(ConfigError, match="contradicts"):
        parse_config(["--kv-role", "producer", "--kv-transfer-config", '{"kv_role": "kv_consumer"}'], env={})
    with pytest.raises(ConfigError, match="--kv-transfer-ms-per-token"):
        parse_config(["--kv-transfer-ms-per-token", "-1"], env={})


# -- faults ----------------------------------------------------------------------


class _Engine:
    """What the fault layer reads of the engine: its P/D side."""

    def __init__(self, role="consumer"):
        self.kv_transfer = kv_transfer.KVTransfer(KVTransferSettings(role=role), 0, 16)

    def fail_utility(self, call, failure):
        return []


def _injector(kind, text, role="consumer"):
    hooks = fault_injection.RuntimeHooks(0, logger, lambda *a: None, lambda item: None, lambda: None)
    layer, _ = fault_injection.build([parse_spec(kind, text)], 0, hooks)
    layer.joined(_Engine(role), 0.0)
    return layer


def test_kv_transfer_faults_act_on_consumer_requests_only_and_are_counted():
    layer = _injector("kv-transfer-fail", "every=1")
    plain, _ = layer.on_input(add("plain"))
    assert "mock_kv_load" not in plain.extra_args
    failed, _ = layer.on_input(add("d", kv_transfer_params=decode_params()))
    assert failed.extra_args["mock_kv_load"] == "fail"
    assert layer.faults.summary()["fault_kv_transfer_fail"] == 1

    producer = _injector("kv-transfer-fail", "every=1", role="producer")  # no load happens there: no occasion
    untouched, _ = producer.on_input(add("d", kv_transfer_params=decode_params()))
    assert "mock_kv_load" not in untouched.extra_args and producer.faults.summary()["fault_kv_transfer_fail"] == 0

    slow = _injector("kv-transfer-slow", "every=1 delay=1500ms")
    late, _ = slow.on_input(add("d", kv_transfer_params=decode_params(), mock_kv_transfer_delay_ms=100))
    assert late.extra_args["mock_kv_transfer_delay_ms"] == pytest.approx(1600.0)


def test_kv_transfer_fault_spec_grammar():
    assert parse_spec("kv-transfer-slow", "rate=0.5").delay == 2.0
    with pytest.raises(ValueError, match="unknown key"):
        parse_spec("kv-transfer-fail", "every=1 delay=1s")


def test_kv_transfer_config_from_a_config_file_and_the_environment(tmp_path):
    ini = tmp_path / "pd.ini"
    ini.write_text('[gmock_engine]\nkv-transfer-config = {"kv_role": "kv_consumer", "engine_id": "d-0"}\n')
    args = parse_config(["--config", str(ini)], env={})
    assert args.kv_transfer_config == {"kv_role": "kv_consumer", "engine_id": "d-0"}
    assert kv_transfer.settings_from(args.kv_role, args.kv_transfer_config, 0.0, 0.0, 1).engine_id_of(0) == "d-0"
    with pytest.raises(ConfigError, match="GMOCK_KV_TRANSFER_CONFIG"):
        parse_config([], env={"GMOCK_KV_TRANSFER_CONFIG": '{"kv_role": "kv_both", "kv_port": 99999}'})


def test_random_hostile_params_never_stop_the_engine():
    """Seeded junk in every kv_transfer_params key: each request ends (ERROR
    or its tokens), nothing raises, the books balance."""
    import random

    rng = random.Random(16)
    junk = [None, True, False, 0, -1, 1 << 64, 1.5, float("nan"), "", "x" * 300, b"\x00", [], [[]], [1, [2]],
            [[1, 2], 3], {}, {"a": [1]}, {1: 2}, [[[1]]], list(range(5)), 65535, 65536]
    keys = ["do_remote_decode", "do_remote_prefill", "remote_engine_id", "remote_host", "remote_port",
            "remote_block_ids", "remote_request_id", "tp_size", "unknown"]
    engine, _ = make("both", ms_per_token=0.5)
    engine.settings.log_requests = True  # the P/D log line must cope with any value too
    sent, ids = [], []
    for i in range(300):
        params = {k: rng.choice(junk) for k in rng.sample(keys, rng.randint(0, len(keys)))}
        if rng.random() < 0.5:  # valid but for the unchecked keys: the request is planned (and logged)
            params = dict(decode_params(), tp_size=rng.choice(junk), unknown=rng.choice(junk))
            params.pop(rng.choice(["do_remote_decode", "do_remote_prefill"]))
            if rng.random() < 0.2:
                params[7] = "an int key beside the str ones"
        if rng.random() < 0.5:
            params[rng.choice(["do_remote_decode", "do_remote_prefill"])] = True
        if rng.random() < 0.1:
            params = rng.choice(junk)
        ids.append(f"r{i}")
        sent += engine.apply(add(f"r{i}", max_tokens=3, kv_transfer_params=params))
    sent += run_due(engine)
    ended = {o[0] for _, m in sent for o in m[1] if len(o) > 5 and o[5] is not None}
    assert ended == set(ids)
    summary = engine.ledger.summary()
    assert summary.get("violations", 0) == 0 and engine.num_active == 0


def test_a_consumer_caches_the_loaded_blocks_and_loads_only_the_rest_next_time():
    """With --prefix-caching the decode engine keeps what it loaded, cached
    once the load is done (vLLM caches the blocks after a remote load): the
    same prompt again is a local hit, and only its uncached tail comes over
    the transfer."""
    clock = Clock()
    settings = KVTransferSettings(role="consumer", ms_per_token=10.0)
    engine = EngineCore(EngineSettings(rank=0, num_clients=1, kv_transfer=settings, block_size=16, prefix_caching=True), clock=clock)
    prompt = list(range(1, 41))  # 40 tokens: 2 full blocks
    for rid in ("first", "again"):
        engine.apply(EngineCoreRequest(request_id=rid, prompt_len=40, prompt_token_ids=prompt, max_tokens=2,
                                       has_sampling_params=True, extra_args={"kv_transfer_params": decode_params()}))
        engine.step()
        waits = engine.next_step_time(clock.now) - clock.now
        sent = run_due(engine)
        assert len(tokens_of(sent, rid)) == 2
        if rid == "first":
            assert waits == pytest.approx(0.4)  # all 40 tokens loaded
        else:
            assert waits == pytest.approx(0.08)  # 32 cached locally, 8 loaded
            stats = outputs_of(sent, rid)[0][11]
            assert stats["num_local_cached_tokens"] == 32 and stats["num_external_cached_tokens"] == 8
