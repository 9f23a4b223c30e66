"""LoRA adapters: the registry's LRU/pin semantics (vLLM's
LRUCacheWorkerLoRAManager), the utilities, ADDs naming an adapter, max_loras
in the scheduler, and the per-adapter SchedulerStats (no sockets).

§N: section N of docs/protocol.md."""

import json

import pytest

from gmock_engine.core.engine import EngineCore, EngineSettings
from gmock_engine.timing.latency import LatencyModel
from gmock_engine.core.lora import AdapterRegistry, LoRAError, LoRARequest, decode_lora_request
from gmock_engine.wire.eras import Wire
from gmock_engine.wire.inputs import EngineCoreRequest, UtilityCall, decode_add, unpack
from gmock_engine.wire.outputs import pack
from gmock_engine.wire.types import BadValue, FinishReason
from engine_steps import TickClock, outputs_of, run


def add(rid, max_tokens=16, **kw):
    return EngineCoreRequest(request_id=rid, prompt_len=3, max_tokens=max_tokens, has_sampling_params=True, **kw)


def error_of(output):
    """The RequestError message of an ERROR output (its position depends on the era)."""
    [error] = [f for f in output if isinstance(f, dict) and "message" in f]
    return error["message"]


def finished_of(sent):
    return [r for _, m in sent if len(m) > 5 and m[5] for r in m[5]]


def adapter_dir(tmp_path, name="a", r=8, **extra):
    """The smallest adapter directory vLLM's worker accepts up to its
    weights: adapter_config.json with PEFTHelper's three required keys."""
    path = tmp_path / name
    path.mkdir()
    (path / "adapter_config.json").write_text(json.dumps({"r": r, "lora_alpha": 16, "target_modules": ["q_proj"], **extra}))
    return str(path)


def wire(name, lora_id, path="/x"):
    """A LoRARequest as the frontends send it: a msgspec array, trailing defaults omitted."""
    return [name, lora_id, path]


def registry(max_loras=1, max_cpu=2, check=False):
    return AdapterRegistry(max_loras, max_cpu, 16, check)


def lr(lora_id, name=None, path="/x", **kw):
    return LoRARequest(name or f"l{lora_id}", lora_id, path, **kw)


# -- the wire ---------------------------------------------------------------------


def test_decode_lora_request_array_and_map():
    assert decode_lora_request(None) is None
    assert decode_lora_request(["a", 3, "/p"]) == LoRARequest("a", 3, "/p")
    full = decode_lora_request(["a", 3, "/p", "base", True, False])
    assert full.base_model_name == "base" and full.load_inplace
    assert decode_lora_request({"lora_name": "a", "lora_int_id": 3, "lora_path": "/p"}) == LoRARequest("a", 3, "/p")


@pytest.mark.parametrize(
    "value,words",
    [
        ("a", "not a LoRARequest"),
        (["a"], "elements"),
        (["a", 0, "/p"], "id must be > 0"),
        (["a", True, "/p"], "lora_int_id"),
        (["a", 1.5, "/p"], "lora_int_id"),
        (["", 1, "/p"], "lora_name"),
        (["a", 1], "lora_path cannot be empty"),
        (["a", 1, 7], "lora_path cannot be empty"),
        (["a", 1, "/p", 5], "base_model_name"),
        (["a", 1, "/p", None, "yes"], "load_inplace"),
        ({"lora_name": "a", "lora_int_id": 1, "lora_path": "/p", "x": 1}, "unknown key"),
        (["a", 2**70, "/p"], "lora_int_id"),
    ],
)
def test_bad_lora_requests_raise_bad_value(value, words):
    with pytest.raises(BadValue, match=words):
        decode_lora_request(value)


def test_decode_add_keeps_the_lora_request_of_a_real_rs_fe_layout():
    # the observed Rs-FE ADD (docs/protocol.md §3.2) with a LoRARequest at index 6
    add_frame = ["cmpl-1", [4], None, {"max_tokens": 3}, None, 1.0, ["sql", 1, "/a"], None, None, None, None, 0, 0, 0, None, False, "cmpl", None, {}, False, None, None]
    request = decode_add(unpack(pack(add_frame)), Wire())
    assert request.lora_request == ["sql", 1, "/a"]


