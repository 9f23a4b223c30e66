"""Structured outputs (gmock_engine/content/structured_output.py, docs/protocol.md §3.3): the wire
decoding of `structured_outputs`, the answers generated with llguidance
(valid when they end by STOP, cut by max_tokens with LENGTH, the same for
the same seed and request id) and the engine's handling of a structured
request: its tokens, its finish, its logprobs, a bad grammar's ERROR, and
random text without --tokenizer."""

import json
import re

import msgpack
import pytest

from gmock_engine.content import structural_tag, structured_output
from gmock_engine.content.tokenizer import load_tokenizer
from gmock_engine.tools import model_dir
from gmock_engine.wire.eras import DEFAULT_PROTOCOL_VERSION, WIRE_LAYOUTS
from gmock_engine.wire.inputs import EngineCoreRequest, InvalidRequest, StructuredOutputsParams, decode_input
from gmock_engine.wire.types import FinishReason
from engine_steps import engine_with, outputs_of, run, tokens_of

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

LAYOUT = WIRE_LAYOUTS[DEFAULT_PROTOCOL_VERSION]
VOCAB = 4000
EOS = VOCAB - 1

ADDRESS = {"type": "object", "properties": {"street": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["zip"]}
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "score": {"type": "number", "minimum": -1, "maximum": 1},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
        "active": {"type": "boolean"},
        "home": {"$ref": "#/$defs/address"},
        "past": {"type": "array", "items": {"$ref": "#/$defs/address"}},
    },
    "required": ["name", "age", "role", "home"],
    "$defs": {"address": ADDRESS},
}
NESTED = {
    "type": "object",
    "properties": {"a": {"type": "object", "properties": {"b": {"type": "object", "properties": {"c": {"type": "array", "items": {"type": "integer"}}}, "required": ["c"]}}, "required": ["b"]}},
    "required": ["a"],
}
TOOLS = {  # what vLLM makes of tool_choice "required" (an array of calls)
    "type": "array",
    "minItems": 1,
    "items": {
        "type": "object",
        "anyOf": [{"properties": {"name": {"type": "string", "enum": ["get_weather"]}, "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}, "required": ["name", "parameters"]}],
    },
}
LARK = 'start: expr\nexpr: NUMBER | "(" expr " + " expr ")"\nNUMBER: /[0-9]{1,3}/'


def lark_parse(text):
    """A parser of LARK's language: what the grammar accepts, by hand."""
    number = re.compile(r"[0-9]{1,3}")

    def expr(at):
        if text.startswith("(", at):
            at = expr(at + 1)
            assert text.startswith(" + ", at), (text, at)
            at = expr(at + 3)
            assert text.startswith(")", at), (text, at)
            return at + 1
        found = number.match(text, at)
        assert found, (text, at)
        return found.end()

    assert expr(0) == len(text), text


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """The model dir: its tokenizer has `<tool_call>` and `</tool_call>` as
    added tokens that are not special, as Qwen's."""
    return model_dir.write_model_dir(tmp_path_factory.mktemp("model"), vocab_size=VOCAB)


@pytest.fixture(scope="module")
def tokenizer(model):
    return load_tokenizer(str(model))


@pytest.fixture(scope="module")
def generator(tokenizer):
    return structured_output.for_tokenizer(tokenizer)


def params(kind, spec):
    if kind == "choice" or isinstance(spec, dict):
        spec = json.dumps(spec)
    return StructuredOutputsParams(kind, spec)


def answers(generator, tokenizer, kind, spec, n=40, limit=400):
    """(text, ended) of n answers, one per seed."""
    out = []
    for seed in range(n):
        answer = generator.generate(params(kind, spec), seed, limit, EOS)
        ids = answer.token_ids
        if answer.ended:
            assert ids[-1] == EOS and EOS not in ids[:-1]
            ids = ids[:-1]
        out.append((tokenizer.decode(ids), answer.ended))
    return out


# -- the wire ------------------------------------------------------------------


def add(sampling):
    array = ["r", [1], None, sampling, None, 0.0, None, None, None, None, None, 1, 0, 0, None, False, None, None, None, False, None, None]
    return decode_input([b"\x00", msgpack.packb(array)], LAYOUT)


@pytest.mark.parametrize(
    "value,expected",
    [
        ({"json": {"type": "object"}}, StructuredOutputsParams("json", '{"type": "object"}')),
        ({"json": '{"type":"string"}', "disable_any_whitespace": True}, StructuredOutputsParams("json", '{"type":"string"}')),
        ({"json_object": True}, StructuredOutputsParams("json_object", "")),
        ({"regex": "[0-9]{3}"}, StructuredOutputsParams("regex", "[0-9]{3}")),
        ({"choice": ["yes", "no"], "regex": None}, StructuredOutputsParams("choice", '["yes", "no"]')),
        ({"grammar": LARK, "disable_additional_properties": True}, StructuredOutputsParams("grammar", LARK)),
        ({"structural_tag": '{"triggers": []}'}, StructuredOutputsParams("structural_tag", '{"triggers": []}')),
    ],
)
def test_structured_outputs_are_decoded_into_their_kind_and_spec(value, expected):
    request = add({"max_tokens": 5, "structured_outputs": value})
    assert isinstance(request, EngineCoreRequest) and request.structured_outputs == expected
    # guided_decoding: the same map under its 0.11 name
    assert add({"guided_decoding": value}).structured_outputs == expected


def test_no_structured_outputs_is_none():
    assert add({"max_tokens": 5}).structured_outputs is None
    assert add({"max_tokens": 5, "structured_outputs": None, "logprobs": 1}).structured_outputs is None


@pytest.mark.parametrize(
    "value,reason",
    [
        ("json", "structured_outputs is str, not a map"),
        ({}, "exactly one of"),
        ({"json": {}, "regex": "a"}, "exactly one of"),
        ({"regex": 5}, "structured_outputs.regex is int, not a string"),
        ({"json": 5}, "structured_outputs.json is int, not a string or a map"),
        ({"choice": []}, "choice .* is not a non-empty array of strings"),
        ({"choice": ["a", 1]}, "choice .* is not a non-empty array of strings"),
        ({"json_object": "yes"}, "json_object 'yes' is not a bool"),
        ({"json": {"a": b"bytes"}}, "structured_outputs.json is not JSON"),
        ({"grammar": "x" * (2 << 20)}, "longer than"),
    ],
)
def test_bad_structured_outputs_are_an_invalid_request(value, reason):
    message = add({"structured_outputs": value})
    assert isinstance(message, InvalidRequest) and re.search(reason, message.reason), message


# -- generation ----------------------------------------------------------------


@pytest.mark.parametrize("schema", [PERSON, NESTED, TOOLS, {"type": "string", "maxLength": 30}, {"type": "integer", "minimum": 5, "maximum": 9000}])
def test_json_schema_answers_that_stop_are_valid(generator, tokenizer, schema):
    results = answers(generator, tokenizer, "json", schema)
    ended = [text for text, stopped in results if stopped]
    assert len(ended) >= 0.9 * len(results), results  # an ordinary schema ends by itself
    for text in ended:
        jsonschema.validate(json.loads(text), schema)
        assert not re.search(r"\s", re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)), text  # compact: no whitespace between tokens


def test_json_answers_vary_and_use_optional_properties(generator, tokenizer):
    texts = [text for text, stopped in answers(generator, tokenizer, "json", PERSON) if stopped]
    values = [json.loads(text) for text in texts]
    assert len(set(texts)) > 30
    assert {v["role"] for v in values} == {"admin", "user", "guest"}
    assert any("tags" in v for v in values) and any("tags" not in v for v in values)


def test_json_answers_name_only_the_properties_a_schema_names(generator, tokenizer):
    for text, stopped in answers(generator, tokenizer, "json", PERSON):
        if stopped:
            value = json.loads(text)
            assert set(value) <= set(PERSON["properties"]) and set(value["home"]) <= set(ADDRESS["properties"]), text


def test_json_object_answers_are_objects(generator, tokenizer):
    for text, stopped in answers(generator, tokenizer, "json_object", ""):
        if stopped:
            assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("regex", [r"[0-9]{3}-[a-z]{2,5}", r"(yes|no)!", r"[a-z]+@[a-z]+\.(com|org)", r"-?[0-9]+(\.[0-9]{1,2})?"])
def test_regex_answers_fullmatch(generator, tokenizer, regex):
    results = answers(generator, tokenizer, "regex", regex)
    assert all(stopped for _, stopped in results)
    for text, _ in results:
        assert re.fullmatch(regex, text), (regex, text)


def test_choice_answers_are_members(generator, tokenizer):
    choices = ["yes", "no", "maybe not", "Paris, France"]
    results = answers(generator, tokenizer, "choice", choices)
    assert all(stopped and text in choices for text, stopped in results), results
    assert len({text for text, _ in results}) == len(choices)


def test_lark_grammar_answers_parse(generator, tokenizer):
    results = answers(generator, tokenizer, "grammar", LARK)
    assert sum(stopped for _, stopped in results) >= 0.9 * len(results)
    for text, stopped in results:
        if stopped:
            lark_parse(text)


def tool_tag(parameters, stop_after_first, both=True, tools=None):
    """The structural tag both frontends send for tool_choice required
    (stop_after_first false) or named, for get_weather with `parameters`
    or for `tools` (name, parameters); `both` false: each tool's second tag
    only (the forced text then starts with `<tool_call>`, an added token)."""
    tags = []
    for name, schema in tools or (("get_weather", parameters),):
        content = {"type": "json_schema", "json_schema": schema, "style": "json", "any_order": False, "max_whitespace_cnt": None, "excludes": []}
        begin = '<tool_call>{"name": "%s", "arguments": ' % name
        pair = [
            {"type": "tag", "begin": begin.replace("{", "\n{", 1), "content": content, "end": "}\n</tool_call>"},
            {"type": "tag", "begin": begin, "content": content, "end": "}</tool_call>"},
        ]
        tags += pair if both else pair[1:]
    return {"type": "structural_tag", "format": {"type": "tags_with_separator", "tags": tags, "separator": "", "at_least_one": True, "stop_after_first": stop_after_first}}


CITY = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1, "maximum": 7}}, "required": ["city"]}


