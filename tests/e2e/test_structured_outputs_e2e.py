"""Structured outputs through both real frontends (DP 1), with the official
`openai` client: the engine runs with `--tokenizer <the model dir>` and
answers each constraint the frontend sends (docs/structured-outputs.md).

What is checked is what a client parses: a `response_format` json_schema
answer (streaming and not) validates against its schema, a json_object one
is an object, a regex answer fullmatches, a choice is one of the choices, a
Lark grammar's answer parses, and `tool_choice` "required" or a named tool
gives tool calls whose arguments validate against the tool's parameters.
The frontends need a tool parser for tool_choice (`--tool-call-parser
hermes`, the parser of the ChatML model dir; vllm serve also
`--enable-auto-tool-choice`); the tools are `strict`, so
both frontends pin the arguments' schema (without it both send any JSON,
which the mock answers with an object). A constraint the frontends accept
and the engine cannot compile ends that request only.
"""

from __future__ import annotations

import json
import re

import pytest

import e2e_harness as h

pytestmark = pytest.mark.e2e

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

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
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1, "maximum": 7}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "the weather", "parameters": WEATHER, "strict": True}},
    {"type": "function", "function": {"name": "get_time", "description": "the time", "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}, "strict": True}},
]
LARK = 'start: expr\nexpr: NUMBER | "(" expr " + " expr ")"\nNUMBER: /[0-9]{1,3}/'
MESSAGES = [{"role": "user", "content": "Answer, please."}]
MAX_TOKENS = 400


class _Stack(h.Stack):
    """A stack whose frontend parses tool calls (needed for tool_choice)."""

    def frontend_argv(self) -> list[str]:
        # (vllm serve 0.32 also wants --enable-auto-tool-choice for tool_choice required or named)
        auto = ["--enable-auto-tool-choice"] if self.topology.frontend == "python" else []
        return super().frontend_argv() + ["--tool-call-parser", "hermes", *auto]


@pytest.fixture(scope="module", params=[t for t in h.TOPOLOGIES if t.dp == 1], ids=lambda t: t.id)
def stack(request, frontends, model_dir, tmp_path_factory):
    s = _Stack(request.param, frontends, model_dir, tmp_path_factory.mktemp(request.param.id), engine_args=["--tokenizer", str(model_dir)])
    s.start()
    try:
        yield s
    finally:
        problems = s.stop()
        assert not problems, f"{problems}\n{s.logs_report()}"


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack.base_url + "/v1", api_key="none", max_retries=0, timeout=60)


def lark_parse(text: str) -> None:
    number = re.compile(r"[0-9]{1,3}")

    def expr(at: int) -> int:
        if text.startswith("(", at):
            at = expr(at + 1)
            assert text.startswith(" + ", at), text
            at = expr(at + 3)
            assert text.startswith(")", at), text
            return at + 1
        found = number.match(text, at)
        assert found, text
        return found.end()

    assert expr(0) == len(text), text


def chat(client, **kw):
    return client.chat.completions.create(model=h.MODEL_NAME, messages=MESSAGES, max_tokens=MAX_TOKENS, **kw).choices[0]


def test_json_schema_answers_validate(client):
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    texts = set()
    for _ in range(4):
        choice = chat(client, response_format=response_format)
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), PERSON)
        texts.add(choice.message.content)
    assert len(texts) > 1  # each request its own answer


def test_json_schema_answer_streams_and_validates(client):
    stream = client.chat.completions.create(
        model=h.MODEL_NAME,
        messages=MESSAGES,
        max_tokens=MAX_TOKENS,
        stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
    )
    parts, finish = [], None
    for chunk in stream:
        for choice in chunk.choices:
            parts.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    # (with the engine's default --itl-ms 0 the Python frontend may merge the deltas into one)
    assert finish == "stop"
    jsonschema.validate(json.loads("".join(parts)), PERSON)


def test_json_schema_cut_by_max_tokens_ends_with_length(client):
    choice = client.chat.completions.create(
        model=h.MODEL_NAME, messages=MESSAGES, max_tokens=3, response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    ).choices[0]
    assert choice.finish_reason == "length" and choice.message.content.startswith("{")


