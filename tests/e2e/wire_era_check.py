"""Run under one vLLM version (tests/e2e/test_wire_eras.py starts it with
that version's tree on PYTHONPATH): the real decoders read our frames, the
real encoder makes ADDs for ours to read.

stdin: JSON `{"outputs": [{"name", "frames": [hex, ...]}]}`, EngineCoreOutputs
messages made by gmock_engine for this version's layout. stdout: JSON with
`vllm_version`, `finish_reasons`, `default_max_tokens`, `decoded` (per
message name: what `MsgpackDecoder(EngineCoreOutputs)` made of it, or the
error it raised) and `adds` (frame 1 of an ADD per logical request of
tests/golden/generate.py, encoded by this version's `MsgpackEncoder`).

`--versions`: every version in one run. stdin: JSON `{"jobs": N, "versions":
[{"version", "tree", "outputs"}, ...]}`, started with only the shims on
PYTHONPATH; stdout: JSON `{version: the report above, or {"error": ...}}`.
The process imports the third-party packages every era's `vllm` imports
(torch, transformers, ...: 3-5 s of the 7-10 s an era's imports take on
2 cores) once, then forks one child per version (N at a time), which puts
that version's tree on sys.path and imports its `vllm` afresh: no two eras
ever share a `vllm` module (they register the same torch ops), and none
pays for torch again.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "golden"))

import generate  # noqa: E402  (the golden generator: builds requests with the version's classes)


def _values(value: Any) -> Any:
    """A decoded field as JSON: arrays and tensors as nested lists."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if hasattr(value, "tolist"):
        return value.tolist()
    if dataclasses.is_dataclass(value):
        return {f.name: _values(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if hasattr(value, "__struct_fields__"):
        return {name: _values(getattr(value, name)) for name in value.__struct_fields__}
    if isinstance(value, (set, frozenset)):
        return sorted(_values(v) for v in value)
    if isinstance(value, dict):
        return {str(k): _values(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_values(v) for v in value]
    return repr(value)


def _output(output: Any) -> Dict[str, Any]:
    fields = output.__struct_fields__
    decoded = {
        "request_id": output.request_id,
        "new_token_ids": list(output.new_token_ids),
        "finish_reason": None if output.finish_reason is None else output.finish_reason.name,
        "stop_reason": output.stop_reason,
        "events": [[int(e.type), e.timestamp] for e in output.events or ()],
        "new_logprobs": None if output.new_logprobs is None else [_values(v) for v in output.new_logprobs],
        "new_prompt_logprobs_tensors": None if output.new_prompt_logprobs_tensors is None
        else [_values(v) for v in output.new_prompt_logprobs_tensors],
    }
    for name in ("prefill_stats", "num_cached_tokens", "num_nans_in_logits"):
        if name in fields:
            decoded[name] = _values(getattr(output, name))
    return decoded


def check(task: Dict[str, Any]) -> Dict[str, Any]:
    """The report of the `vllm` on sys.path for `task` (see the module docstring)."""
    import vllm
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine import EngineCoreOutputs, EngineCoreRequest, FinishReason
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    decoder = MsgpackDecoder(EngineCoreOutputs)
    decoded = {}
    for message in task["outputs"]:
        try:
            outputs = decoder.decode([bytes.fromhex(f) for f in message["frames"]])
            decoded[message["name"]] = {
                "engine_index": outputs.engine_index,
                "timestamp": outputs.timestamp,
                "finished_requests": _values(outputs.finished_requests),
                "scheduler_stats": _values(outputs.scheduler_stats),
                "outputs": [_output(o) for o in outputs.outputs],
            }
        except Exception as exc:  # noqa: BLE001 - the error is the finding
            decoded[message["name"]] = {"error": f"{type(exc).__name__}: {exc}"}

    encoder = MsgpackEncoder()
    adds = []
    for spec in generate.REQUESTS:
        wanted = {k: v for k, v in spec.items() if k not in ("name", "sampling")}
        wanted["sampling_params"] = generate._sampling_params(spec["sampling"], spec.get("eos_token_id"))
        frames = encoder.encode(generate._build(EngineCoreRequest, wanted))
        adds.append({"name": spec["name"], "logical": spec, "frames": [bytes(f).hex() for f in frames]})

    return {
        "vllm_version": vllm.__version__,
        "finish_reasons": {r.name: int(r) for r in FinishReason},
        "default_max_tokens": SamplingParams().max_tokens,
        "decoded": decoded,
        "adds": adds,
    }


#: What every era's `vllm` imports from the 0.32 venv on the way to
#: vllm.v1.engine, slowest first (-X importtime of the 0.32 tree): imported
#: once before the forks. A package a venv lacks is skipped.
SHARED_PACKAGES = ("torch", "transformers", "openai", "triton", "aiohttp", "sympy", "numpy",
                   "msgspec", "pydantic", "zmq", "huggingface_hub", "tokenizers", "requests")  # fmt: skip


def check_versions(tasks: List[Dict[str, Any]], jobs: int) -> Dict[str, Any]:
    """{version: report or {"error": ...}}, one forked child per version."""
    for name in SHARED_PACKAGES:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    assert "vllm" not in sys.modules, "a shared package imported vllm: the eras would share it"
    out: Dict[str, Any] = {}
    running: Dict[int, tuple] = {}  # pid -> (version, result file)
    pending = list(tasks)
    while pending or running:
        while pending and len(running) < jobs:
            task = pending.pop(0)
            result = tempfile.NamedTemporaryFile(prefix=f"wire-era-{task['version']}-", suffix=".json", delete=False)
            result.close()
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:  # the child: this era's vllm, its report to the file
                code = 1
                try:
                    os.dup2(2, 1)  # whatever vLLM prints goes to stderr, never into the parent's JSON
                    sys.path.insert(2, task["tree"])  # after this dir and the shims (PYTHONPATH), before the venv
                    report = check(task)
                    with open(result.name, "w") as f:
                        json.dump(report, f)
                    code = 0
                except BaseException as exc:  # noqa: BLE001 - reported by the parent
                    with open(result.name, "w") as f:
                        json.dump({"error": f"{type(exc).__name__}: {exc}"}, f)
                finally:
                    sys.stdout.flush()
                    sys.stderr.flush()
                    os._exit(code)
            running[pid] = (task["version"], result.name)
        pid, status = os.wait()
        if pid not in running:
            continue  # a child of an imported package, not an era's
        version, path = running.pop(pid)
        try:
            with open(path) as f:
                out[version] = json.load(f)
        except (OSError, ValueError):
            out[version] = {"error": f"the child for {version} ended with wait status {status} and no report"}
        finally:
            os.unlink(path)
    return out


def main(argv: List[str]) -> int:
    """See the module docstring."""
    task = json.load(sys.stdin)
    if "--versions" in argv:
        result = check_versions(task["versions"], int(task.get("jobs", 2)))
    else:
        result = check(task)
    json.dump(result, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
