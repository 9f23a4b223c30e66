"""A request's state and its planned end: pure (vLLM: `vllm/v1/request.py`).

`Request` is what the engine keeps of one ADD while it waits or runs. Unlike
a real engine, the mock knows at admission how a request will end: `plan()`
takes the EngineCoreRequest (docs/protocol.md §3.2, §3.3) and decides how many
tokens it gets and with which finish reason, from `max_tokens`,
`max_model_len`, EOS lengths, stop ids and the `vllm_xargs` scenarios. Every
client value it reads was checked before (wire/inputs.py the ADD's fields,
wire/checks.py its vllm_xargs): nothing here raises on a client's value.
"""

from __future__ import annotations

import enum
import random
from typing import Any, Dict, List, Optional, Tuple

from gmock_engine.content.lengths import OutputLengths
from gmock_engine.content.tokens import TokenSource, request_seed
from gmock_engine.wire.checks import NO_XARGS, Xargs
from gmock_engine.wire.inputs import EngineCoreRequest
from gmock_engine.wire.types import TOKEN_ID_LIMIT, FinishReason

# Read once per ADD: module constants, not enum member lookups (each a
# metaclass attribute lookup).
_LENGTH, _STOP, _ERROR = FinishReason.LENGTH, FinishReason.STOP, FinishReason.ERROR
_MOCK_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "error": FinishReason.ERROR}


class RequestStatus(enum.IntEnum):
    """Where a request is (vLLM's RequestStatus): the scheduler keeps it in
    step with its books (waiting queue, running batch, the P/D consumers
    waiting for their KV); every status after PREEMPTED is a finished one."""

    WAITING = enum.auto()
    #: its structured answer is being made off the engine's loop (grammar
    #: compile and answer, grammar_wait.py): held out of the waiting queue
    #: until it is ready, counted as waiting, as vLLM counts it
    WAITING_FOR_FSM = enum.auto()
    #: a P/D consumer whose prompt's KV is on its way (in the running batch
    #: here, holding its blocks; counted as waiting, as vLLM counts it)
    WAITING_FOR_REMOTE_KVS = enum.auto()
    RUNNING = enum.auto()
    #: back in the waiting queue after a preemption
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    #: never ran: its KV can never fit (vLLM: a prompt over the length cap)
    FINISHED_IGNORED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @staticmethod
    def is_finished(status: "RequestStatus") -> bool:
        """True for the statuses of a request that ended."""
        return status > RequestStatus.PREEMPTED


#: a finished request's status by its finish reason
FINISHED_STATUS = {
    FinishReason.STOP: RequestStatus.FINISHED_STOPPED,
    FinishReason.LENGTH: RequestStatus.FINISHED_LENGTH_CAPPED,
    FinishReason.ABORT: RequestStatus.FINISHED_ABORTED,
    FinishReason.ERROR: RequestStatus.FINISHED_ERROR,
    # a stop of its own kind on the wire; the request stopped
    FinishReason.REPETITION: RequestStatus.FINISHED_STOPPED,
}
_WAITING = RequestStatus.WAITING


