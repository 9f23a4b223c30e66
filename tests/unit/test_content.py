"""gmock_engine/content/answer.py: tool calls (hermes format) for prompts with tools, and reasoning spans."""

import json
import re

import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from gmock_engine.content import answer as content  # noqa: E402
from gmock_engine.content.tokenizer import load_tokenizer  # noqa: E402
from gmock_engine.wire.checks import BadXargs, check_xargs  # noqa: E402
from gmock_engine.wire.inputs import EngineCoreRequest, StructuredOutputsParams  # noqa: E402
from gmock_engine.wire.types import FinishReason  # noqa: E402
from engine_steps import engine_with, marked_model_dir, outputs_of, run, tokens_of  # noqa: E402

VOCAB = 4000
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "unit"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "Time", "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """The generated model dir, with the markers as added tokens (not special, as Qwen's)."""
    return marked_model_dir(tmp_path_factory.mktemp("model"), VOCAB)


@pytest.fixture(scope="module")
def tokenizer(model):
    return load_tokenizer(str(model))


def chat_prompt(tokenizer, tools=TOOLS, user="What is the weather in Paris?"):
    """A prompt as Qwen2.5's chat template renders one with tools."""
    system = ""
    if tools:
        lines = "\n".join(json.dumps(t) for t in tools)
        system = (
            "<|im_start|>system\nYou are a helper.\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{lines}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n"
            '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
        )
    return tokenizer.encode(f"{system}<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n")


def request(rid, prompt, max_tokens=200, **kw):
    eos = VOCAB - 1
    kw.setdefault("eos_token_id", eos)
    kw.setdefault("all_stop_token_ids", (eos,))
    return EngineCoreRequest(rid, len(prompt), max_tokens, True, prompt_token_ids=prompt, **kw)


CALL = re.compile(r"<tool_call>\n(.*)\n</tool_call>", re.S)


def test_the_prompts_tools_are_read(tokenizer):
    tools = content.prompt_tools(tokenizer, chat_prompt(tokenizer))
    assert [t.name for t in tools] == ["get_weather", "get_time"]
    assert tools[0].parameters == WEATHER
    assert content.prompt_tools(tokenizer, chat_prompt(tokenizer, tools=None)) == []


def test_tool_calls_validate_against_the_tools_schema(model, tokenizer):
    engine = engine_with(vocab_size=VOCAB, tokenizer=str(model), content=content.ContentSettings(tool_call_rate=1.0))
    prompt = chat_prompt(tokenizer)
    for n in range(20):
        engine.apply(request(f"t{n}", prompt))
    sent = run(engine)
    names = set()
    for n in range(20):
        tokens = tokens_of(sent, f"t{n}")
        assert outputs_of(sent, f"t{n}")[-1][5] == FinishReason.STOP and tokens[-1] == VOCAB - 1
        text = tokenizer.decode(tokens, skip_special_tokens=False).replace("<|im_end|>", "")
        call = json.loads(CALL.fullmatch(text).group(1))
        names.add(call["name"])
        jsonschema.validate(call["arguments"], SCHEMAS[call["name"]])
    assert names == {"get_weather", "get_time"}


def test_the_share_of_calls_follows_the_rate_and_the_xargs_win(model, tokenizer):
    engine = engine_with(vocab_size=VOCAB, tokenizer=str(model), content=content.ContentSettings(tool_call_rate=0.3), seed=3)
    prompt = chat_prompt(tokenizer)
    for n in range(200):
        engine.apply(request(f"t{n}", prompt, max_tokens=80))
    engine.apply(request("yes", prompt, extra_args={"mock_tool_call": True}))
    engine.apply(request("no", chat_prompt(tokenizer), max_tokens=40, extra_args={"mock_tool_call": False}))
    sent = run(engine)
    calls = sum(tokenizer.decode(tokens_of(sent, f"t{n}"), skip_special_tokens=False).startswith("<tool_call>") for n in range(200))
    assert 40 <= calls <= 80  # 60 expected
    assert tokenizer.decode(tokens_of(sent, "yes"), skip_special_tokens=False).startswith("<tool_call>\n{")
    assert "<tool_call>" not in tokenizer.decode(tokens_of(sent, "no"), skip_special_tokens=False)


def test_a_short_max_tokens_cuts_the_call_with_length(model, tokenizer):
    engine = engine_with(vocab_size=VOCAB, tokenizer=str(model), content=content.ContentSettings(tool_call_rate=1.0))
    engine.apply(request("t", chat_prompt(tokenizer), max_tokens=6))
    sent = run(engine)
    assert outputs_of(sent, "t")[-1][5] == FinishReason.LENGTH and len(tokens_of(sent, "t")) == 6
    assert tokenizer.decode(tokens_of(sent, "t"), skip_special_tokens=False).startswith("<tool_call>\n")


def test_reasoning_spans_come_first_and_count_in_the_length(model, tokenizer):
    engine = engine_with(vocab_size=VOCAB, tokenizer=str(model), content=content.ContentSettings(reasoning_rate=1.0, reasoning_tokens=10))
    prompt = chat_prompt(tokenizer, tools=None)
    engine.apply(request("r", prompt, max_tokens=40))
    engine.apply(request("none", prompt, max_tokens=40, extra_args={"mock_reasoning_tokens": 0}))
    engine.apply(request("s", prompt, max_tokens=300, structured_outputs=StructuredOutputsParams("json", json.dumps(WEATHER))))
    sent = run(engine)
    tokens = tokens_of(sent, "r")
    assert len(tokens) == 40 and outputs_of(sent, "r")[-1][5] == FinishReason.LENGTH
    text = tokenizer.decode(tokens, skip_special_tokens=False)
    assert re.match(r"<think>\n.+\n</think>\n\n.", text, re.S), text
    assert tokens[2:12] == tokens[2:12] and text.count("<think>") == 1
    assert tokenizer.decode(tokens_of(sent, "none"), skip_special_tokens=False).startswith("<think>\n\n</think>\n\n")
    structured = tokenizer.decode(tokens_of(sent, "s"))
    # the grammar starts right after </think>: nothing but the answer follows it
    reasoning, answer = structured.split("</think>")
    assert reasoning.startswith("<think>\n") and answer.startswith("{"), structured
    jsonschema.validate(json.loads(answer), WEATHER)


def test_reasoning_before_a_tool_call(model, tokenizer):
    engine = engine_with(vocab_size=VOCAB, tokenizer=str(model), content=content.ContentSettings(tool_call_rate=1.0, reasoning_rate=1.0, reasoning_tokens=8))
    engine.apply(request("t", chat_prompt(tokenizer)))
    sent = run(engine)
    text = tokenizer.decode(tokens_of(sent, "t"), skip_special_tokens=False).replace("<|im_end|>", "")
    reasoning, call = text.split("</think>\n\n")
    assert reasoning.startswith("<think>\n") and CALL.fullmatch(call)


def test_without_a_tokenizer_answers_stay_text(tokenizer):
    engine = engine_with(vocab_size=VOCAB, content=content.ContentSettings(tool_call_rate=1.0, reasoning_rate=1.0, reasoning_tokens=8))
    engine.apply(request("t", chat_prompt(tokenizer), max_tokens=20))
    sent = run(engine)
    assert len(tokens_of(sent, "t")) == 20


@pytest.mark.parametrize("xargs,reason", [
    ({"mock_tool_call": 2}, "mock_tool_call must be true or false"),
    ({"mock_tool_call": "yes"}, "mock_tool_call must be true or false"),
    ({"mock_tool_call": 1.5}, "mock_tool_call must be true or false"),
    ({"mock_reasoning_tokens": -1}, "mock_reasoning_tokens must be an int"),
    ({"mock_reasoning_tokens": "8"}, "mock_reasoning_tokens must be an int"),
])
def test_bad_xargs_are_refused(xargs, reason):
    with pytest.raises(BadXargs, match=reason):
        check_xargs(xargs)


def test_without_a_tokenizer_only_requests_that_ask_are_warned_about(tokenizer):
    from types import SimpleNamespace

    from gmock_engine.config.settings import EngineSettings

    settings = EngineSettings(rank=0, num_clients=1, content=content.ContentSettings(tool_call_rate=0.5))
    planned = SimpleNamespace(sampler=None, rng_state=0)
    plain = request("p", chat_prompt(tokenizer))
    assert content.shape(planned, plain, check_xargs({"mock_output_len": 3}), settings, 0, 10) is None
    assert "need --tokenizer" in content.shape(planned, plain, check_xargs({"mock_tool_call": True}), settings, 0, 10)


def test_a_thinking_model_closes_a_block_in_every_answer_unless_the_prompt_did(model, tokenizer):
    engine = engine_with(vocab_size=VOCAB, tokenizer=str(model), content=content.ContentSettings(reasoning_rate=0.5, reasoning_tokens=6))
    prompt = chat_prompt(tokenizer, tools=None)
    closed = tokenizer.encode(tokenizer.decode(prompt, skip_special_tokens=False) + "<think>\n\n</think>\n\n")
    for n in range(40):
        engine.apply(request(f"r{n}", prompt, max_tokens=30))
    engine.apply(request("closed", closed, max_tokens=30))
    sent = run(engine)
    texts = [tokenizer.decode(tokens_of(sent, f"r{n}"), skip_special_tokens=False) for n in range(40)]
    empty = sum(t.startswith("<think>\n\n</think>\n\n") for t in texts)
    assert all(t.startswith("<think>\n") and "</think>\n\n" in t for t in texts)
    assert 10 <= empty <= 30  # half of them think
    assert "<think>" not in tokenizer.decode(tokens_of(sent, "closed"), skip_special_tokens=False)


def test_the_python_frontends_integer_booleans_are_read():
    assert check_xargs({"mock_tool_call": 0}).tool_call is False and check_xargs({"mock_tool_call": 1}).tool_call is True
