"""Structured outputs: a request's whole answer generated at plan time, pure.

A request with `structured_outputs` (docs/protocol.md §3.3; the frontends
turn `response_format`, `tool_choice` required/named and `guided_*` into
it) must answer text its client parses. With `--tokenizer`, the engine
compiles its constraint with llguidance (vLLM's `guidance` backend, the
same calls as vLLM's backend_guidance.py) and walks the matcher token by
token once, when the request is planned (`generate`): the ids become the
request's recorded token source (tokens.RecordedTokens, as a replayed
request's), so the per-token path of every request stays what it is.

Each step, first match wins: the matcher's forced tokens; with a
probability that rises with the answer's length, the end where the grammar
may end, or a closer it allows (`}`, `]`, `)`, `"`, `,`, `>`; no opener), so
that an ordinary schema's answer ends by itself; the request's token source's next id when the matcher
allows it (a `text` source makes strings read like text); else a random
allowed id, found from a random byte of the bitmask by a bytes regex (never
a loop over the vocabulary). The random choices come from the request's
seed (tokens.request_seed), so an answer is the same for the same seed and
request id. JSON is generated compact (no whitespace between tokens): valid
under vLLM's default flexible whitespace too.

Compiled grammar texts are cached per constraint (LRU, GRAMMAR_CACHE), the
llguidance tokenizer once per tokenizer, a compiled matcher per grammar
(each request deep-copies it). Pure: neither gevent nor zmq.
"""

from __future__ import annotations

import json
import random
import re
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

from gmock_engine.content import structural_tag
from gmock_engine.content.sampler import Sampler
from gmock_engine.content.tokenizer import Tokenizer, require
from gmock_engine.content.tokens import RecordedTokens, request_seed
from gmock_engine.wire.inputs import EngineCoreRequest, StructuredOutputsParams
from gmock_engine.wire.types import BadValue, FinishReason

#: Compiled matchers kept per tokenizer (one per constraint); the least recently used goes first.
GRAMMAR_CACHE = 256
#: At most this many tokens are generated for one answer (--grammar-max-tokens):
#: an answer whose grammar has not ended by then, and whose request may run
#: longer, ends the request with an error naming the limit.
MAX_GENERATED = 4096
#: Rules a grammar (a Lark or GBNF text) may have (--grammar-max-rules): a
#: deep chain of a few thousand rules overflows llguidance's stack while it
#: compiles (the whole process dies), so a longer grammar is refused first.
MAX_RULES = 2000
#: Schema nodes on one path of a JSON schema, its local `$ref`s followed
#: (--grammar-max-depth): llguidance overflows its stack on a chain of about
#: two thousand (the process dies); the frontends bound only the nesting of
#: the text, which a `$ref` chain does not have.
MAX_DEPTH = 500
#: llguidance's max_items_in_row (--grammar-max-items): alternatives a parser
#: row may hold (a `choice` of that many items); past it the matcher stops.
#: llguidance's own default is 2000; vLLM's default backend, xgrammar, has no
#: such limit, so the mock allows more.
MAX_ITEMS = 10000
#: The probability of closing is CLOSE_BASE + (ids chosen so far) / CLOSE_SCALE.
CLOSE_BASE = 0.04
CLOSE_SCALE = 48.0
#: Where the grammar may end, the answer ends with this much more
#: probability than it closes a structure (a model that may stop mostly
#: does: one tool call, not a chain of them).
ACCEPT_BONUS = 0.5
#: Ids left before the limit, beyond two per open structure, from which the
#: answer ends where its grammar may and closes where it can: an answer that may not end by `max_tokens`
#: (a think block before it takes its share) winds down in time, as a
#: model told its budget does, instead of ending cut off with LENGTH.
WIND_DOWN = 12
#: Random bytes of a bitmask probed for an allowed id before its nonzero bytes are listed.
PROBES = 8
#: At most this many nonzero bytes are listed to pick one uniformly.
LISTED_BYTES = 64
#: First characters of the tokens that open a nesting.
OPENERS = "([{"
#: Texts of the closers, in the order they are tried (after the grammar's end, where it may end).
#: `>` ends a tag (`</tool_call>`): without it, where a tokenizer also has
#: `><`, a tag's last character is a coin toss between ending the answer's
#: last tag and opening another, whatever the closing probability.
CLOSERS = ("}", "]", ")", '"', ",", ">")

