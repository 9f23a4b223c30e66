"""What an answer holds beyond its tokens: tool calls and reasoning, pure.

Both need the served model's tokenizer (`--tokenizer`) and are decided when
a request is planned, after its length (request.plan) and its structured
output (structured_output.follow):

* **Tool calls** (`tool_choice` auto, the frontend's
  `--enable-auto-tool-choice --tool-call-parser hermes`): the frontend
  renders the request's tools into the prompt, as Qwen2.5's chat template
  does (`<tools>` … one JSON object per line … `</tools>`, and the
  instruction to answer within `<tool_call></tool_call>`). A request whose
  prompt holds tools answers, for a share of requests (`--tool-call-rate`,
  per request `vllm_xargs` `mock_tool_call`), with one call in the hermes
  format, `<tool_call>\\n{"name": …, "arguments": …}\\n</tool_call>` and
  EOS, its arguments generated against the tool's parameters schema
  (structured_output.py); otherwise it answers text. A request with a
  structured-output constraint (tool_choice required or named, a
  response_format) keeps that constraint's answer; its tool-call tags
  whose arguments are any JSON get the prompt's tool schemas
  (tool_calls.py).
* **Reasoning** (`--reasoning-parser`): with `--reasoning-rate` above 0
  the engine is a thinking model, as Qwen3: every answer starts with a
  think block, whose parser starts in reasoning and leaves it at
  `</think>`. A share of answers (`--reasoning-rate`, per request
  `mock_reasoning_tokens`) think: `<think>\\n` + `--reasoning-tokens` ids
  of the request's token source + `\\n</think>\\n\\n`, which the
  frontend's parser returns as the reasoning field; the others close an
  empty block, `<think>\\n\\n</think>\\n\\n`. A prompt that closed the
  block already (the chat template with `enable_thinking` false) gets none.
  The answer follows, and the request's length counts the block, as a real
  model's does.
* **Reasoning with a constraint**: a thinking model stands for an engine
  with a reasoning parser, whose structured-output manager applies the
  grammar from the token after `</think>` (vLLM's `enable_in_reasoning`
  false). So the block closes with `</think>` and the constrained answer
  follows at once (no `\n\n` the grammar would not allow, which the
  frontends' qwen3 parsers would pass on as content), and the block is
  shortened (to an empty one at worst) so that the answer fits the
  request's max_tokens.
* **min_tokens**: a structured answer that would end before min_tokens
  ends the request with an error, as vLLM's engine does: there the grammar
  allows only EOS, which min_tokens bans, and the token sampled from
  nothing is one the grammar rejects (FINISHED_ERROR).

The ids come out as the request's recorded token source
(tokens.RecordedTokens): the per-token path stays what it is. The choices
are drawn from the request's seed. Pure: neither gevent nor zmq.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from gmock_engine.content import structured_output, tool_calls
from gmock_engine.content.sampler import Sampler
from gmock_engine.content.tokenizer import ContentUnavailable, Tokenizer, load_tokenizer
from gmock_engine.content.tokens import RecordedTokens, request_seed
from gmock_engine.wire.inputs import EngineCoreRequest, StructuredOutputsParams
from gmock_engine.wire.types import FinishReason

#: The hermes tool-call markers (Qwen2.5's added tokens) and the tools block of its template.
TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
_TOOLS_BLOCK = re.compile(r"<tools>\n(.*?)\n</tools>", re.S)  # not the "within <tools></tools> XML tags" before it
#: xor'ed into the request seed: its content choices are not its answer's
_SEED_SALT = 0xC0A7E27C0A7E27


@dataclass(frozen=True)
class ContentSettings:
    """The shares and lengths of --tool-call-rate, --reasoning-rate, --reasoning-tokens; the grammar limits."""

    tool_call_rate: float = 0.0
    reasoning_rate: float = 0.0
    reasoning_tokens: int = 0
    #: --grammar-max-tokens, --grammar-max-rules, --grammar-max-items
    limits: structured_output.GrammarLimits = structured_output.DEFAULT_LIMITS

    @property
    def active(self) -> bool:
        """Whether any request may get a tool call or a reasoning span (unless its vllm_xargs ask)."""
        return self.tool_call_rate > 0 or (self.reasoning_rate > 0 and self.reasoning_tokens > 0)


@dataclass(frozen=True)
class Tool:
    """One tool of a prompt: its name and its parameters' JSON schema."""

    name: str
    parameters: Dict[str, Any]


