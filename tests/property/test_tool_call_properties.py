"""Tool calls and constraints through the engine, over random strict tool sets and
constraints, in the shapes the real frontends send (tests/data/frontend_constraints.json;
`frontend_constraint` rebuilds them, and a test checks it rebuilds the captures exactly):

* random strict tool sets (every property required, additionalProperties false,
  patterns, enums, bounded numbers) x tool_choice {required, required without
  parallel calls, named, auto} x tools with and without `strict` x {vllm serve,
  vllm-rs} x reasoning {on, off}: every answer that finished with STOP is a think
  block (reasoning on) and then hermes calls only, each naming a tool and with
  arguments valid under that tool's schema; one call where parallel calls are off
  or the choice is named;
* random strict JSON schemas and regexes with reasoning on, in both frontends'
  shapes: what finished with STOP is a think block, then exactly a valid answer.
"""

import json
import re
import string
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from engine_driver import examples

pytest.importorskip("llguidance")
pytest.importorskip("tokenizers")
jsonschema = pytest.importorskip("jsonschema")

from gmock_engine.content import answer as content  # noqa: E402
from gmock_engine.content.tokenizer import load_tokenizer  # noqa: E402
from gmock_engine.tools import model_dir  # noqa: E402
from gmock_engine.wire.inputs import EngineCoreRequest, StructuredOutputsParams  # noqa: E402
from gmock_engine.wire.types import FinishReason  # noqa: E402
from engine_steps import engine_with, outputs_of, run, tokens_of  # noqa: E402
from test_structured_properties import REGEXES  # noqa: E402

VOCAB = 4000
EOS = VOCAB - 1
CAPTURED = json.loads((Path(__file__).parent.parent / "data" / "frontend_constraints.json").read_text())
CALLS = re.compile(r"<tool_call>\n?(.*?)\n?</tool_call>", re.S)
_state = {}


def tokenizer_and_model():
    """The model dir (with the hermes and think markers as added tokens), written once."""
    if not _state:
        import tempfile

        import tokenizers

        path = model_dir.write_model_dir(tempfile.mkdtemp(prefix="gmock-tools-"), vocab_size=VOCAB)
        tok = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
        tok.add_tokens([tokenizers.AddedToken(m, special=False, normalized=False) for m in ("<tool_call>", "</tool_call>", "<think>", "</think>")])
        tok.save(str(path / "tokenizer.json"))
        _state["model"] = path
        _state["tokenizer"] = load_tokenizer(str(path))
    return _state["tokenizer"], _state["model"]


# -- the frontends' shapes ------------------------------------------------------------

THINK_PREFIX = {"type": "optional", "content": {"type": "sequence", "elements": [
    {"type": "tag", "begin": "<think>", "content": {"type": "any_text", "excludes": [], "max_tokens": None, "max_chars": None}, "end": "</think>"},
    {"type": "const_string", "value": "\n\n"}]}}  # fmt: skip


def _hermes_tags(tools):
    tags = []
    for tool in tools:
        function = tool["function"]
        schema = function["parameters"] if function.get("strict") is True else True
        for begin, end in (("<tool_call>\n{\"name\": \"", "}\n</tool_call>"), ("<tool_call>{\"name\": \"", "}</tool_call>")):
            tags.append({"type": "tag", "begin": begin + function["name"] + "\", \"arguments\": ", "end": end,
                         "content": {"type": "json_schema", "json_schema": schema, "style": "json", "any_order": False,
                                     "max_whitespace_cnt": None, "excludes": []}})  # fmt: skip
    return tags


def frontend_constraint(frontend, tools, choice, parallel):
    """The structured_outputs map `frontend` (python-plain, rust-reasoning, ...) sends
    for a chat with `tools` and tool_choice `choice` (required, auto or a tool's name);
    None where it sends none (auto without strict tools)."""
    if choice == "auto":
        if not any(t["function"].get("strict") is True for t in tools):
            return None
        form = {"type": "triggered_tags", "triggers": ["<tool_call>"], "tags": _hermes_tags(tools), "at_least_one": False,
                "stop_after_first": False, "excludes": []}  # fmt: skip
    else:
        named = [t for t in tools if t["function"]["name"] == choice] if choice != "required" else tools
        form = {"type": "tags_with_separator", "tags": _hermes_tags(named), "separator": "", "at_least_one": True,
                "stop_after_first": choice != "required" or not parallel}  # fmt: skip
    return {"structural_tag": {"type": "structural_tag", "format": wrap(frontend, form)}}