@pytest.mark.parametrize("both", [True, False])
@pytest.mark.parametrize("stop_after_first", [True, False])
@pytest.mark.parametrize("parameters", [CITY, True])
def test_tool_call_structural_tags_give_calls_whose_arguments_validate(generator, tokenizer, stop_after_first, parameters, both):
    tool_call = tokenizer.token_id("<tool_call>")  # an added token that is not special, as Qwen's
    assert tool_call is not None and tool_call not in tokenizer.special_ids
    spec = json.dumps(tool_tag(parameters, stop_after_first, both))
    for seed in range(20):
        answer = generator.generate(StructuredOutputsParams("structural_tag", spec), seed, 500, EOS)
        assert answer.ended
        text = tokenizer.decode(answer.token_ids[:-1])
        calls = re.findall(r"<tool_call>\n?(.*?)\n?</tool_call>", text, re.S)
        assert "".join(f"<tool_call>{c}</tool_call>" for c in calls).replace("\n", "") == text.replace("\n", "")
        assert len(calls) == 1 or (calls and not stop_after_first)
        for call in calls:
            value = json.loads(call)
            assert value["name"] == "get_weather"
            jsonschema.validate(value["arguments"], parameters if parameters is not True else {"type": "object"})
            if parameters is CITY:
                assert set(value["arguments"]) <= set(CITY["properties"]), call