def test_json_schema_answer_with_logprobs_has_a_row_per_token(client):
    choice = chat(client, response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}, logprobs=True, top_logprobs=2)
    jsonschema.validate(json.loads(choice.message.content), PERSON)
    content = choice.logprobs.content
    # one entry per token, the EOS that ended it included (as with a real engine)
    assert content and "".join(entry.token for entry in content).startswith(choice.message.content)
    assert len("".join(entry.token for entry in content[:-1])) <= len(choice.message.content)
    assert all(len(entry.top_logprobs) == 2 and entry.logprob <= 0 for entry in content)


def test_json_object_answer_is_an_object(client):
    choice = chat(client, response_format={"type": "json_object"})
    assert choice.finish_reason == "stop" and isinstance(json.loads(choice.message.content), dict)


def test_regex_answer_fullmatches(client):
    regex = r"[0-9]{3}-[a-z]{2,6}"
    for _ in range(3):
        choice = client.completions.create(model=h.MODEL_NAME, prompt="Code:", max_tokens=MAX_TOKENS, extra_body={"structured_outputs": {"regex": regex}}).choices[0]
        assert choice.finish_reason == "stop" and re.fullmatch(regex, choice.text), choice


def test_choice_answer_is_a_member(client):
    choices = ["yes", "no", "maybe later"]
    seen = set()
    for _ in range(8):
        choice = chat(client, extra_body={"structured_outputs": {"choice": choices}})
        assert choice.finish_reason == "stop" and choice.message.content in choices, choice
        seen.add(choice.message.content)
    assert len(seen) > 1


def test_grammar_answer_parses(client):
    for _ in range(3):
        choice = client.completions.create(model=h.MODEL_NAME, prompt="Sum:", max_tokens=MAX_TOKENS, extra_body={"structured_outputs": {"grammar": LARK}}).choices[0]
        assert choice.finish_reason == "stop", choice
        lark_parse(choice.text)


def _check_calls(message, names):
    assert message.tool_calls, message
    for call in message.tool_calls:
        assert call.function.name in names, call
        tool = next(t for t in TOOLS if t["function"]["name"] == call.function.name)
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


def test_tool_choice_required_gives_calls_that_validate(client):
    for _ in range(3):
        choice = chat(client, tools=TOOLS, tool_choice="required")
        assert choice.finish_reason in ("tool_calls", "stop"), choice
        _check_calls(choice.message, {"get_weather", "get_time"})


def test_named_tool_choice_gives_that_call(client):
    for _ in range(3):
        choice = chat(client, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}})
        assert choice.finish_reason in ("tool_calls", "stop"), choice
        _check_calls(choice.message, {"get_weather"})
        assert len(choice.message.tool_calls) == 1


#: A structural tag the frontends' xgrammar accepts and llguidance (the
#: mock's compiler) cannot read: the engine answers that request with ERROR.
UNREADABLE = {"type": "structural_tag", "format": {"type": "qwen_xml_parameter", "json_schema": {"type": "object", "properties": {"a": {"type": "string"}}}}}


def test_a_constraint_the_engine_cannot_compile_ends_that_request_only(stack, client):
    body = {"model": h.MODEL_NAME, "messages": MESSAGES, "max_tokens": 20, "structured_outputs": {"structural_tag": json.dumps(UNREADABLE)}}
    r = stack.post("/v1/chat/completions", body)
    if stack.topology.frontend == "rust":  # vllm-rs passes the engine's message on
        assert r.status_code == 400 and "'qwen_xml_parameter' is not supported" in r.json()["error"]["message"], r.text
    else:  # vllm serve 0.32 turns a request's ERROR end into a 500 without the message
        assert r.status_code == 500 and r.json()["error"]["message"] == "Internal server error", r.text
    assert "structural tag format type 'qwen_xml_parameter' is not supported; answered with ERROR" in stack.engine_log_text()
    # the engine serves on
    assert chat(client, response_format={"type": "json_object"}).finish_reason == "stop"
