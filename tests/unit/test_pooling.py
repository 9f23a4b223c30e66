"""Pooling requests (content/pooling.py, docs/protocol.md §3.7): PoolingParams of every
era, the pooled tensors (shape, norm, determinism, Matryoshka cut), their wire
form, and the engine's one output per pooling request (no tokens, STOP, at the
prefill's end, KV and prefix cache as a prefill); a bad request gets an ERROR
and the engine keeps serving."""

import array
import json
import math

import msgpack
import pytest

from gmock_engine.content import pooling
from gmock_engine.timing.latency import LatencyModel
from gmock_engine.content.pooling import PoolingSettings, decode_params, pooled
from gmock_engine.tools import model_dir
from gmock_engine.wire.inputs import EngineCoreRequest
from gmock_engine.wire.outputs import pack
from gmock_engine.wire.types import BadValue, FinishReason
from engine_steps import Clock, TickClock, engine_with, outputs_of, run, run_due

SETTINGS = PoolingSettings(embedding_dim=32, num_labels=3)
ALL = ("generate", "embed", "classify", "token_embed", "token_classify", "score", "encode", "plugin")


def params_0_32(task="embed", use_activation=True, dimensions=None):
    """What vllm 0.32's frontend sends (observed: §3.7)."""
    return [use_activation, dimensions, None, None, task, False, task.startswith("token_"), None, None, 2]


def floats(data):
    return list(array.array("f", data))


def norm(values):
    return math.sqrt(sum(v * v for v in values))


# -- PoolingParams of every era ------------------------------------------------------------


@pytest.mark.parametrize(
    "raw, expected",
    [
        (params_0_32(), ("embed", "embed", None, True)),
        (params_0_32(dimensions=8, use_activation=False), ("embed", "embed", 8, False)),
        (params_0_32("classify"), ("classify", "classify", None, True)),
        # 0.17: no late_interaction_params
        ([None, 4, None, None, "token_embed", False, True, None, 2], ("token_embed", "token_embed", 4, True)),
        # 0.16: truncate_prompt_tokens first, use_activation second
        ([None, False, 16, None, None, "embed", False, False, None, 2], ("embed", "embed", 16, False)),
        # 0.11.1-0.15: normalize at 2, use_activation at 5 overrides it
        ([None, None, False, None, None, None, None, None, "embed", False, False, None, 2], ("embed", "embed", None, False)),
        ([None, None, False, None, None, True, None, None, "embed", False, False, None, 2], ("embed", "embed", None, True)),
        # 0.11.0: task at 7; softmax false for score (a cross-encoder's classify)
        ([None, None, None, None, False, None, None, "score", False, None, 2], ("score", "classify", None, False)),
        ([None, 5, None, None, None, None, None, "encode", False, None, 2], ("encode", "token_embed", 5, True)),
    ],
)
def test_pooling_params_of_each_era_are_read_by_the_task_position(raw, expected):
    p = decode_params(raw, ALL, SETTINGS)
    assert (p.task, p.kind, p.dimensions, p.activation) == expected


@pytest.mark.parametrize(
    "raw, supported, message",
    [
        (params_0_32("token_embed"), ("embed",), r"Unsupported task: 'token_embed' Supported tasks: \['embed'\]"),
        (params_0_32("embed"), ("generate",), r"Unsupported task: 'embed' Supported tasks: \[\]"),
        (params_0_32("fly"), ALL + ("fly",), r"Unsupported task: 'fly'"),
        (params_0_32("plugin"), ALL, r"'plugin' is not modelled"),
        (params_0_32(dimensions=33), ALL, r"dimensions in range \[1, 32\], got 33"),
        (params_0_32(dimensions=0), ALL, r"dimensions in range \[1, 32\], got 0"),
        (params_0_32(dimensions="8"), ALL, r"names no task"),
        (params_0_32(dimensions=1.5), ALL, r"dimensions in range \[1, 32\], got 1.5"),
        (params_0_32("classify", dimensions=2), ALL, r"Task 'classify' does not support the dimensions"),
        (params_0_32(use_activation=1), ALL, r"use_activation 1 is not a bool"),
        ([True, None, None, None, None, False], ALL, r"names no task"),
        ([True, None, "embed", None, None], ALL, r"names no task"),  # a string where no era has task
        ({"task": "embed"}, ALL, r"pooling_params is dict, not a PoolingParams array"),
    ],
)
def test_a_pooling_request_the_engine_cannot_serve_is_refused_with_a_reason(raw, supported, message):
    with pytest.raises(BadValue, match=message):
        decode_params(raw, supported, SETTINGS)