_NONZERO = re.compile(rb"[^\x00]")
#: the set bits of each byte value
_BITS: Tuple[Tuple[int, ...], ...] = tuple(tuple(bit for bit in range(8) if value >> bit & 1) for value in range(256))


class GrammarError(BadValue):
    """A constraint that does not compile (vLLM: the request's grammar
    future fails and the scheduler ends it with FINISHED_ERROR)."""


@dataclass(frozen=True)
class GrammarLimits:
    """What the engine compiles and generates at most (--grammar-max-tokens,
    --grammar-max-rules, --grammar-max-items): a constraint past one ends
    its request with an error naming it, never with an answer outside it."""

    max_tokens: int = MAX_GENERATED
    max_rules: int = MAX_RULES
    max_items: int = MAX_ITEMS
    max_depth: int = MAX_DEPTH


DEFAULT_LIMITS = GrammarLimits()
#: A Lark rule (`name:`, `?name:`, `name.2:`) or a GBNF one (`name ::=`) at a line's start.
_RULE = re.compile(r"^[ \t]*[?!]?[A-Za-z_][\w-]*(?:\.-?\d+)?[ \t]*(?::(?!:)|::=)", re.M)


def _check_rules(text: str, limits: GrammarLimits) -> None:
    rules = len(_RULE.findall(text))
    if rules > limits.max_rules:
        raise GrammarError(f"the grammar has {rules} rules, more than the engine's limit of {limits.max_rules} (--grammar-max-rules)")


class _TooDeep(Exception):
    pass


def _check_depth(schema: Any, limits: GrammarLimits) -> None:
    """GrammarError when a path through `schema`, its local `$ref`s followed
    (a ref back to a schema on the path counts nothing: recursion is fine),
    holds more than limits.max_depth schema nodes."""
    root = schema
    memo: Dict[str, int] = {}
    on_path: set = set()
    most = limits.max_depth

    def resolve(ref: str) -> Any:
        node = root
        for part in ref[2:].split("/") if ref.startswith("#/") else ():
            node = node.get(part.replace("~1", "/").replace("~0", "~")) if isinstance(node, dict) else None
        return node if ref.startswith("#") else None

    def depth(node: Any, at: int) -> int:
        if at > most:
            raise _TooDeep
        if isinstance(node, list):
            return max((depth(item, at) for item in node), default=0)
        if not isinstance(node, dict):
            return 0
        deepest = 0
        ref = node.get("$ref")
        if isinstance(ref, str) and ref not in on_path:
            if ref not in memo:
                on_path.add(ref)
                memo[ref] = depth(resolve(ref), at + 1)
                on_path.discard(ref)
            deepest = memo[ref]
            if at + deepest > most:
                raise _TooDeep
        for key, value in node.items():
            if key not in ("$ref", "enum", "const", "required", "examples", "default") and isinstance(value, (dict, list)):
                deepest = max(deepest, depth(value, at + 1))
        return deepest + 1

    try:
        depth(schema, 0)
    except (_TooDeep, RecursionError):
        raise GrammarError(f"the JSON schema nests (through its $refs) deeper than the engine's limit of {most} "
                           "(--grammar-max-depth)") from None  # fmt: skip


def _schemas_in(tag: Any) -> List[Any]:
    """The JSON schemas of a structural tag (`json_schema` of a format, `schema` of the older form)."""
    found: List[Any] = []
    stack = [tag]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            for key, value in node.items():
                if key in ("json_schema", "schema") and isinstance(value, dict):
                    found.append(value)
                elif isinstance(value, (dict, list)):
                    stack.append(value)
        elif isinstance(node, list):
            stack.extend(node)
    return found