def test_a_chain_of_tool_calls_ends_well_within_the_limit(generator, tokenizer):
    """tool_choice required with two tools: the answer may chain calls, but
    each tag's end is a closer (`>`), so the chain ends as the closing
    probability grows; where `>` and `><` were a coin toss, one answer in
    thirty ran into a 400-token limit mid-call (finish_reason length)."""
    time_zone = {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}
    spec = json.dumps(tool_tag(None, stop_after_first=False, tools=(("get_weather", CITY), ("get_time", time_zone))))
    for seed in range(300):
        answer = generator.generate(StructuredOutputsParams("structural_tag", spec), seed, 400, EOS)
        assert answer.ended, (seed, tokenizer.decode(answer.token_ids[:200]))


def test_the_older_structural_tag_of_triggers_and_structures_is_read(generator, tokenizer):
    tag = {"triggers": ["<f="], "structures": [{"begin": "<f=get>", "schema": CITY, "end": "</f>"}]}
    texts = [tokenizer.decode(a.token_ids[:-1]) for a in (generator.generate(StructuredOutputsParams("structural_tag", json.dumps(tag)), s, 300, EOS) for s in range(10)) if a.ended]
    assert texts
    for text in texts:
        for call in re.findall(r"<f=get>(.*?)</f>", text, re.S):
            jsonschema.validate(json.loads(call), CITY)


def test_answers_are_deterministic_per_seed(generator):
    first = [generator.generate(params("json", PERSON), seed, 300, EOS) for seed in range(5)]
    assert first == [generator.generate(params("json", PERSON), seed, 300, EOS) for seed in range(5)]
    assert len({a.token_ids for a in first}) == 5


def test_a_limit_cuts_the_answer(generator, tokenizer):
    full = generator.generate(params("json", PERSON), 3, 400, EOS)
    cut = generator.generate(params("json", PERSON), 3, 7, EOS)
    assert full.ended and not cut.ended and len(cut.token_ids) == 7
    assert cut.token_ids == full.token_ids[:7]


