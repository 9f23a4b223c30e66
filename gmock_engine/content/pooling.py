"""Pooling requests (§3.7): what an ADD with `pooling_params` (and nil
`sampling_params`) gets from a pooling model, pure.

vLLM's engine core runs such a request's prefill and nothing else: the
scheduler reserves no slot for a sampled token, the model runner's pooler
turns the prompt's hidden states into one tensor, and the request ends
FINISHED_STOPPED in the step its prefill completes, with that tensor as
`pooling_output` and no tokens. Here the tensor is made at ADD from the
prompt's token ids (a seeded hash, so the same prompt always gets the same
vector, on every rank), in float32, shaped by the task:

  embed                                [D]          L2-normalized by default
  token_embed (0.11.0: encode)         [n, D]       each row normalized
  classify (to 0.19 also score)        [L]          softmax by default
  token_classify                       [n, L]       softmax per row

D is `--embedding-dim` (or `dimensions`, Matryoshka: the first `dimensions`
of the D values, normalized after the cut, as vLLM's pooler does), L is
`--num-labels`, n the prompt's length. `use_activation` false (before 0.16:
`normalize` / `softmax` / `activation` false) leaves the raw values.

A request the mock cannot serve (no task, a task not in --supported-tasks,
a bad `dimensions`) raises BadValue, which the engine answers with an ERROR
for that request only, in the words vLLM's engine core would use.
"""

from __future__ import annotations

import array
import hashlib
import json
import math
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from gmock_engine.wire.inputs import EngineCoreRequest
from gmock_engine.wire.outputs import engine_core_output, ndarray
from gmock_engine.wire.types import BadValue, FinishReason

#: A pooling task as the eras name it -> the output it gets (§3.7): 0.11.0's
#: "encode" is token_embed's ancestor, "score" (to 0.19) a cross-encoder's
#: classify output.
TASK_KINDS: Dict[str, str] = {
    "embed": "embed",
    "classify": "classify",
    "token_embed": "token_embed",
    "token_classify": "token_classify",
    "encode": "token_embed",
    "score": "classify",
}
#: Pooling tasks vLLM knows whose output the mock does not model.
UNMODELLED_TASKS = ("plugin", "embed&token_classify")
#: Every pooling task name of any era: which of --supported-tasks are pooling ones.
POOLING_TASKS = (*TASK_KINDS, *UNMODELLED_TASKS)

#: PoolingParams fields in wire order (an array_like msgspec Struct, §3.7),
#: by the position of `task`, the one string field, which tells the eras
#: apart: 0.17+ (late_interaction_params from 0.18 comes after task),
#: 0.16, 0.11.0, 0.11.1–0.15.
_FIELDS_BY_TASK_POSITION: Dict[int, Tuple[str, ...]] = {
    4: ("use_activation", "dimensions", "step_tag_id", "returned_token_ids", "task"),
    5: ("truncate_prompt_tokens", "use_activation", "dimensions", "step_tag_id", "returned_token_ids", "task"),
    7: ("truncate_prompt_tokens", "dimensions", "normalize", "activation", "softmax", "step_tag_id",
        "returned_token_ids", "task"),
    8: ("truncate_prompt_tokens", "dimensions", "normalize", "softmax", "activation", "use_activation",
        "step_tag_id", "returned_token_ids", "task"),
}  # fmt: skip
#: The activation switches of the older eras, by output kind; use_activation overrides them all.
_ACTIVATION_FIELDS = {"embed": ("normalize",), "token_embed": ("normalize",), "classify": ("softmax", "activation"),
                      "token_classify": ("softmax", "activation")}  # fmt: skip

#: --embedding-dim's default when neither it nor the model dir names a size
#: (the model dir's decoder has hidden_size 64).
DEFAULT_EMBEDDING_DIM = 64
#: The most values one pooling output may hold (a token_embed of a long
#: prompt): above it the request is refused rather than built.
MAX_POOLING_VALUES = 1 << 24


@dataclass(frozen=True)
class PoolingSettings:
    """--embedding-dim and --num-labels: the sizes of the pooled tensors."""

    embedding_dim: int = DEFAULT_EMBEDDING_DIM
    num_labels: int = 2


@dataclass(frozen=True)
class PoolingParams:
    """A request's PoolingParams as the mock uses them (§3.7): the task as
    sent, the output it gets (`kind`), the Matryoshka size (None: all D)
    and whether to normalize / softmax."""

    task: str
    kind: str
    dimensions: Optional[int]
    activation: bool


def settings_from(embedding_dim: int, num_labels: int, tokenizer: Optional[str]) -> PoolingSettings:
    """--embedding-dim (0: the hidden_size in the --tokenizer dir's
    config.json, else DEFAULT_EMBEDDING_DIM) and --num-labels."""
    return PoolingSettings(embedding_dim or model_hidden_size(tokenizer) or DEFAULT_EMBEDDING_DIM, num_labels)


def model_hidden_size(model_dir: Optional[str]) -> Optional[int]:
    """`hidden_size` (or `embedding_size`, which vLLM prefers) of a model
    dir's config.json; None when there is none to read."""
    if not model_dir:
        return None
    try:
        with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    size = config.get("embedding_size") or config.get("hidden_size") if isinstance(config, dict) else None
    return size if type(size) is int and size > 0 else None


