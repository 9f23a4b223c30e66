"""What structured outputs cost the engine, in process (docs/structured-outputs.md).

With a model dir's tokenizer (the e2e one by default: 32000 tokens), for a
few constraints: the first compile (llguidance, then cached), the mean
answer length and the CPU µs per generated answer token (200 answers each);
then 400 ADDs of plain requests and of requests with a JSON schema through
one EngineCore (`tests/engine_steps.engine_with`), run to their ends: the
µs per ADD (where a structured answer is generated) and per token of the
steps (where it is only emitted). Every figure is wall time on whatever the
machine is doing: run it twice.

    .venv/bin/python benchmarks/structured_outputs.py [--model DIR]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from engine_steps import engine_with, run  # noqa: E402

from gmock_engine.content import structured_output  # noqa: E402
from gmock_engine.content.tokenizer import load_tokenizer  # noqa: E402
from gmock_engine.wire.inputs import EngineCoreRequest, StructuredOutputsParams  # noqa: E402

ADDRESS = {"type": "object", "properties": {"street": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["zip"]}
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 30},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
        "home": {"$ref": "#/$defs/address"},
    },
    "required": ["name", "age", "role", "home"],
    "$defs": {"address": ADDRESS},
}
TOOL = {
    "type": "structural_tag",
    "format": {
        "type": "tags_with_separator",
        "tags": [
            {
                "type": "tag",
                "begin": '<tool_call>{"name": "get_weather", "arguments": ',
                "content": {"type": "json_schema", "json_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
                "end": "}</tool_call>",
            }
        ],
        "separator": "",
        "at_least_one": True,
        "stop_after_first": True,
    },
}
CONSTRAINTS = [
    ("JSON schema: 5 properties, $ref, enum, array, pattern", StructuredOutputsParams("json", json.dumps(PERSON))),
    ("json_object", StructuredOutputsParams("json_object", "")),
    ("regex [a-z]+@[a-z]+\\.com", StructuredOutputsParams("regex", r"[a-z]+@[a-z]+\.com")),
    ("choice of 3", StructuredOutputsParams("choice", json.dumps(["yes", "no", "maybe"]))),
    ("tool call (structural tag, strict)", StructuredOutputsParams("structural_tag", json.dumps(TOOL))),
]
REQUESTS = 400


def engine_run(model: str, eos: int, structured: bool) -> "tuple[float, float, float]":
    """(µs per ADD, µs per token of the steps, tokens per request) for REQUESTS requests."""
    engine = engine_with(vocab_size=load_tokenizer(model).vocab_size, tokenizer=model)
    extra = {"structured_outputs": CONSTRAINTS[0][1]} if structured else {}
    requests = [EngineCoreRequest(f"r{i}", 16, 60, True, eos_token_id=eos, all_stop_token_ids=(eos,), **extra) for i in range(REQUESTS)]
    start = time.perf_counter()
    for request in requests:
        engine.apply(request)
    added = time.perf_counter()
    sent = run(engine)
    done = time.perf_counter()
    tokens = sum(len(output[1]) for _, message in sent for output in message[1])
    return (added - start) / REQUESTS * 1e6, (done - added) / tokens * 1e6, tokens / REQUESTS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    home = os.environ.get("GMOCK_FRONTENDS_HOME", os.path.expanduser("~/.cache/gmock-frontends"))
    found = sorted(glob.glob(os.path.join(home, "models", "*")))
    parser.add_argument("--model", default=found[0] if found else None, help="a model dir or tokenizer.json (default: the e2e model dir)")
    args = parser.parse_args()
    if args.model is None:
        parser.error("no model dir found: give --model")
    tokenizer = load_tokenizer(args.model)
    start = time.perf_counter()
    generator = structured_output.for_tokenizer(tokenizer)
    print(f"llguidance tokenizer: {1e3 * (time.perf_counter() - start):.0f} ms ({tokenizer.vocab_size} tokens)")
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    print("| Constraint | first compile | answer (tokens) | per answer token |")
    print("| --- | --- | --- | --- |")
    for name, params in CONSTRAINTS:
        start = time.perf_counter()
        generator.matcher(params)
        compile_ms = 1e3 * (time.perf_counter() - start)
        tokens, spent = 0, 0.0
        for seed in range(200):
            start = time.perf_counter()
            tokens += len(generator.generate(params, seed, 1000, eos).token_ids)
            spent += time.perf_counter() - start
        print(f"| {name} | {compile_ms:.1f} ms | {tokens / 200:.0f} | {1e6 * spent / tokens:.0f} µs |")
    for label, structured in (("plain", False), ("JSON schema", True)) * 2:
        add_us, token_us, length = engine_run(args.model, eos, structured)
        print(f"engine, {label}: {add_us:.0f} µs per ADD, {token_us:.2f} µs per token in the steps, {length:.1f} tokens a request")


if __name__ == "__main__":
    main()