def test_the_preferred_source_id_is_taken_where_allowed(generator, tokenizer):
    word = tokenizer.encode("a")[0]
    answer = generator.generate(params("regex", "a{3}"), 1, 20, EOS, prefer=lambda: word)
    assert answer.token_ids == (word, word, word, EOS)


def test_bad_grammars_raise_grammar_error(generator):
    for kind, spec in [("regex", "(["), ("grammar", "start: undefined_rule"), ("json", '{"type": "nonsense"}'), ("json", "not json"),
        ("structural_tag", '{"type": "structural_tag", "format": {"type": "qwen_xml_parameter"}}'),
        ("structural_tag", '{"type": "structural_tag", "format": {"type": "tag", "begin": 5}}'),
        ("structural_tag", '{"triggers": ["<f"], "structures": [{"begin": "<g>", "schema": {}, "end": "</g>"}]}'),
    ]:
        with pytest.raises(structured_output.GrammarError):
            generator.generate(StructuredOutputsParams(kind, spec), 0, 10, EOS)


def test_one_generator_per_tokenizer(generator, tokenizer):
    assert structured_output.for_tokenizer(tokenizer) is generator
    assert generator.ll_tokenizer.vocab_size >= tokenizer.vocab_size


def test_compiled_grammars_are_cached_and_bounded(generator, monkeypatch):
    monkeypatch.setattr(structured_output, "GRAMMAR_CACHE", 3)
    generator._matchers.clear()
    for n in range(5):
        generator.matcher(params("regex", f"a{{{n + 1}}}"))
    assert len(generator._matchers) == 3
    template = generator._matchers[params("regex", "a{5}"), structured_output.DEFAULT_LIMITS]
    assert generator.matcher(params("regex", "a{5}")) is not template  # a copy per request


# -- the engine ----------------------------------------------------------------


def structured_request(rid, kind, spec, max_tokens=300, **kw):
    kw.setdefault("eos_token_id", EOS)
    kw.setdefault("all_stop_token_ids", (EOS,))
    return EngineCoreRequest(rid, 4, max_tokens, True, structured_outputs=params(kind, spec), **kw)


def finish_of(sent, rid):
    return outputs_of(sent, rid)[-1][5]


def test_engine_answers_a_schema_and_stops_with_eos(model, tokenizer):
    engine = engine_with(vocab_size=VOCAB, tokenizer=str(model), output_token_chunk_size=4)
    for n in range(6):
        engine.apply(structured_request(f"s{n}", "json", PERSON))
    sent = run(engine)
    for n in range(6):
        tokens = tokens_of(sent, f"s{n}")
        assert finish_of(sent, f"s{n}") == FinishReason.STOP and tokens[-1] == EOS
        jsonschema.validate(json.loads(tokenizer.decode(tokens)), PERSON)
        assert len(outputs_of(sent, f"s{n}")[-1]) == 6  # no stop_reason for EOS


def test_engine_cuts_a_long_answer_with_length(model, tokenizer):
    engine = engine_with(vocab_size=VOCAB, tokenizer=str(model))
    engine.apply(structured_request("s", "json", PERSON, max_tokens=5))
    sent = run(engine)
    tokens = tokens_of(sent, "s")
    assert finish_of(sent, "s") == FinishReason.LENGTH and len(tokens) == 5
    text = tokenizer.decode(tokens)
    assert '{"name":"'.startswith(text) or text.startswith('{"name":"'), text


def test_ignore_eos_fills_with_eos_after_the_answer(model, tokenizer):
    engine = engine_with(vocab_size=VOCAB, tokenizer=str(model))
    engine.apply(structured_request("s", "choice", ["yes", "no"], max_tokens=12, ignore_eos=True))
    sent = run(engine)
    tokens = tokens_of(sent, "s")
    assert finish_of(sent, "s") == FinishReason.LENGTH and len(tokens) == 12
    assert tokenizer.decode(tokens) in ("yes", "no") and tokens[-1] == EOS


def test_engine_answers_the_same_for_the_same_seed(model):
    def answer(seed):
        engine = engine_with(vocab_size=VOCAB, tokenizer=str(model), seed=seed)
        engine.apply(structured_request("s", "json", PERSON))
        return tokens_of(run(engine), "s")

    assert answer(1) == answer(1) and answer(1) != answer(2)


