"""Tool calls (`tool_choice` auto) and reasoning through both real frontends
(DP 1), with the official `openai` client, as `./run.sh serve --tools
--reasoning` sets them up: the frontends parse tool calls with `hermes` and
reasoning with `qwen3`, the model dir renders tools as Qwen2.5's template
and has the `<tool_call>` and `<think>` tokens, and the engine runs with
`--tokenizer <the model dir> --token-source text` (docs/content.md).

What is checked is what a client parses: a chat with tools and
`tool_choice` auto gets `tool_calls` whose name is one of the tools and
whose arguments validate against that tool's parameters (streamed too),
unless `vllm_xargs` mock_tool_call asks for text; an answer with a
reasoning span has it in the reasoning field and the rest in content.
"""

from __future__ import annotations

import json
import re

import pytest

import e2e_harness as h

pytestmark = pytest.mark.e2e

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1, "maximum": 7}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"],
}
TIME = {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "the weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "the time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


class _Stack(h.Stack):
    """A stack whose frontend parses tool calls and reasoning (serve --tools --reasoning)."""

    def frontend_argv(self) -> list[str]:
        auto = ["--enable-auto-tool-choice"] if self.topology.frontend == "python" else []
        return super().frontend_argv() + ["--tool-call-parser", "hermes", *auto, "--reasoning-parser", "qwen3"]


@pytest.fixture(scope="module", params=[t for t in h.TOPOLOGIES if t.dp == 1], ids=lambda t: t.id)
def stack(request, frontends, model_dir, tmp_path_factory):
    # as serve --tools --reasoning: every chat with tools calls one; a thinking model, half the answers think
    args = ["--tokenizer", str(model_dir), "--token-source", "text", "--tool-call-rate", "1", "--reasoning-rate", "0.5",
            "--reasoning-tokens", "12"]
    s = _Stack(request.param, frontends, model_dir, tmp_path_factory.mktemp(request.param.id), engine_args=args)
    s.start()
    try:
        yield s
    finally:
        problems = s.stop()
        assert not problems, f"{problems}\n{s.logs_report()}"


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack.base_url + "/v1", api_key="none", max_retries=0, timeout=60)


def chat(client, xargs=None, **kw):
    kw.setdefault("max_tokens", 300)
    extra = {"vllm_xargs": xargs} if xargs else None
    return client.chat.completions.create(model=h.MODEL_NAME, messages=MESSAGES, extra_body=extra, **kw)


def reasoning_of(message) -> str:
    """The reasoning field: `reasoning_content` (vllm serve 0.32, vllm-rs) or `reasoning`."""
    extra = message.model_extra or {}
    return getattr(message, "reasoning_content", None) or extra.get("reasoning_content") or extra.get("reasoning") or ""


def _check_call(name: str, arguments: str) -> None:
    assert name in SCHEMAS, name
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_auto_tool_choice_gives_calls_that_validate(client):
    names = set()
    for seed in range(6):
        choice = chat(client, tools=TOOLS, tool_choice="auto", seed=seed).choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert len(choice.message.tool_calls) == 1 and not (choice.message.content or "").strip(), choice.message
        call = choice.message.tool_calls[0].function
        _check_call(call.name, call.arguments)
        names.add(call.name)
    assert names  # (which tool is drawn per request: the unit tests check both are)


def test_auto_tool_call_streams_and_validates(client):
    stream = chat(client, tools=TOOLS, tool_choice="auto", stream=True)
    name, arguments, finish = None, "", None
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        for call in delta.tool_calls or ():
            name = call.function.name or name
            arguments += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and name is not None, (name, arguments, finish)
    _check_call(name, arguments)


def test_vllm_xargs_ask_for_text_instead_of_a_call(client):
    choice = chat(client, xargs={"mock_tool_call": False}, tools=TOOLS, tool_choice="auto", max_tokens=40).choices[0]
    assert not choice.message.tool_calls and choice.message.content, choice.message


def test_without_tools_the_answer_is_text(client):
    choice = chat(client, max_tokens=40).choices[0]
    assert not choice.message.tool_calls and choice.message.content and "<tool_call>" not in choice.message.content


def test_an_empty_think_block_leaves_the_answer_in_content(client):
    message = chat(client, xargs={"mock_reasoning_tokens": 0}, max_tokens=40).choices[0].message
    assert not reasoning_of(message).strip() and message.content and "think>" not in message.content, message