def wrap(frontend, form):
    """vllm-rs with a reasoning parser puts an optional think block before the constraint."""
    return {"type": "sequence", "elements": [THINK_PREFIX, form]} if frontend == "rust-reasoning" else form


def test_the_builder_rebuilds_what_the_frontends_sent():
    cases = {"required": ("required", True), "required-noparallel": ("required", False), "named": ("book_table", True), "auto": ("auto", True)}
    checked = 0
    for frontend, captured in CAPTURED["captures"].items():
        for label, tools in CAPTURED["tools"].items():
            for case, (choice, parallel) in cases.items():
                sent = captured.get(f"{label}-{case}")
                built = frontend_constraint(frontend, tools, choice, parallel)
                if sent is None:
                    assert built is None, (frontend, label, case)
                    continue
                assert built["structural_tag"] == sent["structural_tag"], (frontend, label, case)
                checked += 1
    assert checked == 28


# -- random strict tools and schemas ----------------------------------------------------

NAMES = st.text(alphabet=string.ascii_lowercase + "_", min_size=1, max_size=8)
LEAVES = st.one_of(
    st.tuples(st.integers(0, 5), st.integers(0, 20)).map(lambda t: {"type": "string", "minLength": t[0], "maxLength": t[0] + t[1]}),
    st.sampled_from(["^[a-z]{2,6}$", "^[0-9]{3}-[0-9]{2}$", "^([01][0-9]|2[0-3]):[0-5][0-9]$"]).map(lambda p: {"type": "string", "pattern": p}),
    st.tuples(st.integers(-1000, 1000), st.integers(0, 1000)).map(lambda t: {"type": "integer", "minimum": t[0], "maximum": t[0] + t[1]}),
    st.tuples(st.integers(-50, 50), st.integers(1, 100)).map(lambda t: {"type": "number", "minimum": t[0], "maximum": t[0] + t[1]}),
    st.just({"type": "boolean"}),
    st.lists(st.text(alphabet=string.ascii_letters + " ,.", min_size=1, max_size=10), min_size=1, max_size=4, unique=True).map(lambda v: {"enum": v}),
)


def _strict_object(children):
    return st.dictionaries(NAMES, children, min_size=1, max_size=4).map(
        lambda props: {"type": "object", "properties": props, "required": sorted(props), "additionalProperties": False})


STRICT_SCHEMAS = st.recursive(LEAVES, lambda children: st.one_of(
    _strict_object(children),
    st.tuples(children, st.integers(0, 2), st.integers(0, 2)).map(lambda t: {"type": "array", "items": t[0], "minItems": t[1], "maxItems": t[1] + t[2]}),
), max_leaves=8)  # fmt: skip
PARAMETERS = st.dictionaries(NAMES, STRICT_SCHEMAS, min_size=0, max_size=4).map(
    lambda props: {"type": "object", "properties": props, "required": sorted(props), "additionalProperties": False})
TOOL_SETS = st.dictionaries(st.text(alphabet=string.ascii_lowercase + "_", min_size=3, max_size=12), PARAMETERS, min_size=1, max_size=4)
FRONTENDS = st.sampled_from(["python-plain", "python-reasoning", "rust-plain", "rust-reasoning"])