class Request:
    """A request, waiting or running (vLLM's `Request`, reduced to what a
    mock needs); `__slots__` keep 100 000 of them small."""

    __slots__ = (
        "request_id",
        "client_index",
        "max_tokens",
        "num_output_tokens",
        "rng_state",
        "prompt_len",
        "queued_at",
        "scheduled_at",
        "ready_at",
        "finish",
        "stop_reason",
        "last_token",
        "stop_ids",
        "priority",
        "arrival",
        "prefill_left",
        "blocks",
        "pending_events",
        "ttft_ms",
        "block_hashes",
        "cached_tokens",
        "all_token_ids",
        "kv_blocks",
        "num_cached_blocks",
        "num_logprobs",
        "num_prompt_logprobs",
        "logprob_state",
        "prompt_token_ids",
        "pool",
        "alternatives",
        "banned",
        "forced",
        "shaped",
        "lane",
        "lane_exit",
        "lane_output",
        # speculative decoding (content/spec_decode.py): its acceptance draws' state
        "spec_state",
        "spec_rate",
        "sampler",
        "lora_request",
        # P/D disaggregation (kv/transfer.py)
        "kv",
        # multimodal items (wire/mm_features.py): the encoder cache and the prefix cache's block keys read them
        "mm_features",
        "block_extra_keys",
        "status",
        # --replay (timing/replay.py)
        "replay",
        # the latency profile's input delay (timing/profile.py)
        "admit_at",
        # async scheduling: the scheduler's call from which it may be admitted
        "first_call",
        # a pooling request's output tensor (content/pooling.py)
        "pooling",
    )

    def __init__(
        self, request_id: str, client_index: int, max_tokens: int, rng_state: Any, prompt_len: int, queued_at: float
    ) -> None:
        self.request_id = request_id
        self.client_index = client_index
        self.mm_features: Tuple[Any, ...] = ()
        #: each prompt block's extra keys for BlockStored (prefix_cache.mm_block_hashes); None: no image
        self.block_extra_keys: Optional[List[Any]] = None
        self.max_tokens = max_tokens
        self.num_output_tokens = 0
        self.rng_state = rng_state
        self.prompt_len = prompt_len
        #: Engine clock at ADD / at admission: the QUEUED and SCHEDULED events (§4.5).
        self.queued_at = queued_at
        self.scheduled_at = queued_at
        #: Engine clock from which its first token may come (prefill done).
        self.ready_at = queued_at
        #: Engine clock before which it is not admitted: its arrival in a real
        #: engine, after the input delay of a latency profile.
        self.admit_at = queued_at
        #: The Scheduler.schedule call (its count) from which it may be
        #: admitted: with async scheduling, one later when the engine is busy.
        self.first_call = 0
        #: How it ends after `max_tokens` tokens (see `plan`).
        self.finish = _LENGTH
        self.stop_reason: Optional[int] = None
        self.last_token: Optional[int] = None
        #: Ids random tokens must avoid (a real engine would have stopped on them).
        self.stop_ids: Optional[frozenset] = None
        self.priority = 0
        #: Arrival order in the waiting queue (set once; kept across preemptions).
        self.arrival = -1
        #: Tokens still to prefill in chunks (token budget enforced) and KV blocks held.
        self.prefill_left = 0
        self.blocks = 0
        #: EngineCoreEvents for its next output (QUEUED/PREEMPTED, SCHEDULED).
        self.pending_events: Optional[List[Dict[str, Any]]] = None
        #: vllm_xargs mock_ttft_ms: this request's fixed time to first token.
        self.ttft_ms: Optional[float] = None
        #: Prefix caching (prefix_cache.py): the chained hashes of its full
        #: blocks (prompt, then generated), its cached tokens at admission,
        #: its token ids (None: not cached at all), the physical blocks it
        #: holds while running (None: not running) and how many are cached.
        self.block_hashes: List[int] = []
        self.cached_tokens = 0
        self.all_token_ids: Optional[List[int]] = None
        self.kv_blocks: Optional[List[Any]] = None
        self.num_cached_blocks = 0
        #: SamplingParams logprobs / prompt_logprobs (None: not asked; content/logprobs.py)
        self.num_logprobs: Optional[int] = None
        self.num_prompt_logprobs: Optional[int] = None
        self.logprob_state = 0
        #: kept only for prompt logprobs (column 0 of each prompt row)
        self.prompt_token_ids: Optional[List[int]] = None
        #: Sampling controls (see `plan`): the ids its tokens are drawn from
        #: (None: the token source's own), the ids logprob alternatives come
        #: from, the ids never emitted, and logit_bias +100 (a forced token).
        self.pool: Optional[Tuple[int, ...]] = None
        self.alternatives: Optional[Tuple[int, ...]] = None
        self.banned: Optional[frozenset] = None
        self.forced = False
        #: A pool or logprobs: its tokens take the scheduler's slower path.
        self.shaped = False
        #: The scheduler's lane (its key) while the request is in its steady
        #: state (lanes.py: past its first output, nothing pending,
        #: not at its last output), None: its next output takes the full path.
        self.lane: Any = None
        #: The output step (lanes.py) it leaves its lane in.
        self.lane_exit = 0
        #: Its `[request_id, tokens]` output, reused for every output it
        #: makes in a lane (OutputProcessor.reuse_outputs), None: a new one each time.
        self.lane_output: Optional[List[Any]] = None
        self.spec_state: Optional[int] = None
        #: vllm_xargs mock_spec_acceptance: every draft position's rate (None: the engine's)
        self.spec_rate: Optional[float] = None
        #: The scheduler's Sampler at its ADD (its token source and logprob
        #: model): a reload changes those for new requests only.
        self.sampler: Any = None
        #: The LoRA adapter it names (lora.LoRARequest), None: the base model.
        self.lora_request: Any = None
        #: P/D (kv_transfer.KVPlan): it prefills for a decode engine, or
        #: loads its prompt's KV from a prefill engine; None: neither.
        self.kv: Any = None
        #: Where it is (RequestStatus), kept by the scheduler.
        self.status = _WAITING
        #: --replay: the recording it follows (replay.Replaying), None: the engine's model.
        self.replay: Any = None
        #: A pooling request's pooling_output (pooling.tensor), None: it generates.
        self.pooling: Any = None

    @property
    def num_tokens(self) -> int:
        """Prompt and output tokens: what its KV holds."""
        return self.prompt_len + self.num_output_tokens

    @property
    def remaining(self) -> int:
        """Tokens still to emit."""
        return self.max_tokens - self.num_output_tokens