# -- the tensors -----------------------------------------------------------------------------


def embed(ids, dimensions=None, activation=True, seed=0, settings=SETTINGS, task="embed"):
    p = decode_params(params_0_32(task, activation, dimensions), ALL, settings)
    return pooled(p, ids, len(ids), seed, settings)


def test_an_embedding_is_float32_of_the_configured_size_normalized_and_the_same_for_the_same_prompt():
    shape, data = embed([5, 6, 7])
    assert shape == (32,) and len(data) == 32 * 4
    values = floats(data)
    assert abs(norm(values) - 1.0) < 1e-6
    assert embed([5, 6, 7]) == (shape, data)
    assert embed([5, 6, 8])[1] != data and embed([5, 6, 7], seed=1)[1] != data
    assert len(set(values)) == 32  # not a constant vector


def test_dimensions_keep_the_first_values_then_normalize_and_no_activation_leaves_them_raw():
    raw = floats(embed([9, 9], activation=False)[1])
    assert norm(raw) > 1.5 and all(-1.0 <= v < 1.0 for v in raw)
    shape, data = embed([9, 9], dimensions=8)
    cut = floats(data)
    assert shape == (8,) and abs(norm(cut) - 1.0) < 1e-6
    scale = norm(raw[:8])
    assert cut == pytest.approx([v / scale for v in raw[:8]], rel=1e-5)


def test_classify_is_a_softmax_over_the_labels_and_token_tasks_have_a_row_per_prompt_token():
    shape, data = embed([1, 2, 3, 4], task="classify")
    probs = floats(data)
    assert shape == (3,) and abs(sum(probs) - 1.0) < 1e-6 and all(p > 0 for p in probs)
    shape, data = embed([1, 2, 3, 4], task="token_embed", dimensions=4)
    rows = floats(data)
    assert shape == (4, 4) and all(abs(norm(rows[i * 4 : i * 4 + 4]) - 1.0) < 1e-6 for i in range(4))
    # row i depends on the first i+1 ids only: a shared prefix gives the same rows
    other = floats(embed([1, 2, 9], task="token_embed", dimensions=4)[1])
    assert other[:8] == rows[:8] and other[8:] != rows[8:12]
    # and on every earlier id: the same id after another prefix gives another row
    assert floats(embed([7, 2], task="token_embed", dimensions=4)[1])[4:] != rows[4:8]
    shape, data = embed([1, 2], task="token_classify")
    assert shape == (2, 3) and abs(sum(floats(data)[:3]) - 1.0) < 1e-6


def test_a_too_large_token_output_is_refused_instead_of_built():
    p = decode_params(params_0_32("token_embed"), ALL, SETTINGS)
    with pytest.raises(BadValue, match="larger than the mock builds"):
        pooled(p, None, pooling.MAX_POOLING_VALUES, 0, SETTINGS)


def test_the_tensor_is_vllms_float32_array_with_its_bytes_inline():
    shape, data = embed([1, 2, 3])
    tensor = pooling.tensor(shape, data)
    decoded = msgpack.unpackb(pack(tensor), raw=False)
    assert decoded[0] == "float32" and decoded[1] == [32]
    assert isinstance(decoded[2], msgpack.ExtType) and decoded[2].code == 3 and decoded[2].data == data


