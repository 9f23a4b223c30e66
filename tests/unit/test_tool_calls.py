"""Constraints as the real frontends send them (tests/data/frontend_constraints.json,
captured from vllm serve 0.32 and vllm-rs 0.33 with --tool-call-parser hermes, with
and without --reasoning-parser qwen3): tool calls whose arguments follow each tool's
schema, constraints behind a think block, limits that end a request with an error
naming them (content/tool_calls.py, content/structural_tag.py, content/structured_output.py, content/answer.py)."""

import json
import re
from pathlib import Path

import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from gmock_engine.content import answer as content, structural_tag, structured_output, tool_calls  # noqa: E402
from gmock_engine.content.tokenizer import load_tokenizer  # noqa: E402
from gmock_engine.wire.inputs import EngineCoreRequest, StructuredOutputsParams  # noqa: E402
from gmock_engine.wire.types import FinishReason  # noqa: E402
from engine_steps import engine_with, marked_model_dir, outputs_of, run, tokens_of  # noqa: E402

VOCAB = 4000
EOS = VOCAB - 1
CAPTURED = json.loads((Path(__file__).parent.parent / "data" / "frontend_constraints.json").read_text())
TOOLS = CAPTURED["tools"]  # "plain" (no strict field) and "strict" (strict: true)
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS["plain"]}
FRONTENDS = sorted(CAPTURED["captures"])  # python-plain, python-reasoning, rust-plain, rust-reasoning
TOOL_CASES = [f"{kind}-{choice}" for kind in ("plain", "strict") for choice in ("required", "required-noparallel", "named")]
#: hermes calls as both frontends' parsers find them, and nothing else
CALLS = re.compile(r"(?:<tool_call>\n?(.*?)\n?</tool_call>)", re.S)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """The generated model dir, with the markers as added tokens (not special, as Qwen's)."""
    return marked_model_dir(tmp_path_factory.mktemp("model"), VOCAB)


@pytest.fixture(scope="module")
def tokenizer(model):
    return load_tokenizer(str(model))


def chat_prompt(tokenizer, tools):
    """A prompt as Qwen2.5's chat template renders one with tools."""
    lines = "\n".join(json.dumps(t) for t in tools)
    system = (
        "<|im_start|>system\n\n# Tools\n\nYou are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{lines}\n</tools>\n\nFor each function call, return a json object with function name and arguments "
        'within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
        "</tool_call><|im_end|>\n"
    )
    return tokenizer.encode(f"{system}<|im_start|>user\nBook a table<|im_end|>\n<|im_start|>assistant\n")


def params_of(captured):
    """StructuredOutputsParams of one captured map, as wire/inputs.py decodes it."""
    kind = next(k for k in ("json", "json_object", "regex", "choice", "grammar", "structural_tag") if k in captured)
    spec = captured[kind]
    spec = "" if kind == "json_object" else spec if isinstance(spec, str) else json.dumps(spec)
    return StructuredOutputsParams(kind, spec)


def request(rid, prompt, params, max_tokens=400, **kw):
    return EngineCoreRequest(rid, len(prompt), max_tokens, True, prompt_token_ids=prompt, eos_token_id=EOS,
                             all_stop_token_ids=(EOS,), structured_outputs=params, **kw)  # fmt: skip


def answer_of(tokenizer, sent, rid):
    """(text before the EOS, finish reason) of one request."""
    tokens = tokens_of(sent, rid)
    finish = outputs_of(sent, rid)[-1][5]
    if finish == FinishReason.STOP:
        assert tokens[-1] == EOS
        tokens = tokens[:-1]
    return tokenizer.decode(tokens, skip_special_tokens=False), finish


def split_think(text):
    """(think text, the rest) of an answer that opens with a think block; the
    rest follows `</think>` at once (the grammar starts there)."""
    assert text.startswith("<think>\n"), text
    reasoning, rest = text.split("</think>", 1)
    return reasoning[len("<think>\n"):], rest


def check_calls(text, schemas):
    """The calls of an answer made of hermes calls only, each validated against its tool's schema."""
    assert CALLS.sub("", text) == "", text  # nothing outside the calls
    calls = [json.loads(body) for body in CALLS.findall(text)]
    assert calls, text
    for call in calls:
        assert set(call) == {"name", "arguments"}, call
        jsonschema.validate(call["arguments"], schemas[call["name"]])
    return calls