def plan(
    request: Request,
    core_request: EngineCoreRequest,
    xargs: Xargs,
    tokens: TokenSource,
    max_model_len: int,
    output_lengths: Optional[OutputLengths],
    seed: int,
    rank: int,
) -> None:
    """Decide how many tokens `request` gets and how it ends (§3.3).

    Length: max_tokens, cut to max_model_len - prompt_len. Then, first match
    wins: `mock_fail_after` (vllm_xargs) ends with ERROR; an EOS length
    (`mock_output_len`, else the configured length model unless
    `ignore_eos`; never before `min_tokens`) ends with STOP and the EOS id as
    last token. `mock_finish` = stop | error | length changes how the
    request ends at its length; `mock_stop_token_id` makes a STOP end on that
    id, reported as stop_reason. Random tokens never hit a stop id; when the
    stop ids cover every id the request could emit, the request stops on its
    first token (after min_tokens), as vLLM's would. The sampling controls
    shape which ids are drawn: `allowed_token_ids` is the pool, a logit_bias
    of +100 forces its ids, -100 and bad words ban theirs.

    `xargs` are the request's vllm_xargs as wire.checks.check_xargs checked
    them (NO_XARGS: it has none).
    """
    if xargs is NO_XARGS:  # (most requests)
        fail_after = natural = stop_token = mode = None
    else:
        fail_after, natural, stop_token, mode = xargs.fail_after, xargs.output_len, xargs.stop_token_id, xargs.finish
        if xargs.ttft_ms is not None:
            request.ttft_ms = xargs.ttft_ms
        request.spec_rate = xargs.spec_acceptance
    limit = min(request.max_tokens, max(0, max_model_len - core_request.prompt_len))
    finish = _LENGTH
    # EOS ends a request only if the frontend named an EOS id: vllm-rs
    # implements ignore_eos by sending none (Python sends ignore_eos).
    eos = core_request.eos_token_id
    eos_possible = eos is not None and not core_request.ignore_eos
    stop_ids = set(core_request.all_stop_token_ids)
    stop_ids.update(core_request.stop_token_ids)
    if eos is not None:
        stop_ids.add(eos)
    stoppers = stop_ids if eos_possible else set(core_request.stop_token_ids)
    # Sampling controls: logit_bias -100 and the last id of each bad word
    # are never drawn (stricter than vLLM for multi-token bad words, which it
    # bans only after their prefix); +100 forces its ids; allowed_token_ids
    # is the pool everything else is drawn from.
    bias = core_request.logit_bias
    bad_words = core_request.bad_words_token_ids
    banned = {word[-1] for word in bad_words} if bad_words else set()
    forced: List[int] = []
    if bias:
        banned.update(t for t, b in bias.items() if b <= -100)
        forced = sorted(t for t, b in bias.items() if b >= 100 and 0 <= t < TOKEN_ID_LIMIT and t not in banned)
    pool: Optional[List[int]] = None
    if forced:
        pool = forced
    elif core_request.allowed_token_ids is not None:
        allowed = set(core_request.allowed_token_ids)
        # banning every allowed id bans none: an equal bias on all of them cancels out
        pool = sorted(allowed - banned) or sorted(allowed)
    elif banned and tokens.only_emits(request.rng_state, banned):
        banned = set()  # a bias on every id the source makes cancels out, as in vLLM
    request.forced = bool(forced)
    request.banned = frozenset(banned) if banned else None
    # Stop ids covering every id the request can emit: a real engine stops on
    # its first token that may stop (vLLM's check_stop, after min_tokens).
    first_stop: Optional[int] = None
    if pool is not None:
        if stoppers and all(t in stoppers for t in pool):
            first_stop = pool[tokens.draw(request.rng_state, 1)[0][0] % len(pool)]
    elif stoppers and tokens.only_emits(request.rng_state, stoppers):
        first_stop = tokens.draw(request.rng_state, 1)[0][0]
    if first_stop is not None:
        at = max(core_request.min_tokens, 1)
        natural = at if natural is None else min(natural, at)
    if natural is None and output_lengths is not None and eos_possible:
        length_seed = request_seed(seed, rank, request.request_id) ^ 0x9E3779B97F4A7C15
        natural = output_lengths.draw(random.Random(length_seed))
    if fail_after is not None and fail_after < limit:
        limit, finish = fail_after, _ERROR
    elif natural is not None and max(natural, core_request.min_tokens, 1) < limit + (first_stop is not None):
        # (a covering stop set stops even on the max_tokens-th token: vLLM checks stops before length)
        limit, finish = max(natural, core_request.min_tokens, 1), _STOP
    if mode is not None:
        finish = _MOCK_FINISH[mode]
    request.max_tokens, request.finish = limit, finish
    if finish is _STOP:
        if stop_token is not None:
            request.last_token = request.stop_reason = stop_token
        elif first_stop is not None:
            request.last_token = first_stop
            # vLLM reports a stop_token_ids hit as stop_reason, EOS as none
            request.stop_reason = first_stop if first_stop in core_request.stop_token_ids and first_stop != eos else None
        else:
            request.last_token = eos
    if pool is not None:
        # drawn from the pool without its stop ids (nothing left to avoid then)
        free = tuple(t for t in pool if t not in stop_ids)
        request.pool = free or tuple(pool)
        request.alternatives = tuple(pool)
        request.stop_ids = None
        request.shaped = True
        return
    avoid = stop_ids | banned
    # nothing is left to avoid when every id stops
    request.stop_ids = frozenset(avoid) if avoid and first_stop is None else None