def test_the_embedding_size_comes_from_the_flag_else_the_model_dirs_config(tmp_path):
    dest = model_dir.write_model_dir(tmp_path / "m", vocab_size=1000, embedding_dim=48)
    config = json.loads((dest / "config.json").read_text())
    assert config["hidden_size"] == 48 and config["is_matryoshka"] is True and "id2label" not in config
    labelled = model_dir.small_files(1000, 4096, 48, 3)["config.json"]
    assert labelled["id2label"] == {"0": "LABEL_0", "1": "LABEL_1", "2": "LABEL_2"}
    assert model_dir.is_current(dest, vocab_size=1000, embedding_dim=48) and not model_dir.is_current(dest, vocab_size=1000)
    assert pooling.settings_from(0, 2, str(dest)) == PoolingSettings(48, 2)
    assert pooling.settings_from(100, 5, str(dest)) == PoolingSettings(100, 5)
    assert pooling.settings_from(0, 2, None).embedding_dim == pooling.DEFAULT_EMBEDDING_DIM
    assert pooling.settings_from(0, 2, str(tmp_path / "none")).embedding_dim == pooling.DEFAULT_EMBEDDING_DIM


# -- the engine ------------------------------------------------------------------------------


def pooling_add(rid, ids, raw=None, client=0):
    return EngineCoreRequest(rid, len(ids), None, False, client_index=client, prompt_token_ids=list(ids),
                             pooling_params=raw if raw is not None else params_0_32())  # fmt: skip


def test_a_pooling_request_gets_one_output_with_its_tensor_no_tokens_and_finish_stop():
    engine = engine_with(TickClock(), supported_tasks=("embed",), pooling=SETTINGS)
    assert engine.apply(pooling_add("e-1", [4, 5, 6])) == []
    sent = run(engine)
    (out,) = outputs_of(sent, "e-1")
    assert out[0] == "e-1" and out[1] == [] and out[5] == FinishReason.STOP
    assert out[4][0] == "float32" and out[4][1] == [32] and out[4][2].data == embed([4, 5, 6])[1]
    assert out[7][0]["type"] == 1  # QUEUED: the first output's events
    stats = out[11]  # PrefillStats (0.33 layout): every prompt token computed
    assert stats["num_prompt_tokens"] == 3 and stats["num_computed_tokens"] == 3
    assert [r for _, m in sent if len(m) > 5 and m[5] for r in m[5]] == ["e-1"]
    assert engine.num_active == 0 and engine.counters["tokens"] == 0
    assert engine.kv.usage == 0.0


def test_the_same_prompt_gets_the_same_vector_on_every_rank_and_request_id():
    vectors = []
    for rank, rid in ((0, "a"), (1, "b")):
        engine = engine_with(TickClock(), rank=rank, supported_tasks=("embed",), pooling=SETTINGS)
        engine.apply(pooling_add(rid, [7, 8, 9]))
        (out,) = outputs_of(run(engine), rid)
        vectors.append(out[4][2].data)
    assert vectors[0] == vectors[1]


def test_a_bad_pooling_request_is_answered_with_an_error_and_the_engine_keeps_serving():
    engine = engine_with(TickClock(), supported_tasks=("embed",), pooling=SETTINGS)
    sent = engine.apply(pooling_add("bad", [1], params_0_32("classify")))
    sent += engine.apply(pooling_add("dims", [1], params_0_32(dimensions=999)))
    sent += engine.apply(pooling_add("good", [1, 2]))
    sent += run(engine)
    for rid, words in (("bad", "Unsupported task: 'classify'"), ("dims", "dimensions in range [1, 32], got 999")):
        (out,) = outputs_of(sent, rid)
        assert out[5] == FinishReason.ERROR and words in out[18]["message"] and out[4] is None
    (good,) = outputs_of(sent, "good")
    assert good[5] == FinishReason.STOP and good[4][1] == [32]