@pytest.mark.parametrize("frontend", FRONTENDS)
@pytest.mark.parametrize("case", TOOL_CASES)
def test_required_and_named_calls_follow_each_tools_schema(model, tokenizer, frontend, case):
    """What the frontend sends for tool_choice required / named (non-strict tools:
    arguments any JSON in the tag) answers calls whose arguments follow the schema the
    prompt shows; one call when parallel_tool_calls is false or the choice is named."""
    reasoning = frontend.endswith("reasoning")
    settings = content.ContentSettings(reasoning_rate=1.0 if reasoning else 0.0, reasoning_tokens=6)
    engine = engine_with(vocab_size=VOCAB, tokenizer=str(model), content=settings)
    prompt = chat_prompt(tokenizer, TOOLS[case.split("-")[0]])
    params = params_of(CAPTURED["captures"][frontend][case])
    for n in range(12):
        engine.apply(request(f"r{n}", prompt, params))
    sent = run(engine)
    counts = set()
    for n in range(12):
        text, finish = answer_of(tokenizer, sent, f"r{n}")
        assert finish == FinishReason.STOP, (text, finish)
        if reasoning:
            _, text = split_think(text)
        calls = check_calls(text, SCHEMAS)
        counts.add(len(calls))
        if case.endswith("named"):
            assert {c["name"] for c in calls} == {"book_table"}
    if case.endswith(("noparallel", "named")):
        assert counts == {1}
    else:
        assert max(counts) >= 1


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_auto_with_a_strict_tool_answers_calls_or_text_as_drawn(model, tokenizer, frontend):
    """tool_choice auto with a strict tool: a triggered tag; --tool-call-rate (and
    vllm_xargs mock_tool_call) decides, as without a constraint: calls that validate,
    or text without a trigger."""
    reasoning = frontend.endswith("reasoning")
    prompt = chat_prompt(tokenizer, TOOLS["strict"])
    params = params_of(CAPTURED["captures"][frontend]["strict-auto"])
    for rate in (1.0, 0.0):
        settings = content.ContentSettings(tool_call_rate=rate, reasoning_rate=1.0 if reasoning else 0.0, reasoning_tokens=4)
        engine = engine_with(vocab_size=VOCAB, tokenizer=str(model), content=settings)
        for n in range(6):
            engine.apply(request(f"a{n}", prompt, params))
        sent = run(engine)
        for n in range(6):
            text, finish = answer_of(tokenizer, sent, f"a{n}")
            assert finish == FinishReason.STOP, text
            if reasoning:
                _, text = split_think(text)
            if rate:
                check_calls(text, SCHEMAS)
            else:
                assert text and "<" not in text, text


def test_a_tag_whose_arguments_are_any_json_gets_the_prompts_schema():
    tag = CAPTURED["captures"]["rust-plain"]["plain-required"]
    params = params_of(tag)
    pinned = tool_calls.pin_arguments(params, SCHEMAS)
    tags = json.loads(pinned.spec)["format"]["tags"]
    assert [t["content"]["json_schema"] for t in tags] == [SCHEMAS[tool_calls.tool_of(t["begin"], SCHEMAS)] for t in tags]
    assert tool_calls.pin_arguments(params, {}) is params  # no tools in the prompt: as sent
    strict = params_of(CAPTURED["captures"]["rust-plain"]["strict-required"])
    assert tool_calls.pin_arguments(strict, SCHEMAS) is strict  # pinned by the frontend already


PLAIN_CASES = ["json_schema", "json_object", "regex", "choice", "grammar"]


@pytest.mark.parametrize("frontend", ["python-reasoning", "rust-reasoning"])
def test_with_reasoning_the_constraint_starts_after_the_think_block(model, tokenizer, frontend):
    """vllm serve sends the plain constraint, vllm-rs wraps it in a tag whose first
    element is an optional think block: either way the answer is a think block, then
    exactly the constrained answer (no `\\n\\n` before it)."""
    settings = content.ContentSettings(reasoning_rate=1.0, reasoning_tokens=8)
    engine = engine_with(vocab_size=VOCAB, tokenizer=str(model), content=settings)
    prompt = tokenizer.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    for case in PLAIN_CASES:
        engine.apply(request(case, prompt, params_of(CAPTURED["captures"][frontend][case])))
    sent = run(engine)
    book = json.loads(json.dumps(CAPTURED["tools"]["strict"][1]["function"]["parameters"]))
    for case in PLAIN_CASES:
        text, finish = answer_of(tokenizer, sent, case)
        assert finish == FinishReason.STOP, (case, text)
        reasoning, answer = split_think(text)
        assert reasoning.strip(), text
        if case == "json_schema":
            jsonschema.validate(json.loads(answer), book)
        elif case == "json_object":
            assert isinstance(json.loads(answer), dict)
        elif case == "regex":
            assert re.fullmatch("[0-9]{4}", answer), answer
        elif case == "choice":
            assert answer in ("a", "b"), answer
        else:
            assert answer == "xy", answer


