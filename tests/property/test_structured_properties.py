"""Structured outputs (content/structured_output.py) over random constraints: for a
random JSON schema (nested objects with required and optional properties,
arrays, enums, bounded numbers and strings) or a random regex (classes,
literals, groups, alternation, quantifiers), with a random seed and token
limit, an answer that ended (the grammar's end, then EOS) is valid: it
validates against the schema / fullmatches the regex; an answer that did
not is cut at exactly the limit; and the same seed gives the same answer."""

import json
import re
import string

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from engine_driver import examples

from gmock_engine.content import structured_output
from gmock_engine.content.tokenizer import load_tokenizer
from gmock_engine.tools import model_dir
from gmock_engine.wire.inputs import StructuredOutputsParams

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

VOCAB = 4000
EOS = VOCAB - 1
_generator = []


def generator():
    """One generator for the module (a tokenizer of the model dir, written once)."""
    if not _generator:
        import tempfile

        path = model_dir.write_model_dir(tempfile.mkdtemp(prefix="gmock-structured-"), vocab_size=VOCAB)
        tokenizer = load_tokenizer(str(path))
        _generator.append((structured_output.for_tokenizer(tokenizer), tokenizer))
    return _generator[0]


NAMES = st.text(alphabet=string.ascii_lowercase + "_", min_size=1, max_size=8)
LEAVES = st.one_of(
    st.just({"type": "string"}),
    st.integers(0, 20).map(lambda n: {"type": "string", "maxLength": n}),
    st.tuples(st.integers(-1000, 1000), st.integers(0, 1000)).map(lambda t: {"type": "integer", "minimum": t[0], "maximum": t[0] + t[1]}),
    st.just({"type": "number"}),
    st.tuples(st.integers(-50, 50), st.integers(1, 100)).map(lambda t: {"type": "number", "minimum": t[0], "maximum": t[0] + t[1]}),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.lists(st.text(alphabet=string.ascii_letters + " ,.", min_size=1, max_size=10), min_size=1, max_size=4, unique=True).map(lambda v: {"enum": v}),
)


def _object(children):
    return st.dictionaries(NAMES, children, min_size=1, max_size=4).flatmap(
        lambda props: st.lists(st.sampled_from(sorted(props)), unique=True).map(lambda req: {"type": "object", "properties": props, "required": req})
    )


def _array(children):
    return st.tuples(children, st.integers(0, 2), st.integers(0, 3)).map(lambda t: {"type": "array", "items": t[0], "minItems": t[1], "maxItems": t[1] + t[2]})


SCHEMAS = st.recursive(LEAVES, lambda children: st.one_of(_object(children), _array(children)), max_leaves=10)

ATOMS = st.one_of(
    st.sampled_from(["a", "b", "x", "0", "7", "-", "_", "\\.", "@"]),
    st.sampled_from(["[a-z]", "[0-9]", "[A-F0-9]", "[xyz]", "[^a-z\\n]"]),
)
QUANTIFIERS = st.sampled_from(["", "", "?", "*", "+", "{2}", "{1,3}", "{0,2}"])


def _regex(children):
    return st.one_of(
        st.lists(children, min_size=1, max_size=4).map("".join),
        st.lists(children, min_size=2, max_size=3).map(lambda parts: "(" + "|".join(parts) + ")"),
        st.tuples(children, QUANTIFIERS).map(lambda t: f"({t[0]}){t[1]}"),
    )


REGEXES = st.recursive(st.tuples(ATOMS, QUANTIFIERS).map("".join), _regex, max_leaves=8)


def _answer(params, seed, limit):
    gen, tokenizer = generator()
    answer = gen.generate(params, seed, limit, EOS)
    assert gen.generate(params, seed, limit, EOS) == answer  # deterministic
    ids = answer.token_ids
    if answer.ended:
        assert ids and ids[-1] == EOS and EOS not in ids[:-1]
        return tokenizer.decode(ids[:-1]), True
    assert len(ids) == limit or limit > structured_output.MAX_GENERATED, (len(ids), limit)
    return tokenizer.decode(ids), False


@settings(max_examples=examples(80))
@given(SCHEMAS, st.integers(0, 2**32), st.integers(1, 300))
def test_a_json_answer_that_ended_validates(schema, seed, limit):
    text, ended = _answer(StructuredOutputsParams("json", json.dumps(schema)), seed, limit)
    if ended:
        jsonschema.validate(json.loads(text), schema)


@settings(max_examples=examples(80))
@given(REGEXES, st.integers(0, 2**32), st.integers(1, 120))
def test_a_regex_answer_that_ended_fullmatches(regex, seed, limit):
    text, ended = _answer(StructuredOutputsParams("regex", regex), seed, limit)
    if ended:
        assert re.fullmatch(regex, text), (regex, text)