def test_a_pooling_request_ends_when_its_prefill_does_as_a_generating_one_gets_its_first_token():
    latency = LatencyModel(ttft_ms=40.0, prefill_ms_per_token=1.0, itl_ms=10.0)
    times = []
    for request in (pooling_add("p", list(range(20))),
                    EngineCoreRequest("g", 20, 5, True, prompt_token_ids=list(range(20)))):  # fmt: skip
        engine = engine_with(Clock(100.0), supported_tasks=("generate", "embed"), latency=latency)
        engine.apply(request)
        sent = run_due(engine)
        first = next(m for _, m in sent if any(o[0] == request.request_id for o in m[1]))
        times.append(first[3])
    assert times[0] == times[1] and times[0] > 100.0 + 0.04


def test_a_pooling_prompt_fills_the_prefix_cache_as_a_prefill_does():
    engine = engine_with(TickClock(), supported_tasks=("embed",), pooling=SETTINGS, prefix_caching=True, block_size=4)
    engine.apply(pooling_add("first", list(range(12))))
    run(engine)
    engine.apply(pooling_add("again", list(range(12))))
    (out,) = outputs_of(run(engine), "again")
    assert out[11]["num_cached_tokens"] > 0 and out[5] == FinishReason.STOP


# -- ./run.sh serve --task embed -------------------------------------------------------------


@pytest.fixture
def serve_env(tmp_path):
    return {"GMOCK_FRONTENDS_HOME": str(tmp_path / "home")}


def test_serve_task_embed_starts_the_python_frontend_as_a_pooling_runner_and_the_engine_with_embed(serve_env):
    from gmock_engine.config import loader as cfg
    from gmock_engine.tools import serve

    p = serve.plan(["--port", "0", "--task", "embed", "--vocab-size", "1000", "--max-model-len", "4096"], serve_env)
    assert p.options.frontend == "python" and p.embedding_dim == pooling.DEFAULT_EMBEDDING_DIM
    assert p.model.name == "mock-vocab1000-len4096-pooling-d64-l2"
    assert p.frontend_extra[:4] == ["--runner", "pooling", "--convert", "embed"]
    model_dir.ensure_model_dir(p.model, vocab_size=1000, max_model_len=4096, embedding_dim=p.embedding_dim, num_labels=p.num_labels)
    engine = cfg.parse_config(p.engine_argv, serve_env)  # what `python -m gmock_engine` parses
    assert engine.supported_tasks == ("embed",) and engine.tokenizer == str(p.model)
    # the engine's vectors take the model dir's hidden size
    assert pooling.settings_from(engine.embedding_dim, engine.num_labels, engine.tokenizer).embedding_dim == 64
    p = serve.plan(["--port", "0", "--task", "embed", "--embedding-dim", "384", "--supported-tasks", "embed,generate"], serve_env)
    assert p.embedding_dim == 384 and p.model.name.endswith("-d384-l2") and p.engine_argv.count("--supported-tasks") == 1
    p = serve.plan(["--port", "0", "--task", "classify", "--num-labels", "3"], serve_env)
    assert p.frontend_extra == ["--runner", "pooling", "--convert", "classify"] and p.num_labels == 3
    at = p.engine_argv.index("--supported-tasks")
    assert p.engine_argv[at : at + 2] == ["--supported-tasks", "classify"]
    assert serve.plan(["--port", "0"], serve_env).frontend_extra == []


def test_serve_task_embed_with_vllm_rs_is_refused_naming_why(serve_env):
    from gmock_engine.config import loader as cfg
    from gmock_engine.tools import serve

    with pytest.raises(cfg.ConfigError, match=r"argument --task: embed needs --frontend python \(vllm-rs .* 404 on /v1/embeddings"):
        serve.plan(["--port", "0", "--task", "embed", "--frontend", "rust"], serve_env)