def test_the_think_block_shrinks_so_the_constrained_answer_fits(model, tokenizer):
    settings = content.ContentSettings(reasoning_rate=1.0, reasoning_tokens=64)
    engine = engine_with(vocab_size=VOCAB, tokenizer=str(model), content=settings)
    prompt = tokenizer.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    engine.apply(request("c", prompt, StructuredOutputsParams("choice", json.dumps(["alpha", "beta"])), max_tokens=20))
    tight = len(content.markers(tokenizer).think_empty_bare) + len(tokenizer.encode("alpha")) + 1  # block, answer, EOS
    engine.apply(request("tiny", prompt, StructuredOutputsParams("choice", json.dumps(["alpha"])), max_tokens=tight))
    sent = run(engine)
    text, finish = answer_of(tokenizer, sent, "c")
    assert finish == FinishReason.STOP and len(tokens_of(sent, "c")) <= 20
    assert split_think(text)[1] in ("alpha", "beta"), text
    text, finish = answer_of(tokenizer, sent, "tiny")  # room for an empty block and the answer only
    assert finish == FinishReason.STOP and split_think(text) == ("\n", text.split("</think>")[1]), text


def error_of(engine, rid, prompt, params, **kw):
    """The error message of a request the engine answers with ERROR at once."""
    [(_, message)] = engine.apply(request(rid, prompt, params, **kw))
    output = message[1][0]
    assert output[5] == FinishReason.ERROR, output
    return output[18]["message"]


def test_constraints_past_a_limit_end_with_an_error_that_names_it(model, tokenizer):
    engine = engine_with(vocab_size=VOCAB, tokenizer=str(model))
    prompt = tokenizer.encode("hi")
    choice = StructuredOutputsParams("choice", json.dumps([f"item{i}" for i in range(12000)]))
    assert "--grammar-max-items" in error_of(engine, "choice", prompt, choice)
    five = StructuredOutputsParams("choice", json.dumps([f"item{i}" for i in range(5000)]))
    engine.apply(request("five", prompt, five))  # within the default, as xgrammar answers it
    text, finish = answer_of(tokenizer, run(engine), "five")
    assert finish == FinishReason.STOP and text in json.loads(five.spec), text
    chain = "start: r0\n" + "\n".join(f'r{i}: "x" r{i + 1}' for i in range(4999)) + '\nr4999: "end"'
    assert "--grammar-max-rules" in error_of(engine, "rules", prompt, StructuredOutputsParams("grammar", chain))
    wide = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(2000)}, "required": [f"p{i}" for i in range(2000)]}
    assert "--grammar-max-tokens" in error_of(engine, "wide", prompt, StructuredOutputsParams("json", json.dumps(wide)), max_tokens=30000)
    chain = {f"d{i}": {"type": "object", "properties": {"a": {"$ref": f"#/$defs/d{i + 1}"}}, "required": ["a"]} for i in range(3000)}
    chain["d3000"] = {"type": "integer"}  # (3000 levels through $refs: llguidance's stack overflows, the process dies)
    deep = StructuredOutputsParams("json", json.dumps({"$defs": chain, "$ref": "#/$defs/d0"}))
    assert "--grammar-max-depth" in error_of(engine, "deep", prompt, deep)
    listed = {"$defs": {"node": {"type": "object", "properties": {"v": {"type": "integer"}, "next": {"anyOf": [{"type": "null"}, {"$ref": "#/$defs/node"}]}},
                                 "required": ["v", "next"]}}, "$ref": "#/$defs/node"}  # fmt: skip
    engine.apply(request("recursive", prompt, StructuredOutputsParams("json", json.dumps(listed))))  # recursion is no depth
    text, finish = answer_of(tokenizer, run(engine), "recursive")
    assert finish == FinishReason.STOP, text
    jsonschema.validate(json.loads(text), listed)
    # raised limits: the same constraints are followed
    limits = structured_output.GrammarLimits(max_items=13000)
    engine = engine_with(vocab_size=VOCAB, tokenizer=str(model), content=content.ContentSettings(limits=limits))
    engine.apply(request("choice", prompt, choice))
    sent = run(engine)
    text, finish = answer_of(tokenizer, sent, "choice")
    assert finish == FinishReason.STOP and text in json.loads(choice.spec), text


@pytest.mark.parametrize("kind,spec", [("regex", r"[^\s\S]"), ("grammar", 'start: a\na: a "x"'), ("json", '{"$ref": "#"}')])
def test_an_empty_language_ends_with_an_error(model, tokenizer, kind, spec):
    engine = engine_with(vocab_size=VOCAB, tokenizer=str(model))
    assert "language is empty" in error_of(engine, "e", tokenizer.encode("hi"), StructuredOutputsParams(kind, spec))