# -- the registry (vllm/lora/worker_manager.py, model_manager.py) -----------------


def test_lru_eviction_under_max_cpu_loras_and_max_loras():
    reg = registry(max_loras=1, max_cpu=2)
    assert reg.add(lr(1)) and reg.add(lr(2))
    assert reg.list() == [1, 2] and list(reg.gpu.order) == [2]  # one GPU slot: 1 was deactivated
    reg.add(lr(1))  # a touch: 1 is now the most recent, no load
    assert reg.loads == 2 and list(reg.cpu.order) == [2, 1] and list(reg.gpu.order) == [1]
    reg.add(lr(3))  # CPU full: the least recently used (2) goes
    assert reg.list() == [1, 3] and reg.loads == 3


def test_pinned_adapters_are_never_evicted_and_all_pinned_is_vllms_error():
    reg = registry(max_loras=1, max_cpu=2)
    reg.add(lr(1))
    assert reg.pin(1) is True
    # registered first, then the only GPU slot is pinned by 1: vLLM raises
    # from activate_adapter with 2 already in the CPU cache
    with pytest.raises(LoRAError, match="All items are pinned"):
        reg.add(lr(2))
    assert reg.list() == [1, 2] and list(reg.gpu.order) == [1]


def test_pin_then_cpu_eviction_skips_the_pinned_one():
    reg = registry(max_loras=2, max_cpu=2)
    reg.add(lr(1))
    reg.add(lr(2))
    reg.pin(1)
    reg.add(lr(3))  # 1 is oldest but pinned: 2 goes
    assert reg.list() == [1, 3]
    reg.pin(3)
    with pytest.raises(LoRAError, match="All items are pinned, cannot remove oldest from the cache."):
        reg.add(lr(4))
    assert reg.list() == [1, 3]  # a failed add changes nothing


def test_pin_unknown_remove_and_reload_inplace():
    reg = registry(max_loras=1, max_cpu=2)
    with pytest.raises(LoRAError, match="Pinning failed. LoRA 7 is not registered."):
        reg.pin(7)
    reg.add(lr(1))
    reg.pin(1)
    assert reg.remove(1) is True and reg.remove(1) is False
    assert reg.list() == [] and not reg.cpu.pinned and not reg.gpu.pinned  # removal unpins
    reg.add(lr(1, path="/old"))
    reg.add(lr(1, path="/new", load_inplace=True))
    assert reg.adapters[1].lora_path == "/new" and reg.loads == 3


def test_adapter_dir_is_read_as_vllms_worker_reads_it(tmp_path):
    reg = AdapterRegistry(1, 1, 16, True)
    good = adapter_dir(tmp_path)
    assert reg.add(LoRARequest("a", 1, good))
    with pytest.raises(LoRAError, match=r"^Loading lora b failed: No adapter found for /nonexistent$"):
        reg.add(LoRARequest("b", 2, "/nonexistent"))
    with pytest.raises(LoRAError, match="LoRA rank 64 is greater than max_lora_rank 16."):
        reg.add(LoRARequest("c", 3, adapter_dir(tmp_path, "c", r=64)))
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "adapter_config.json").write_text('{"r": 8}')
    with pytest.raises(LoRAError, match="Missing required configuration fields"):
        reg.add(LoRARequest("d", 4, str(tmp_path / "d")))
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "adapter_config.json").write_text("not json")
    with pytest.raises(LoRAError, match="Loading lora e failed"):
        reg.add(LoRARequest("e", 5, str(tmp_path / "e")))
    assert reg.list() == [1]  # nothing failed evicted the loaded one