def test_structured_request_with_logprobs_gets_rows(model, tokenizer):
    engine = engine_with(vocab_size=VOCAB, tokenizer=str(model), output_token_chunk_size=3)
    engine.apply(structured_request("s", "regex", "[a-z]{4,6}", logprobs=2))
    sent = run(engine)
    outputs = outputs_of(sent, "s")
    tokens = tokens_of(sent, "s")
    assert re.fullmatch("[a-z]{4,6}", tokenizer.decode(tokens[:-1])) and tokens[-1] == EOS
    rows = 0
    for output in outputs:
        if output[1]:
            logprobs = output[2]
            assert logprobs is not None
            ids = logprobs[0]
            rows += len(ids) // 4 if isinstance(ids, (bytes, bytearray)) else len(ids)
    assert rows >= len(tokens)  # (one row per token, each k + 1 wide)


def test_a_bad_grammar_ends_that_request_with_error_and_the_engine_serves_on(model):
    engine = engine_with(vocab_size=VOCAB, tokenizer=str(model))
    [(_, message)] = engine.apply(structured_request("bad", "regex", "(["))
    output = message[1][0]
    assert output[5] == FinishReason.ERROR and "regex" in output[18]["message"]
    engine.apply(structured_request("good", "regex", "[0-9]{3}"))
    sent = run(engine)
    assert finish_of(sent, "good") == FinishReason.STOP
    assert engine.ledger.summary()["finished_error"] == 1


def test_without_tokenizer_the_tokens_stay_random_and_a_warning_says_why(caplog_loguru=None):
    engine = engine_with(vocab_size=VOCAB)
    warnings = []
    engine.throttle.warning = lambda kind, message, *args, **kw: warnings.append(message.format(*args))
    engine.apply(structured_request("s", "json", PERSON, max_tokens=9))
    sent = run(engine)
    assert len(tokens_of(sent, "s")) == 9 and finish_of(sent, "s") == FinishReason.LENGTH
    assert any("--tokenizer" in w for w in warnings)


BOOKING = {  # strict: every property required, bounded, patterned
    "type": "object",
    "properties": {"people": {"type": "integer", "minimum": 1, "maximum": 12},
                   "time": {"type": "string", "pattern": "^([01][0-9]|2[0-3]):[0-5][0-9]$"}},
    "required": ["people", "time"], "additionalProperties": False,
}  # fmt: skip


@pytest.mark.parametrize("kind, spec, budget", [("json_object", "", 24), ("json", {"type": "object"}, 24), ("json", BOOKING, 24)])
def test_an_answer_that_may_end_within_a_small_budget_does(generator, kind, spec, budget):
    # a small max_tokens, a think block before it or not: an answer whose
    # grammar can end that soon winds down as the budget runs out, not cut by
    # LENGTH (an answer its grammar makes longer is cut: test_a_limit_cuts_the_answer)
    cut = [seed for seed in range(200) if not generator.generate(params(kind, spec), seed, budget, EOS).ended]
    assert not cut, f"{len(cut)} of 200 answers cut at {budget} ids (seeds {cut[:5]})"


def test_a_regex_digit_is_an_ascii_digit(tmp_path):
    # `\d` as xgrammar and JSON Schema read it: 0-9 (llguidance's own is any
    # Unicode digit; the full vocabulary the frontends' model dir has holds such tokens)
    tokenizer = load_tokenizer(str(model_dir.write_model_dir(tmp_path / "model", vocab_size=32000)))
    generator = structured_output.for_tokenizer(tokenizer)
    texts = [tokenizer.decode(generator.generate(params("regex", r"\d{4}-\d{2}-\d{2}"), seed, 40, tokenizer.eos_token_id).token_ids[:-1])
             for seed in range(100)]
    assert all(re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", text) for text in texts), [t for t in texts if not re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", t)][:3]
    # the same regex inside the structural tag vllm-rs sends with a reasoning parser (a think
    # block first, then the regex: tests/data/frontend_constraints.json, rust-reasoning)
    tag = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "optional", "content": {"type": "sequence", "elements": [
            {"type": "tag", "begin": "<think>", "content": {"type": "any_text", "excludes": [], "max_chars": None, "max_tokens": None},
             "end": "</think>"}, {"type": "const_string", "value": "\n\n"}]}},
        {"type": "regex", "pattern": r"\d{4}-\d{2}-\d{2}"}]}}  # fmt: skip
    tagged = [tokenizer.decode(generator.generate(params("structural_tag", tag), seed, 400, tokenizer.eos_token_id).token_ids[:-1])
              for seed in range(100)]
    answers = [text.rsplit("</think>\n\n", 1)[-1] for text in tagged]
    assert all(re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", a) for a in answers), [a for a in answers if not re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", a)][:3]
    assert structural_tag.ascii_digits(r"[\d-]\D\\d") == r"[0-9-][^0-9]\\d"