def test_min_tokens_past_the_answers_end_is_an_error_as_in_vllm(model, tokenizer):
    engine = engine_with(vocab_size=VOCAB, tokenizer=str(model))
    prompt = tokenizer.encode("hi")
    params = StructuredOutputsParams("choice", json.dumps(["a", "b"]))
    assert "min_tokens" in error_of(engine, "m", prompt, params, min_tokens=5)
    engine.apply(request("ok", prompt, params, min_tokens=1))
    assert outputs_of(run(engine), "ok")[-1][5] == FinishReason.STOP


@pytest.mark.parametrize("node,named", [
    ({"type": "token", "token": 5}, "'token'"),
    ({"type": "dispatch", "rules": []}, "'dispatch'"),
    ({"type": "json_schema", "json_schema": {}, "style": "qwen_xml"}, "qwen_xml"),
    ({"type": "any_text", "excludes": ["<tool_call>"]}, "excludes"),
    ({"type": "tag", "begin": {"type": "token", "token": 7}, "content": {"type": "any_text"}, "end": "x"}, "'token'"),
])  # fmt: skip
def test_a_structural_tag_part_the_mock_cannot_keep_is_refused_by_name(model, tokenizer, node, named):
    with pytest.raises(ValueError, match=re.escape(named)):
        structural_tag.to_lark({"type": "structural_tag", "format": node})
    engine = engine_with(vocab_size=VOCAB, tokenizer=str(model))
    spec = json.dumps({"type": "structural_tag", "format": node})
    assert named in error_of(engine, "t", tokenizer.encode("hi"), StructuredOutputsParams("structural_tag", spec))


def test_optional_plus_star_and_repeat_translate(model, tokenizer):
    generator = structured_output.for_tokenizer(tokenizer)
    x = {"type": "const_string", "value": "x"}
    form = {"type": "sequence", "elements": [{"type": "optional", "content": {"type": "const_string", "value": "a"}},
                                             {"type": "plus", "content": x}, {"type": "star", "content": x},
                                             {"type": "repeat", "min": 2, "max": 3, "content": {"type": "const_string", "value": "y"}}]}  # fmt: skip
    params = StructuredOutputsParams("structural_tag", json.dumps({"type": "structural_tag", "format": form}))
    for seed in range(10):
        answer = generator.generate(params, seed, 100, None)
        assert answer.ended and re.fullmatch("a?x+y{2,3}", tokenizer.decode(list(answer.token_ids))), answer


def _any_of_schema(tools, parallel):
    """What vLLM's get_json_schema_from_tools builds for tool_choice required (the
    frontends' JSON-schema era, and parsers without a structural tag)."""
    schema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": [
        {"properties": {"name": {"type": "string", "enum": [t["function"]["name"]]}, "parameters": t["function"]["parameters"]},
         "required": ["name", "parameters"]} for t in tools]}}  # fmt: skip
    if not parallel:
        schema["maxItems"] = 1
    return schema


@pytest.mark.parametrize("parallel", [True, False])
def test_the_json_schema_form_of_required_gives_calls_that_validate(model, tokenizer, parallel):
    engine = engine_with(vocab_size=VOCAB, tokenizer=str(model))
    prompt = tokenizer.encode("hi")
    params = StructuredOutputsParams("json", json.dumps(_any_of_schema(TOOLS["strict"], parallel)))
    for n in range(10):
        engine.apply(request(f"j{n}", prompt, params))
    sent = run(engine)
    for n in range(10):
        text, finish = answer_of(tokenizer, sent, f"j{n}")
        calls = json.loads(text)
        assert finish == FinishReason.STOP and 1 <= len(calls) and (parallel or len(calls) == 1), text
        for call in calls:
            jsonschema.validate(call["parameters"], SCHEMAS[call["name"]])


def test_the_triggers_and_structures_form_gives_calls_that_validate(model, tokenizer):
    """The older structural tag (vLLM's guidance backend reads it): triggers and
    structures, free text with calls where a trigger starts one."""
    engine = engine_with(vocab_size=VOCAB, tokenizer=str(model))
    structures = [{"begin": f"<function={name}>", "schema": schema, "end": "</function>"} for name, schema in SCHEMAS.items()]
    params = StructuredOutputsParams("structural_tag", json.dumps({"triggers": ["<function="], "structures": structures}))
    for n in range(8):
        engine.apply(request(f"s{n}", tokenizer.encode("hi"), params))
    sent = run(engine)
    for n in range(8):
        text, finish = answer_of(tokenizer, sent, f"s{n}")
        calls = re.compile(r"<function=(\w+)>(.*?)</function>", re.S)
        for name, body in calls.findall(text):
            jsonschema.validate(json.loads(body), SCHEMAS[name])
        # free text around calls (the trigger form allows it), but no trigger outside a whole call
        assert finish == FinishReason.STOP and "<function=" not in calls.sub("", text), text