# adapter_config.json fields of the wrong type, each with the words the error must carry
BAD_CONFIG_TYPES = [
    ({"r": "8"}, "LoRA rank `r` must be a positive integer, got '8'."),
    ({"r": 8.0}, "LoRA rank `r` must be a positive integer, got 8.0."),
    ({"r": True}, "LoRA rank `r` must be a positive integer, got True."),
    ({"lora_alpha": "16"}, "`lora_alpha` must be a number, got '16'."),
    ({"lora_alpha": None}, "`lora_alpha` must be a number, got None."),
    ({"target_modules": 5}, "`target_modules` must be a list of strings or a string, got 5."),
    ({"target_modules": ["q_proj", 7]}, "`target_modules` must be a list of strings or a string"),
    ({"target_modules": None}, "`target_modules` must be a list of strings or a string, got None."),
    ({"modules_to_save": "classifier"}, "`modules_to_save` must be a list of strings or null"),
    ({"modules_to_save": 5}, "`modules_to_save` must be a list of strings or null, got 5."),
    ({"use_dora": "false"}, "`use_dora` must be a bool, got 'false'."),
    ({"use_rslora": 1}, "`use_rslora` must be a bool, got 1."),
    ({"lora_bias": "no"}, "`lora_bias` must be a bool"),
    ({"init_lora_weights": 0}, "`init_lora_weights` must be a bool or a string, got 0."),
    ({"rank_pattern": ["q_proj", 4]}, "`rank_pattern` must be an object"),
    ({"rank_pattern": {"q_proj": "4"}}, "LoRA rank for `q_proj` in `rank_pattern` must be a positive integer, got '4'."),
    ({"alpha_pattern": {"q_proj": "x"}}, "`alpha_pattern` must be an object of numbers"),
    ({"layer_replication": 3}, "`layer_replication` must be a list of [start, end] lists or null, got 3."),
    ({"bias": None}, "Adapter bias is not supported."),
    ({"bias": 0}, "Adapter bias is not supported."),
]


@pytest.mark.parametrize("fields,message", BAD_CONFIG_TYPES, ids=[repr(f) for f, _ in BAD_CONFIG_TYPES])
def test_adapter_config_types_are_checked_as_peft_helper_declares_them(tmp_path, fields, message):
    reg = AdapterRegistry(1, 1, 16, True)
    config = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"], **fields}
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(LoRAError) as err:
        reg.add(LoRARequest("a", 1, str(tmp_path / "a")))
    assert message in str(err.value)
    assert reg.list() == [] and reg.loads == 0


def test_adapter_configs_peft_writes_load_and_unsupported_features_get_vllms_words(tmp_path):
    reg = AdapterRegistry(2, 2, 16, True)
    # what PEFT's save_pretrained writes for a plain LoRA: nulls and empty patterns load
    plain = dict(
        bias="none", modules_to_save=None, use_rslora=False, use_dora=False, lora_bias=False, init_lora_weights=True,
        rank_pattern={}, alpha_pattern={}, layer_replication=None, target_modules="all-linear", lora_alpha=16.0,
        task_type="CAUSAL_LM", peft_type="LORA",
    )
    assert reg.add(LoRARequest("plain", 1, adapter_dir(tmp_path, "plain", **plain)))
    assert reg.add(LoRARequest("cls", 2, adapter_dir(tmp_path, "cls", modules_to_save=["score"], init_lora_weights="gaussian")))
    cases = [
        ({"modules_to_save": ["lm_head"]}, "Unsupported modules_to_save: ['lm_head']"),
        ({"use_dora": True}, "vLLM does not yet support DoRA."),
        ({"lora_bias": True}, "vLLM does not support LoRA bias (lora_bias)."),
        ({"init_lora_weights": "pissa"}, "vLLM does not support init_lora_weights='pissa'."),
        ({"alora_invocation_tokens": [1, 2]}, "vLLM does not support Activated LoRA (aLoRA)."),
        ({"layer_replication": [[0, 4]]}, "vLLM does not support layer_replication."),
        ({"use_bdlora": {"n": 2}}, "vLLM does not support block-diagonal LoRA (BD-LoRA)."),
        ({"use_qalora": True}, "vLLM does not support QALoRA."),
        ({"rank_pattern": {"q_proj": 32}}, "LoRA rank 32 is greater than max_lora_rank 16."),
    ]
    for i, (fields, message) in enumerate(cases):
        with pytest.raises(LoRAError) as err:
            reg.add(LoRARequest(f"x{i}", 10 + i, adapter_dir(tmp_path, f"x{i}", **fields)))
        assert message in str(err.value), (fields, str(err.value))
    # validate_legal joins every problem in one message, features first
    with pytest.raises(LoRAError, match=r"^vLLM does not yet support DoRA\. LoRA rank 64 is greater than max_lora_rank 16\. Adapter bias is not supported\.$"):
        reg.add(LoRARequest("y", 30, adapter_dir(tmp_path, "y", r=64, use_dora=True, bias="all")))
    assert reg.list() == [1, 2]