def _failure(matcher: Any, limits: GrammarLimits) -> str:
    """Why a matcher stopped in error, in a line that names the limit it hit."""
    lines = matcher.get_error().splitlines()
    stop = next((line[5:].strip() for line in lines if line.startswith("Stop:")), "")
    error = next((line[6:].strip() for line in lines if line.startswith("Error:")), "")
    if stop == "NoExtensionBias" and not matcher.is_accepting():
        return "the constraint accepts no answer: its language is empty (vLLM's engine ends such a request with an error)"
    if stop == "ParserTooComplex" or "max is" in error:
        return f"the constraint is too large for the grammar backend ({error[:200]}; --grammar-max-items is {limits.max_items})"
    return f"the grammar backend stopped: {stop} {error}"[:300]


@dataclass(frozen=True)
class Answer:
    """A generated answer: its ids (with the EOS id last when `ended` and an
    EOS was given) and whether the grammar ended within the limit."""

    token_ids: Tuple[int, ...]
    ended: bool


def grammar_text(params: StructuredOutputsParams, limits: GrammarLimits = DEFAULT_LIMITS) -> str:
    """The llguidance grammar of a constraint, as vLLM's
    serialize_guidance_grammar makes it (compact JSON whitespace);
    GrammarError for a spec llguidance cannot read."""
    llguidance = require("llguidance", "structured outputs")
    kind, spec = params.kind, params.spec
    compact = {"whitespace_flexible": False}
    if kind == "grammar":
        _check_rules(spec, limits)
    try:
        if kind == "json":
            schema: Any = json.loads(spec)
            _check_depth(schema, limits)
            # none but the properties a schema names (vLLM's disable_additional_properties)
            structural_tag.no_additional_properties(schema)
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=compact)
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=compact)
        if kind == "structural_tag":
            tag = json.loads(spec)
            for schema in _schemas_in(tag):
                _check_depth(schema, limits)
            if structural_tag.is_xgrammar_format(tag):
                return llguidance.LLMatcher.grammar_from_lark(structural_tag.to_lark(tag))
            return _structural_tag(llguidance, tag, compact)
        if kind == "regex":
            spec = structural_tag.ascii_digits(spec)
        return llguidance.grammar_from({"regex": "regex", "choice": "choice", "grammar": "grammar"}[kind], spec)
    except GrammarError:
        raise
    except (ValueError, KeyError, TypeError, RecursionError) as exc:
        raise GrammarError(f"Invalid grammar specification: {str(exc)[:300]}") from None


def _structural_tag(llguidance: Any, tag: Any, compact: Dict[str, Any]) -> str:
    """A structural tag (triggers and structures) as vLLM's guidance backend reads it."""
    if not isinstance(tag, dict) or not isinstance(tag.get("triggers"), list) or not isinstance(tag.get("structures"), list):
        raise GrammarError("Invalid grammar specification: a structural tag needs triggers and structures")
    tags = []
    for structure in tag["structures"]:
        begin = structure["begin"]
        trigger = next((t for t in tag["triggers"] if begin.startswith(t)), None)
        if trigger is None:
            raise GrammarError(f"Trigger {begin} not found in triggers {tag['triggers']}")
        grammar = llguidance.LLMatcher.grammar_from_json_schema(structure["schema"], defaults=compact)
        tags.append(llguidance.StructTag(trigger=trigger, begin=begin, grammar=grammar, end=structure["end"]))
    if not tags:
        raise GrammarError("No structural tags found in the grammar spec.")
    return llguidance.StructTag.to_grammar(tags)


def _plain_added_tokens(json_text: str) -> str:
    """tokenizer.json without its added tokens that are not special (a
    ChatML model's `<tool_call>`, `<think>`): llguidance takes every added
    token for a special one, which its grammars' text never matches (its
    mask may still offer one that spells forced text, which it then
    refuses). Without them such text is spelled by ordinary tokens: the
    same text for the frontends' decoders and tool parsers."""
    data = json.loads(json_text)
    added = data.get("added_tokens")
    if not isinstance(added, list) or all(not isinstance(t, dict) or t.get("special", True) for t in added):
        return json_text
    data["added_tokens"] = [t for t in added if not isinstance(t, dict) or t.get("special", True)]
    return json.dumps(data)