class Markers:
    """The ids of one tokenizer's markers, found once."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tool_call_id = tokenizer.token_id(TOOL_CALL_OPEN)
        self.tool_open = tokenizer.encode(TOOL_CALL_OPEN + "\n")
        self.tool_close = tokenizer.encode("\n" + TOOL_CALL_CLOSE)
        self.think_open = tokenizer.encode(THINK_OPEN + "\n")
        self.think_close = tokenizer.encode("\n" + THINK_CLOSE + "\n\n")
        self.think_empty = tokenizer.encode(THINK_OPEN + "\n\n" + THINK_CLOSE + "\n\n")
        # before a constrained answer: the grammar starts right after </think>
        self.think_close_bare = tokenizer.encode("\n" + THINK_CLOSE)
        self.think_empty_bare = tokenizer.encode(THINK_OPEN + "\n\n" + THINK_CLOSE)


_markers: Dict[str, Tuple[Tokenizer, Markers]] = {}


def markers(tokenizer: Tokenizer) -> Markers:
    """The markers of `tokenizer`, once per process."""
    known = _markers.get(tokenizer.path)
    if known is None or known[0] is not tokenizer:
        known = _markers[tokenizer.path] = (tokenizer, Markers(tokenizer))
    return known[1]


def prompt_tools(tokenizer: Tokenizer, prompt_token_ids: Sequence[int]) -> List[Tool]:
    """The tools a chat template rendered into the prompt (Qwen2.5's
    `<tools>` block, one JSON object per line, either {"type": "function",
    "function": {...}} or the function itself); none when the prompt names
    no `<tool_call>` marker (the cheap test first: most prompts have no
    tools) or the block holds nothing readable."""
    tool_call_id = markers(tokenizer).tool_call_id
    if tool_call_id is None or tool_call_id not in prompt_token_ids:
        return []
    found = _TOOLS_BLOCK.search(tokenizer.decode(prompt_token_ids, skip_special_tokens=False))
    if found is None:
        return []
    tools = []
    for line in found.group(1).splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        function = entry.get("function", entry) if isinstance(entry, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            continue
        parameters = function.get("parameters")
        tools.append(Tool(function["name"], parameters if isinstance(parameters, dict) else {"type": "object"}))
    return tools


def _thinking_closed(tokenizer: Tokenizer, prompt_token_ids: Optional[Sequence[int]]) -> bool:
    """Whether the prompt ends by closing a think block (Qwen3's template
    with enable_thinking false): the answer then has none."""
    if not prompt_token_ids:
        return False
    return tokenizer.decode(prompt_token_ids[-8:], skip_special_tokens=False).endswith(THINK_CLOSE + "\n\n")


def call_schema(tool: Tool) -> str:
    """The JSON schema of one hermes call of `tool`: its name, then its arguments."""
    return json.dumps({
        "type": "object",
        "properties": {"name": {"const": tool.name}, "arguments": tool.parameters},
        "required": ["name", "arguments"],
    })  # fmt: skip


def shape(request: Any, core_request: EngineCoreRequest, xargs: Any, settings: Any, rank: int, cap: int) -> Optional[str]:
    """What a planned request's answer holds beyond its tokens: its
    structured output (structured_output.follow), then its tool call and
    reasoning span (`apply`). `xargs`: its checked vllm_xargs; `settings`:
    the engine's EngineSettings; `cap`: the most tokens it may have. None,
    or why it gets none of what it asks for (no --tokenizer, no library): a
    line for the log, the request then answers its source's tokens.
    GrammarError (a BadValue) for a constraint that does not compile."""
    asked = (xargs.tool_call, xargs.reasoning_tokens)
    # without --tokenizer only a request whose vllm_xargs ask is told why it gets none
    wants = asked != (None, None) or (settings.content.active and settings.tokenizer is not None)
    if core_request.structured_outputs is None and not wants:
        return None
    if settings.tokenizer is None:
        return "structured outputs, tool calls and reasoning need --tokenizer (the served model's); answered with the source's tokens"
    try:
        tokenizer = load_tokenizer(settings.tokenizer)
    except ContentUnavailable as exc:
        return str(exc)
    words = (request.sampler.tokens, request.rng_state)  # before a structured answer replaces them
    content = settings.content
    params = core_request.structured_outputs
    if params is not None:
        thinks = thinking(content, asked[1], tokenizer, core_request)
        # the empty block always fits: the answer gets the rest of the cap
        reserve = len(markers(tokenizer).think_empty_bare) if thinks and request.pool is None else 0
        tools = prompt_tools(tokenizer, core_request.prompt_token_ids or ())
        params = tool_calls.pin_arguments(params, {tool.name: tool.parameters for tool in tools})
        if tools:  # tool_choice auto under a tag: a call or text, drawn as without one
            rng = random.Random(request_seed(settings.seed, rank, request.request_id) ^ _SEED_SALT ^ 2)
            params = tool_calls.choose_auto(params, _flag(asked[0], content.tool_call_rate, rng))
        structured_output.follow(request, core_request, tokenizer, settings.seed, rank, max(0, cap - reserve), content.limits, params)
    if wants or (params is not None and reserve):
        apply(request, core_request, tokenizer, content, asked, settings.seed, rank, cap, words)
    if params is not None and request.finish is FinishReason.STOP and request.max_tokens - 1 < core_request.min_tokens:
        raise structured_output.GrammarError(
            f"the constrained answer ends after {request.max_tokens - 1} tokens, before min_tokens {core_request.min_tokens}: "
            "its grammar then allows only EOS, which min_tokens bans (vLLM's engine ends such a request with an error)")
    return None


def thinking(content: ContentSettings, reasoning_tokens: Optional[int], tokenizer: Tokenizer, core_request: EngineCoreRequest) -> bool:
    """Whether the answer opens with a think block: a thinking model
    (--reasoning-rate above 0, or vllm_xargs mock_reasoning_tokens), unless
    the chat template closed one in the prompt already (Qwen3's
    enable_thinking false)."""
    return (content.reasoning_rate > 0 or reasoning_tokens is not None) and not _thinking_closed(tokenizer, core_request.prompt_token_ids)


def _flag(value: Optional[bool], rate: float, rng: random.Random) -> bool:
    return value if value is not None else rate > 0 and rng.random() < rate


def apply(
    request: Any,
    core_request: EngineCoreRequest,
    tokenizer: Tokenizer,
    content: ContentSettings,
    asked: Tuple[Optional[bool], Optional[int]],
    seed: int,
    rank: int,
    cap: int,
    words: Tuple[Any, Any],
) -> None:
    """Give a planned request its tool call and reasoning span, if drawn.
    `asked`: its vllm_xargs mock_tool_call and mock_reasoning_tokens (None
    when absent); `cap`: the most tokens it may have (max_tokens cut to
    max_model_len); `words`: the engine's token source and the request's
    state in it before any structured answer, which the span's ids come
    from."""
    if request.pool is not None:
        return  # allowed_token_ids or a forcing logit_bias: every id comes from its pool
    tool_call, reasoning_tokens = asked
    rng = random.Random(request_seed(seed, rank, request.request_id) ^ _SEED_SALT)
    # A thinking model closes a <think> block in every answer (an empty one
    # when it does not think), unless the chat template closed one in the
    # prompt already (Qwen3's enable_thinking false).
    thinks = thinking(content, reasoning_tokens, tokenizer, core_request)
    think = 0
    if thinks:
        think = reasoning_tokens if reasoning_tokens is not None else (
            content.reasoning_tokens if rng.random() < content.reasoning_rate else 0)  # fmt: skip
    call: Optional[Tuple[List[int], bool]] = None
    if core_request.structured_outputs is None and (tool_call is not None or content.tool_call_rate > 0):
        tools = prompt_tools(tokenizer, core_request.prompt_token_ids or ())
        if tools and _flag(tool_call, content.tool_call_rate, rng):
            call = _call(request, tokenizer, tools[rng.randrange(len(tools))], seed, rank, cap)
    if not thinks and call is None:
        return
    sampler = request.sampler
    source = sampler.tokens
    state = request.rng_state
    prefix: List[int] = []
    mark = markers(tokenizer)
    # before a constrained answer the grammar starts right after </think>
    constrained = core_request.structured_outputs is not None and isinstance(source, RecordedTokens)
    close, empty = (mark.think_close_bare, mark.think_empty_bare) if constrained else (mark.think_close, mark.think_empty)
    if constrained:  # the block is cut to what the cap leaves after the answer
        think = max(0, min(think, cap - request.max_tokens - len(mark.think_open) - len(close)))
    if think:
        base, at = words
        drawn, after = base.draw(at, think)
        if source is base:
            state = after  # the answer's ids follow the span's in the source
        prefix = mark.think_open + drawn + close
    elif thinks:
        prefix = list(empty)
    if call is not None:
        ids = prefix + call[0]
        ends = call[1] and core_request.eos_token_id is not None and not core_request.ignore_eos and len(ids) < cap
        if ends:
            ids.append(core_request.eos_token_id)
        request.max_tokens = len(ids) if ends else cap
        if request.finish is not FinishReason.ERROR:
            request.finish = FinishReason.STOP if ends else FinishReason.LENGTH
        request.stop_reason = request.last_token = None
        request.sampler = Sampler(RecordedTokens(ids, source), sampler.logprobs)
        request.rng_state = (0, state)
        request.stop_ids = request.banned = None
    elif isinstance(source, RecordedTokens):  # the span before a structured answer
        request.sampler = Sampler(RecordedTokens(prefix + list(source.recorded), source.fallback), sampler.logprobs)
        request.max_tokens = min(cap, request.max_tokens + len(prefix))
    else:  # the span, then the source's ids: the plan's length, end and stop ids stay
        request.sampler = Sampler(RecordedTokens(prefix, source), sampler.logprobs)
        request.rng_state = (0, state)


def _call(request: Any, tokenizer: Tokenizer, tool: Tool, seed: int, rank: int, cap: int) -> Tuple[List[int], bool]:
    """The ids of one hermes call of `tool` (markers included, no EOS), and
    whether it is whole (else `cap` cut it)."""
    mark = markers(tokenizer)
    params = StructuredOutputsParams("json", call_schema(tool))
    limit = max(0, cap - len(mark.tool_open) - len(mark.tool_close))
    answer, _ = structured_output.answer_for(request, structured_output.for_tokenizer(tokenizer), params,
                                             request_seed(seed, rank, request.request_id) ^ _SEED_SALT ^ 1, limit, None)  # fmt: skip
    if not answer.ended:
        return (mark.tool_open + list(answer.token_ids))[:cap], False
    return mark.tool_open + list(answer.token_ids) + mark.tool_close, True