# -- the engine: utilities, ADDs, scheduling, stats ---------------------------------


def make(max_loras=1, max_cpu=None, enable=True, check=False, **kw):
    settings = EngineSettings(
        rank=0, num_clients=1, enable_lora=enable, max_loras=max_loras, max_cpu_loras=max_cpu, lora_check_adapter_dir=check, **kw
    )
    return EngineCore(settings, clock=TickClock())


def call(engine, method, *args):
    [(_, message)] = engine.apply(UtilityCall(0, 5, method, list(args)))
    _, failure, result = message[4]
    return failure, (result[1] if result is not None else None)


def test_utilities_follow_vllm():
    engine = make(max_loras=1, max_cpu=2)
    assert call(engine, "list_loras") == (None, [])
    assert call(engine, "add_lora", wire("a", 1)) == (None, True)
    assert call(engine, "add_lora", wire("b", 2)) == (None, True)
    assert call(engine, "add_lora", wire("c", 3)) == (None, True)
    assert call(engine, "list_loras") == (None, [2, 3])
    assert call(engine, "pin_lora", 2) == (None, True)
    assert call(engine, "remove_lora", 9) == (None, False)
    assert call(engine, "remove_lora", 3) == (None, True)
    assert call(engine, "list_loras") == (None, [2])
    failure, _ = call(engine, "pin_lora", 3)
    assert failure == "Pinning failed. LoRA 3 is not registered."


@pytest.mark.parametrize(
    "method,args,words",
    [
        ("add_lora", [], "lora_request is nil"),
        ("add_lora", ["x"], "add_lora: lora_request is str"),
        ("add_lora", [["a", -1, "/p"]], "id must be > 0"),
        ("remove_lora", ["1"], "lora_id must be an int"),
        ("pin_lora", [], "lora_id must be an int"),
    ],
)
def test_bad_utility_arguments_fail_that_call_only(method, args, words):
    engine = make()
    failure, result = call(engine, method, *args)
    assert words in failure and result is None
    assert call(engine, "add_lora", wire("a", 1)) == (None, True)  # the engine goes on


def test_without_enable_lora_utilities_fail_and_adds_end_with_error():
    engine = make(enable=False)
    failure, _ = call(engine, "add_lora", wire("a", 1))
    assert failure == "LoRA is not enabled. Use --enable-lora to enable LoRA."
    assert call(engine, "list_loras") == (None, [])
    sent = engine.apply(add("r", 3, lora_request=wire("a", 1)))
    [out] = outputs_of(sent, "r")
    assert out[5] == FinishReason.ERROR and "LoRA is not enabled" in error_of(out)


def test_bad_lora_request_in_an_add_ends_that_request_only():
    engine = make()
    sent = engine.apply(add("bad", 3, lora_request=["a", 0, "/p"]))
    [out] = outputs_of(sent, "bad")
    assert out[5] == FinishReason.ERROR and "id must be > 0" in error_of(out)
    engine.apply(add("good", 3, lora_request=wire("a", 1)))
    sent = run(engine)
    assert outputs_of(sent, "good")[-1][5] == FinishReason.LENGTH


def test_an_add_naming_an_unregistered_adapter_loads_it(tmp_path):
    engine = make(check=True)
    engine.apply(add("r", 2, lora_request=wire("a", 1, adapter_dir(tmp_path))))
    sent = run(engine)
    assert outputs_of(sent, "r")[-1][5] == FinishReason.LENGTH
    assert call(engine, "list_loras") == (None, [1])


def test_an_adapter_that_cannot_load_ends_its_request_with_vllms_message():
    engine = make(check=True)
    engine.apply(add("r", 2, lora_request=wire("a", 1, "/nonexistent")))
    engine.apply(add("plain", 2))
    sent = run(engine)
    [out] = outputs_of(sent, "r")
    assert out[5] == FinishReason.ERROR
    assert error_of(out) == "Loading lora a failed: No adapter found for /nonexistent"
    assert sorted(finished_of(sent)) == ["plain", "r"]