def _openers(json_text: str) -> frozenset:
    """The ids of tokenizer.json's vocabulary whose text starts with one of
    OPENERS (a BPE or WordPiece map of text to id, or a Unigram list)."""
    vocab = json.loads(json_text).get("model", {}).get("vocab")
    if isinstance(vocab, dict):
        return frozenset(i for text, i in vocab.items() if text[:1] in OPENERS)
    if isinstance(vocab, list):
        return frozenset(i for i, entry in enumerate(vocab) if isinstance(entry, list) and entry and str(entry[0])[:1] in OPENERS)
    return frozenset()


class StructuredOutputs:
    """One tokenizer's generator (one per tokenizer and process: `for_tokenizer`):
    its llguidance tokenizer, the closers' ids, the compiled matchers."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        llguidance = require("llguidance", "structured outputs")
        self._llguidance = llguidance
        self.tokenizer = tokenizer
        self.ll_tokenizer = llguidance.LLTokenizer(_plain_added_tokens(tokenizer.json_text), n_vocab=tokenizer.vocab_size, eos_token=tokenizer.eos_token_id)
        self.eos = self.ll_tokenizer.eos_token
        closers = [token for token in (self._single(tokenizer, text) for text in CLOSERS) if token >= 0]
        self.closers = tuple(closers)
        #: ids whose text opens a nesting (`(`, `[`, `{` first), avoided when closing
        self.openers = _openers(tokenizer.json_text)
        #: `"` and `,` (-1: not one token): both allowed means inside a string
        self.quote, self.comma = self._single(tokenizer, '"'), self._single(tokenizer, ",")
        #: (grammar spec, limits) -> a compiled matcher, deep-copied per request
        self._matchers: "OrderedDict[Tuple[StructuredOutputsParams, GrammarLimits], Any]" = OrderedDict()
        #: grammars compiled so far (the cache's misses; a hit leaves it as it is)
        self.compiles = 0

    @staticmethod
    def _single(tokenizer: Tokenizer, text: str) -> int:
        ids = tokenizer.encode(text)
        return ids[0] if len(ids) == 1 else -1

    def _in_string(self, mask: bytes) -> bool:
        """Inside a JSON string: `"` ends it and `,` is one of its characters
        (outside, no place allows both); `}` or `]` there would only lengthen it."""
        quote, comma = self.quote, self.comma
        return quote >= 0 and comma >= 0 and bool(mask[quote >> 3] >> (quote & 7) & 1) and bool(mask[comma >> 3] >> (comma & 7) & 1)

    def matcher(self, params: StructuredOutputsParams, limits: GrammarLimits = DEFAULT_LIMITS) -> Any:
        """A fresh matcher for `params` (its compiled template cached); GrammarError when it does not compile."""
        key = (params, limits)
        template = self._matchers.get(key)
        if template is None:
            self.compiles += 1
            llguidance = self._llguidance
            template = llguidance.LLMatcher(self.ll_tokenizer, grammar_text(params, limits), log_level=0,
                                            limits=llguidance.LLParserLimits(max_items_in_row=limits.max_items))  # fmt: skip
            if template.is_error():
                raise GrammarError(f"Grammar error: {template.get_error()[:300]}")
            if len(self._matchers) >= GRAMMAR_CACHE:
                self._matchers.popitem(last=False)
            self._matchers[key] = template
        else:
            self._matchers.move_to_end(key)
        return template.deep_copy()

    @staticmethod
    def _random_allowed(mask: bytes, rng: random.Random) -> int:
        """A random id the bitmask allows (-1: none), without a loop over the
        vocabulary: a few random bytes probed first (a mask that allows much,
        such as inside a string, is done then); else, when few bytes are
        nonzero (counted in C), one of them listed by a bytes regex; else
        the first nonzero byte from a random one (its bias toward ids after
        a gap is mild when many are allowed). Then a random id of that byte."""
        size = len(mask)
        randrange = rng.randrange
        for _ in range(PROBES):
            at = randrange(size)
            if mask[at]:
                break
        else:
            nonzero = size - mask.count(0)
            if not nonzero:
                return -1
            if nonzero <= LISTED_BYTES:
                found = [m.start() for m in _NONZERO.finditer(mask)]
                at = found[randrange(len(found))]
            else:
                at = (_NONZERO.search(mask, randrange(size)) or _NONZERO.search(mask)).start()  # type: ignore[union-attr]
        choices = _BITS[mask[at]]
        return at * 8 + choices[randrange(len(choices))]

    def generate(
        self,
        params: StructuredOutputsParams,
        seed: int,
        limit: int,
        eos: Optional[int],
        prefer: Optional[Callable[[], int]] = None,
        limits: GrammarLimits = DEFAULT_LIMITS,
    ) -> Answer:
        """An answer of at most `limit` ids (MAX_GENERATED at most) that the
        constraint accepts: `ended` when the grammar came to its end within
        the limit (then the last id is `eos` when given). `prefer()` gives
        the request's token source's next id, taken when the matcher allows
        it. GrammarError when the constraint does not compile, accepts no
        answer, or stops the backend (a limit), and when the answer reaches
        `limits.max_tokens` (below `limit`) before its grammar ends."""
        matcher = self.matcher(params, limits)
        rng = random.Random(seed)
        chance = rng.random
        closers, quote, in_string, openers = self.closers, self.quote, self._in_string, self.openers
        ids: List[int] = []
        chosen = 0  # ids chosen, not forced: what the closing probability grows with
        depth = 0  # structures opened and not closed, counted by their opening and closing ids
        closer_ids = frozenset(closers)
        asked, limit = limit, min(limit, limits.max_tokens)
        ended = False
        while len(ids) < limit:
            if matcher.is_stopped():
                ended = True
                break
            forced = matcher.compute_ff_tokens()
            if forced:
                forced = forced[: limit - len(ids)]
                taken = matcher.try_consume_tokens(forced)
                if taken:
                    ids += forced[:taken]
                    continue
            mask = matcher.compute_bitmask()
            token = -1
            chosen += 1
            roll = chance()
            closing = CLOSE_BASE + chosen / CLOSE_SCALE
            if limit - len(ids) <= WIND_DOWN + 2 * depth:
                closing = 1.0  # the limit is near (an id kept for EOS): end where the grammar may, else close
            if roll < closing + ACCEPT_BONUS and matcher.is_accepting():
                ended = True
                break
            if roll < closing:
                if in_string(mask):
                    token = quote
                else:
                    for closer in closers:
                        if mask[closer >> 3] >> (closer & 7) & 1:
                            token = closer
                            break
            if token < 0 and prefer is not None:
                wanted = prefer()
                if 0 <= wanted < len(mask) * 8 and mask[wanted >> 3] >> (wanted & 7) & 1:
                    token = wanted
            if token < 0:
                token = self._random_allowed(mask, rng)
                if token < 0:  # nothing allowed: the grammar can only end
                    ended = matcher.is_accepting()
                    break
                if roll < closing and token in openers:
                    # closing time: no new nesting, where the grammar has another way
                    for _ in range(PROBES):
                        token = self._random_allowed(mask, rng)
                        if token not in openers:
                            break
            if token == self.eos:
                ended = True
                break
            if not matcher.consume_token(token):
                break  # (an allowed id is always consumed; a matcher error ends the answer)
            ids.append(token)
            if token in openers:
                depth += 1
            elif token in closer_ids and depth:
                depth -= 1
        if matcher.is_error():
            # a stopped matcher's mask allows only EOS: without this, a
            # constraint past a backend limit would end as an empty answer
            raise GrammarError(_failure(matcher, limits))
        if not ended and len(ids) >= limit and asked > limit:
            raise GrammarError(f"the structured answer reached the engine's limit of {limits.max_tokens} generated tokens "
                               "(--grammar-max-tokens) before its grammar ended")  # fmt: skip
        if ended and eos is not None:
            if len(ids) < limit:
                ids.append(eos)
            else:
                ended = False
        return Answer(tuple(ids), ended)


_generators: Dict[str, StructuredOutputs] = {}


def for_tokenizer(tokenizer: Tokenizer) -> StructuredOutputs:
    """The generator of `tokenizer`, built once per process (its llguidance
    tokenizer takes a fraction of a second to build)."""
    known = _generators.get(tokenizer.path)
    if known is None or known.tokenizer is not tokenizer:
        known = _generators[tokenizer.path] = StructuredOutputs(tokenizer)
    return known


class RepeatToken:
    """A token source of one id, for ever: what follows an answer whose
    grammar ended when EOS does not stop the request (ignore_eos, or no EOS
    id named), as a real engine's bitmask then allows only EOS."""

    __slots__ = ("token",)

    def __init__(self, token: int) -> None:
        self.token = token

    def initial_state(self, request_id: str, prompt_token_ids: Any = None) -> int:
        return 0

    def draw(self, state: int, n: int) -> Tuple[List[int], int]:
        return [self.token] * n, state

    def only_emits(self, state: int, ids: Any) -> bool:
        return self.token in ids

    def avoid(self, tokens: List[int], ids: Any) -> List[int]:
        return tokens