def test_enable_thinking_false_gives_no_block(client):
    body = {"chat_template_kwargs": {"enable_thinking": False}}
    message = client.chat.completions.create(model=h.MODEL_NAME, messages=MESSAGES, max_tokens=40, extra_body=body).choices[0].message
    assert not reasoning_of(message).strip() and message.content and "think>" not in message.content, message


def test_a_reasoning_span_goes_to_the_reasoning_field(client):
    choice = chat(client, xargs={"mock_reasoning_tokens": 16, "mock_tool_call": False}, max_tokens=60).choices[0]
    message = choice.message
    reasoning = reasoning_of(message)
    assert reasoning.strip() and "<think>" not in reasoning and "</think>" not in reasoning, message
    assert message.content and "</think>" not in message.content, message


def test_reasoning_before_a_tool_call(client):
    choice = chat(client, xargs={"mock_reasoning_tokens": 12}, tools=TOOLS, tool_choice="auto").choices[0]
    assert reasoning_of(choice.message).strip(), choice.message
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1, choice
    call = choice.message.tool_calls[0].function
    _check_call(call.name, call.arguments)


# -- tool_choice required and named, with strict schemas (every property required,
#    additionalProperties false, patterns, bounded numbers) ---------------------------

STRICT_WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "minLength": 2, "maxLength": 30}, "unit": {"enum": ["C", "F"]},
                   "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "unit", "days"], "additionalProperties": False,
}  # fmt: skip
STRICT_BOOK = {
    "type": "object",
    "properties": {"people": {"type": "integer", "minimum": 1, "maximum": 12},
                   "time": {"type": "string", "pattern": "^([01][0-9]|2[0-3]):[0-5][0-9]$"}},
    "required": ["people", "time"], "additionalProperties": False,
}  # fmt: skip
STRICT_SCHEMAS = {"get_weather": STRICT_WEATHER, "book_table": STRICT_BOOK}


def strict_tools(flag):
    """The two tools; `flag`: their `strict` field (None: absent, the frontends then send
    the arguments as any JSON and the engine follows the schema the prompt shows)."""
    tools = []
    for name, schema in STRICT_SCHEMAS.items():
        function = {"name": name, "description": name.replace("_", " "), "parameters": schema}
        if flag is not None:
            function["strict"] = flag
        tools.append({"type": "function", "function": function})
    return tools


def _calls_of(client, stream, **kw):
    """(finish reason, [(name, arguments text)]) of one chat, streamed or not."""
    if not stream:
        choice = chat(client, **kw).choices[0]
        return choice.finish_reason, [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or ()]
    calls, finish = {}, None
    for chunk in chat(client, stream=True, **kw):
        if not chunk.choices:
            continue
        for call in chunk.choices[0].delta.tool_calls or ():
            name, text = calls.get(call.index, (None, ""))
            calls[call.index] = (call.function.name or name, text + (call.function.arguments or ""))
        finish = chunk.choices[0].finish_reason or finish
    return finish, [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_required_and_named_calls_validate_against_strict_schemas(client, stream):
    """tool_choice required (parallel on and off) and named, tools with and without
    `strict`: 28 requests per frontend and mode, 56 per frontend; every call's arguments
    validate against its tool's schema."""
    counts = {}
    for n in range(28):
        flag = (None, True)[n % 2]
        parallel = n % 4 < 2
        named = n % 7 == 3
        choice = {"type": "function", "function": {"name": "book_table"}} if named else "required"
        finish, calls = _calls_of(client, stream, tools=strict_tools(flag), tool_choice=choice, parallel_tool_calls=parallel,
                                  seed=n, max_tokens=400)  # fmt: skip
        assert finish in ("tool_calls", "stop") and calls, (n, finish, calls)
        for name, arguments in calls:
            jsonschema.validate(json.loads(arguments), STRICT_SCHEMAS[name])
        if named:
            assert {name for name, _ in calls} == {"book_table"}, calls
        if not parallel or named:
            assert len(calls) == 1, (n, calls)
        counts[len(calls)] = counts.get(len(calls), 0) + 1
    assert counts.get(1), counts


# -- serve --tools --reasoning: every constraint on the content, the think text in reasoning


DATE = r"\d{4}-\d{2}-\d{2}"
CONSTRAINTS = [
    ("json_schema", {"response_format": {"type": "json_schema", "json_schema": {"name": "b", "schema": STRICT_BOOK, "strict": True}}}),
    ("json_object", {"response_format": {"type": "json_object"}}),
    ("regex", {"extra_body": {"structured_outputs": {"regex": DATE}}}),
    ("choice", {"extra_body": {"structured_outputs": {"choice": ["alpha", "beta", "gamma"]}}}),
    ("grammar", {"extra_body": {"structured_outputs": {"grammar": 'start: "yes" | "no"'}}}),
]


def _check_content(kind, text):
    if kind == "json_schema":
        jsonschema.validate(json.loads(text), STRICT_BOOK)
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict), text
    elif kind == "regex":
        assert re.fullmatch(DATE, text), repr(text)
    elif kind == "choice":
        assert text in ("alpha", "beta", "gamma"), repr(text)
    else:
        assert text in ("yes", "no"), repr(text)