def test_max_loras_limits_distinct_adapters_in_the_batch_and_skips_in_order():
    engine = make(max_loras=1, max_cpu=4)
    engine.apply(add("a1", 5, lora_request=wire("a", 1)))
    engine.apply(add("b1", 5, lora_request=wire("b", 2)))
    engine.apply(add("a2", 5, lora_request=wire("a", 1)))
    engine.apply(add("base", 5))
    engine.step()
    running = set(engine.scheduler.running)
    assert running == {"a1", "a2", "base"}  # b1 is skipped, the ones behind it are not
    assert [r.request_id for r in engine.scheduler.waiting.requests()] == ["b1"]
    waiting, running_loras = engine.scheduler.lora_adapters()
    assert waiting == {"b": 1} and running_loras == {"a": 2}
    stats = engine.scheduler_stats()
    assert stats["waiting_lora_adapters"] == {"b": 1} and stats["running_lora_adapters"] == {"a": 2}
    sent = run(engine)
    assert sorted(finished_of(sent)) == ["a1", "a2", "b1", "base"]
    assert engine.scheduler_stats()["running_lora_adapters"] == {}


def test_all_gpu_slots_pinned_by_others_is_an_error_for_the_request():
    engine = make(max_loras=1, max_cpu=2)
    call(engine, "add_lora", wire("a", 1))
    call(engine, "pin_lora", 1)
    engine.apply(add("b1", 3, lora_request=wire("b", 2)))
    sent = run(engine)
    [out] = outputs_of(sent, "b1")
    assert out[5] == FinishReason.ERROR and "All items are pinned" in error_of(out)


def test_lora_load_ms_delays_the_first_token_of_the_loading_request_only():
    clock = [0.0]
    settings = EngineSettings(rank=0, num_clients=1, enable_lora=True, lora_check_adapter_dir=False, latency=LatencyModel(lora_load_ms=500))
    engine = EngineCore(settings, clock=lambda: clock[0])
    engine.apply(add("first", 2, lora_request=wire("a", 1)))
    assert outputs_of(engine.step(), "first") == []  # loading the adapter
    assert engine.next_step_time(0.0) == pytest.approx(0.5)
    clock[0] = 0.5
    assert outputs_of(engine.step(), "first")
    engine.apply(add("second", 2, lora_request=wire("a", 1)))
    assert outputs_of(engine.step(), "second")  # resident: no load


def test_skipped_requests_keep_their_place_in_the_queue():
    # vLLM prepends its skipped_waiting_requests: b1 and c1 stay ahead of a3
    engine = make(max_loras=1, max_cpu=4, max_num_seqs=2)
    for rid, name, lora_id in [("a1", "a", 1), ("b1", "b", 2), ("c1", "c", 3), ("a2", "a", 1), ("a3", "a", 1)]:
        engine.apply(add(rid, 5, lora_request=wire(name, lora_id)))
    engine.step()
    assert set(engine.scheduler.running) == {"a1", "a2"}
    assert [r.request_id for r in engine.scheduler.waiting.requests()] == ["b1", "c1", "a3"]


@pytest.mark.parametrize(
    "argv,env,words",
    [
        (["--max-loras", "4", "--max-cpu-loras", "2"], {}, "argument --max-cpu-loras: max_cpu_loras (2) must be >= max_loras (4)"),
        (["--max-loras", "0"], {}, "--max-loras"),
        ([], {"GMOCK_MAX_LORA_RANK": "x"}, "--max-lora-rank"),
        (["--lora-load-ms", "-1"], {}, "--lora-load-ms"),
    ],
)
def test_bad_lora_options_stop_at_start_naming_the_flag(argv, env, words):
    from gmock_engine.config.loader import ConfigError, parse_config

    with pytest.raises(ConfigError) as info:
        parse_config(argv, env)
    assert words in str(info.value)


def test_lora_options_parse_with_vllms_defaults():
    from gmock_engine.config.loader import parse_config

    args = parse_config(["--enable-lora", "--max-loras", "3"], {})
    assert args.enable_lora and args.max_loras == 3 and args.max_cpu_loras is None and args.max_lora_rank == 16
    assert args.lora_check_adapter_dir and args.lora_load_ms == 0.0