#: xor'ed into the request seed: its answer's choices are not its length model's
_SEED_SALT = 0x5EED5EED5EED5EED


def answer_for(request: Any, generator: StructuredOutputs, params: StructuredOutputsParams, seed: int, limit: int,
               eos: Optional[int], limits: GrammarLimits = DEFAULT_LIMITS) -> Tuple[Answer, Any]:  # fmt: skip
    """`generator.generate` for a planned request, preferring its token
    source's ids from its position on; the answer, and the source's state
    after the ids it drew."""
    draw = request.sampler.tokens.draw
    state = [request.rng_state]

    def prefer() -> int:
        ids, state[0] = draw(state[0], 1)
        return ids[0]

    answer = generator.generate(params, seed, limit, eos, prefer, limits)
    return answer, state[0]


def follow(request: Any, core_request: EngineCoreRequest, tokenizer: Tokenizer, seed: int, rank: int, cap: int,
           limits: GrammarLimits = DEFAULT_LIMITS, params: Optional[StructuredOutputsParams] = None) -> None:  # fmt: skip
    """Make a planned request (request.plan) answer its structured-output
    constraint: its whole answer generated now (at most `cap` ids: its
    max_tokens cut to max_model_len) becomes its recorded token source. The
    grammar ending within the cap with an EOS that stops it: STOP with the
    EOS id as last token (stop_reason None); else LENGTH at the cap, the
    answer cut there (past an ended grammar: the EOS id repeated, as a real
    engine's bitmask allows nothing else). An ERROR end the plan chose
    (vllm_xargs mock_fail_after) stays. GrammarError when the constraint
    does not compile, or past a limit: the request is to be answered with
    ERROR. `params`: the constraint to follow, when not the request's own
    (its tool calls' arguments pinned, tool_calls.py)."""
    params = params or core_request.structured_outputs
    generator = for_tokenizer(tokenizer)
    eos = core_request.eos_token_id
    stops = eos is not None and not core_request.ignore_eos
    sampler = request.sampler
    source = sampler.tokens
    answer, after = answer_for(request, generator, params, request_seed(seed, rank, request.request_id) ^ _SEED_SALT, cap,
                               eos if stops else None, limits)  # fmt: skip
    ids = answer.token_ids
    fallback: Any = source
    if answer.ended and stops:
        finish, length = FinishReason.STOP, len(ids)
    else:
        finish, length = FinishReason.LENGTH, cap
        if answer.ended:
            fallback = RepeatToken(generator.eos if eos is None else eos)
    if request.finish is FinishReason.ERROR:
        length = min(length, request.max_tokens)
    else:
        request.finish = finish
    request.max_tokens = length
    request.stop_reason = request.last_token = None
    request.sampler = Sampler(RecordedTokens(ids, fallback), sampler.logprobs)
    request.rng_state = (0, after if fallback is source else 0)
    request.stop_ids = request.pool = request.alternatives = request.banned = None
    request.forced = request.shaped = False