def _cut(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def decode_params(raw: Any, supported_tasks: Sequence[str], settings: PoolingSettings) -> PoolingParams:
    """The pooling_params array of an ADD (§3.7, any era) checked against
    what this engine serves; BadValue names what is wrong."""
    if type(raw) is not list:
        raise BadValue(f"pooling_params is {type(raw).__name__}, not a PoolingParams array")
    strings = [i for i, value in enumerate(raw) if type(value) is str]
    fields = _FIELDS_BY_TASK_POSITION.get(strings[0]) if len(strings) == 1 else None
    if fields is None:
        raise BadValue(f"pooling_params {_cut(raw)} names no task (one string at the task's position of an era)")
    values = dict(zip(fields, raw))
    task = values["task"]
    supported = [t for t in supported_tasks if t in POOLING_TASKS]
    if task not in supported:
        # vLLM's EngineCore.add_request, word for word
        raise BadValue(f"Unsupported task: {task!r} Supported tasks: {supported}")
    kind = TASK_KINDS.get(task)
    if kind is None:
        raise BadValue(f"pooling task {task!r} is not modelled by the mock engine (docs/embeddings.md)")
    dimensions = values.get("dimensions")
    if dimensions is not None:
        if kind not in ("embed", "token_embed"):
            raise BadValue(f"Task {task!r} does not support the dimensions parameter (got {_cut(dimensions)})")
        if type(dimensions) is not int or not 1 <= dimensions <= settings.embedding_dim:
            raise BadValue(f"Model only supports dimensions in range [1, {settings.embedding_dim}], got {_cut(dimensions)}.")
    switches = [values.get(name) for name in ("use_activation", *_ACTIVATION_FIELDS[kind])]
    for name, value in zip(("use_activation", *_ACTIVATION_FIELDS[kind]), switches):
        if value is not None and type(value) is not bool:
            raise BadValue(f"pooling_params.{name} {_cut(value)} is not a bool or nil")
    activation = next((value for value in switches if value is not None), True)
    return PoolingParams(task, kind, dimensions, activation)


def _row_values(key: bytes, size: int) -> List[float]:
    """`size` values in [-1, 1) from `key`: shake_128's stream as uint32s."""
    words = array.array("I", hashlib.shake_128(key).digest(4 * size))
    return [w * (2.0 / 4294967296.0) - 1.0 for w in words]


def _activate(values: List[float], kind: str) -> List[float]:
    if kind in ("embed", "token_embed"):
        norm = math.sqrt(math.fsum(v * v for v in values)) or 1.0
        return [v / norm for v in values]
    top = max(values)
    exps = [math.exp(v - top) for v in values]
    total = math.fsum(exps)
    return [e / total for e in exps]


def pooled(params: PoolingParams, prompt_token_ids: Optional[Sequence[int]], prompt_len: int, seed: int,
           settings: PoolingSettings) -> Tuple[Tuple[int, ...], bytes]:
    """The pooled tensor of a prompt: (shape, little-endian float32 bytes).
    Deterministic in (seed, task kind, the prompt's ids); the same for every
    rank and request id. BadValue when it would be larger than MAX_POOLING_VALUES."""
    kind = params.kind
    width = settings.embedding_dim if kind in ("embed", "token_embed") else settings.num_labels
    keep = params.dimensions or width
    ids = prompt_token_ids if prompt_token_ids is not None else ()
    head = f"gmock-pooling\0{seed}\0{kind}\0{width}\0".encode()
    per_token = kind.startswith("token_")
    rows = (len(ids) or prompt_len) if per_token else 1
    if rows * keep > MAX_POOLING_VALUES:
        raise BadValue(f"a {kind} output of {rows} x {keep} values is larger than the mock builds ({MAX_POOLING_VALUES})")
    state = hashlib.blake2b(head, digest_size=16)
    keys: List[bytes] = []
    if per_token:
        # row i from the prompt's first i+1 ids: a shared prefix gives the same rows
        for position in range(rows):
            state.update((ids[position] if position < len(ids) else 0).to_bytes(4, "little"))
            keys.append(state.digest())
    else:
        state.update(array.array("I", ids).tobytes() if ids else prompt_len.to_bytes(4, "little"))
        keys.append(state.digest())
    out = array.array("f")
    for key in keys:
        values = _row_values(key, width)[:keep]
        out.extend(_activate(values, kind) if params.activation else values)
    if out.itemsize != 4:  # pragma: no cover - every platform CPython runs on has 4-byte floats
        raise RuntimeError("array('f') is not float32 here")
    if array.array("I", [1]).tobytes()[0] != 1:  # pragma: no cover - big-endian host
        out.byteswap()
    shape = (rows, keep) if per_token else (keep,)
    return shape, out.tobytes()


def tensor(shape: Sequence[int], data: bytes) -> List[Any]:
    """A float32 torch.Tensor as vLLM's MsgpackEncoder sends it (§3.7):
    `["float32", shape, ext 3 raw bytes]`, inline whatever its size (vLLM
    moves one of 256 bytes or more to an extra frame; its decoder takes either)."""
    return ndarray("float32", shape, data)


def request_tensor(request: EngineCoreRequest, settings: Any) -> List[Any]:
    """The pooled tensor of a pooling ADD (§3.7), made now from its prompt;
    BadValue for a request the engine cannot serve. `settings`: the
    EngineSettings."""
    params = decode_params(request.pooling_params, settings.supported_tasks, settings.pooling)
    shape, data = pooled(params, request.prompt_token_ids, request.prompt_len, settings.seed, settings.pooling)
    return tensor(shape, data)


def final_output(request: Any, prefill_stats: Dict[str, Any], layout: Any) -> List[Any]:
    """A pooling request's one EngineCoreOutput (§3.7): no tokens, the
    pooled tensor, finish STOP, with its events and prefill stats."""
    events, request.pending_events = request.pending_events, None
    return engine_core_output(request.request_id, [], FinishReason.STOP, layout=layout, events=events,
                              prefill_stats=prefill_stats, pooling_output=request.pooling)  # fmt: skip