def chat_prompt(tokenizer, tools):
    """A prompt as Qwen2.5's chat template renders one with tools (none: no tools block)."""
    system = ""
    if tools:
        lines = "\n".join(json.dumps(t) for t in tools)
        system = (f"<|im_start|>system\n# Tools\n<tools>\n{lines}\n</tools>\nAnswer within <tool_call></tool_call> XML tags:\n"
                  '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n')  # fmt: skip
    return tokenizer.encode(f"{system}<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def answer(frontend, prompt, captured, max_tokens, rid, tool_call_rate=0.0):
    """(text before EOS, finish reason) of one request through an engine that thinks
    when `frontend` has a reasoning parser (as serve --reasoning sets it up)."""
    tokenizer, model = tokenizer_and_model()
    reasoning = frontend.endswith("reasoning")
    settings_ = content.ContentSettings(tool_call_rate=tool_call_rate, reasoning_rate=1.0 if reasoning else 0.0, reasoning_tokens=5)
    engine = engine_with(vocab_size=VOCAB, tokenizer=str(model), content=settings_)
    params = None
    if captured is not None:
        kind = next(k for k in ("json", "regex", "structural_tag") if k in captured)
        spec = captured[kind]
        params = StructuredOutputsParams(kind, spec if isinstance(spec, str) else json.dumps(spec))
    engine.apply(EngineCoreRequest(rid, len(prompt), max_tokens, True, prompt_token_ids=prompt, eos_token_id=EOS,
                                   all_stop_token_ids=(EOS,), structured_outputs=params))  # fmt: skip
    sent = run(engine)
    tokens, finish = tokens_of(sent, rid), outputs_of(sent, rid)[-1][5]
    if finish == FinishReason.STOP:
        assert tokens[-1] == EOS
        tokens = tokens[:-1]
    text = tokenizer.decode(tokens, skip_special_tokens=False)
    if reasoning and finish == FinishReason.STOP:
        assert text.startswith("<think>\n") and "</think>" in text, text
        text = text.split("</think>", 1)[1]  # the grammar starts right after </think>
    return text, finish


@settings(max_examples=examples(60))
@given(TOOL_SETS, st.sampled_from(["required", "required-noparallel", "named", "auto"]), st.sampled_from([None, True]),
       FRONTENDS, st.integers(0, 3), st.integers(40, 600), st.text(alphabet=string.ascii_letters, min_size=1, max_size=6))  # fmt: skip
def test_tool_calls_that_finished_validate(tool_set, mode, strict, frontend, pick, max_tokens, rid):
    tokenizer, _ = tokenizer_and_model()
    tools = [{"type": "function", "function": dict({"name": name, "parameters": schema}, **({} if strict is None else {"strict": strict}))}
             for name, schema in sorted(tool_set.items())]  # fmt: skip
    names = [t["function"]["name"] for t in tools]
    choice = names[pick % len(names)] if mode == "named" else mode.split("-")[0]
    captured = frontend_constraint(frontend, tools, choice, mode != "required-noparallel")
    text, finish = answer(frontend, chat_prompt(tokenizer, tools), captured, max_tokens, rid, tool_call_rate=0.5)
    if finish != FinishReason.STOP:
        return
    if mode == "auto" and "<tool_call>" not in text:
        assert captured is None or "<" not in text, text  # text; under a triggered tag: text without a trigger
        return
    rest = CALLS.sub("", text)
    # under a constraint nothing but calls; without one (auto, no strict tool) a thinking
    # model's `\n\n` after </think> may come first, as a real one's (the parsers drop it)
    assert rest == "" or (captured is None and not rest.strip()), text
    calls = [json.loads(body) for body in CALLS.findall(text)]
    assert calls and all(set(call) == {"name", "arguments"} for call in calls), text
    for call in calls:
        jsonschema.validate(call["arguments"], tool_set[call["name"]])
    if mode in ("named", "required-noparallel"):
        assert len(calls) == 1, text
    if mode == "named":
        assert calls[0]["name"] == choice


@settings(max_examples=examples(40))
@given(STRICT_SCHEMAS, st.sampled_from(["python-reasoning", "rust-reasoning"]), st.integers(20, 400), st.text(alphabet=string.ascii_letters, min_size=1, max_size=6))
def test_a_schema_answer_behind_a_think_block_validates(schema, frontend, max_tokens, rid):
    tokenizer, _ = tokenizer_and_model()
    node = {"type": "json_schema", "json_schema": schema, "style": "json", "any_order": False, "max_whitespace_cnt": None, "excludes": []}
    captured = {"json": json.dumps(schema)} if frontend == "python-reasoning" else \
        {"structural_tag": {"type": "structural_tag", "format": wrap(frontend, node)}}  # fmt: skip
    text, finish = answer(frontend, chat_prompt(tokenizer, None), captured, max_tokens, rid)
    if finish == FinishReason.STOP:
        jsonschema.validate(json.loads(text), schema)


@settings(max_examples=examples(40))
@given(REGEXES, st.sampled_from(["python-reasoning", "rust-reasoning"]), st.integers(20, 200), st.text(alphabet=string.ascii_letters, min_size=1, max_size=6))
def test_a_regex_answer_behind_a_think_block_fullmatches(regex, frontend, max_tokens, rid):
    tokenizer, _ = tokenizer_and_model()
    captured = {"regex": regex} if frontend == "python-reasoning" else \
        {"structural_tag": {"type": "structural_tag", "format": wrap(frontend, {"type": "regex", "pattern": regex})}}  # fmt: skip
    text, finish = answer(frontend, chat_prompt(tokenizer, None), captured, max_tokens, rid)
    if finish == FinishReason.STOP:
        assert re.fullmatch(regex, text), (regex, text)