@pytest.mark.parametrize("kind,extra", CONSTRAINTS, ids=[c[0] for c in CONSTRAINTS])
def test_constraints_hold_on_the_content_with_reasoning_on(client, kind, extra):
    """A thinking answer: the think text in the reasoning field, exactly the constrained
    answer in content (nothing before it), also when max_tokens leaves little room."""
    body = dict(extra.get("extra_body", {}), vllm_xargs={"mock_reasoning_tokens": 24})
    for max_tokens in (200, 24):
        kw = {k: v for k, v in extra.items() if k != "extra_body"}
        choice = client.chat.completions.create(model=h.MODEL_NAME, messages=MESSAGES, max_tokens=max_tokens, extra_body=body, **kw).choices[0]
        assert choice.finish_reason == "stop", (kind, max_tokens, choice)
        _check_content(kind, choice.message.content)
        if max_tokens == 200:
            assert reasoning_of(choice.message).strip(), choice.message


def test_tool_calls_follow_the_think_block_with_reasoning_on(client):
    body = {"vllm_xargs": {"mock_reasoning_tokens": 16}}
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        message = client.chat.completions.create(model=h.MODEL_NAME, messages=MESSAGES, max_tokens=300, tools=strict_tools(None),
                                                 tool_choice=choice, extra_body=body).choices[0].message  # fmt: skip
        assert reasoning_of(message).strip() and message.tool_calls, message
        for call in message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), STRICT_SCHEMAS[call.function.name])


# -- no constraint dropped: past a limit, or with no answer, the request fails ---------

WIDE = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(2000)}, "required": [f"p{i}" for i in range(2000)]}
CHAIN = "start: r0\n" + "\n".join(f'r{i}: "x" r{i + 1}' for i in range(4999)) + '\nr4999: "end"'
REFUSED = [
    ("choice-12000", {"extra_body": {"structured_outputs": {"choice": [f"item{i}" for i in range(12000)]}}}),
    ("grammar-5000-rules", {"extra_body": {"structured_outputs": {"grammar": CHAIN}}}),
    ("object-2000-properties", {"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": WIDE}}, "max_tokens": 6000}),
    ("empty-regex", {"extra_body": {"structured_outputs": {"regex": r"[^\s\S]"}}}),
    ("min-tokens", {"extra_body": {"structured_outputs": {"choice": ["a", "b"]}, "min_tokens": 40}}),  # past the block and the answer
]


@pytest.mark.parametrize("name,kw", REFUSED, ids=[r[0] for r in REFUSED])
def test_a_constraint_the_engine_cannot_follow_is_an_error_never_a_200(client, name, kw):
    """vllm serve maps the engine's ERROR to 500 (or refuses in its own checks with
    400), vllm-rs to 400: either way an error, never an answer outside the constraint."""
    kw = dict(kw)
    kw.setdefault("max_tokens", 200)
    body = dict(kw.pop("extra_body", {}), vllm_xargs={"mock_reasoning_tokens": 0})
    with pytest.raises(openai.APIStatusError) as failed:
        client.chat.completions.create(model=h.MODEL_NAME, messages=MESSAGES, extra_body=body, **kw)
    assert failed.value.status_code in (400, 500), failed.value


def test_a_choice_of_5000_items_is_followed(client):
    items = [f"item{i}" for i in range(5000)]
    body = {"structured_outputs": {"choice": items}, "vllm_xargs": {"mock_reasoning_tokens": 0}}
    choice = client.chat.completions.create(model=h.MODEL_NAME, messages=MESSAGES, max_tokens=50, extra_body=body).choices[0]
    assert choice.finish_reason == "stop" and choice.message.content in items, choice
