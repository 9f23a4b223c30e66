"""Property-based tests of the pure EngineCore, driven by real wire frames.

Each example draws engine settings and a stream of operations: ADD, ABORT,
UTILITY and raw frames, built as the frontends build them (msgpack arrays,
fake_frontend.engine_core_request) with adversarial values, plus decode steps
on a fake clock. Every frame goes through `wire.inputs.decode_input` exactly as
the runtime's reader does (a ProtocolError is the reader's job: the frame is
dropped), then into `EngineCore.apply`; steps are taken when the engine says
one is due (`next_step_time`, as the runtime's stepper). At the end every
example steps until idle, aborts everything and steps until idle again.

Properties, each its own test so that one broken property does not hide
another:

(a) no exception escapes decode (other than ProtocolError), apply or step;
(b) every message the engine returns packs with msgpack and passes
    wire_rules, i.e. both real frontends can decode it;
(c) the engine's ledger reports no violation;
(d) no request is preempted in the step that admitted it, nor admitted in
    the step that preempted it (vLLM's scheduler, vllm/v1/core/sched/
    core/scheduler.py `schedule()`: running requests first, preemption only among
    them, waiting ones only `if not preempted_reqs`). Visible on the wire as
    SCHEDULED and PREEMPTED events with the same timestamp, of one request or
    of two (the fake clock advances on every step);
(e) every ADD the engine accepted gets exactly one terminal output (or, for
    abort_immediately, only its id in finished_requests), on its own client,
    nothing for it afterwards, its id in that message's finished_requests;
    every UTILITY call exactly one reply, on its caller's client; at the
    end, with every request ended, no KV block or token is held;
(f) a request whose stop ids (plus EOS) cover every id the engine may emit
    ends with finish_reason STOP on its first token (vLLM's check_stop);
(g) with outputs reused (as the runtime runs the engine), the steady step
    (OutputProcessor.steady_step, core/lanes.py) sends the same bytes as the general step: each
    scenario runs once as it is and once with that path turned off;
(h) with outputs reused, every new_logprobs row is self-consistent
    (distinct alternatives, non-increasing logprobs <= 0, the sampled token
    at its rank when within k) and carries the output's own tokens in column
    0, wherever the rows come from (drawn, a RowPool on the full path, a
    lane of requests with logprobs).

Failures raise an AssertionError subclass named after the rule, so Hypothesis
reports distinct rules as distinct bugs, each with its own shrunk example.
Reading one: the settings dict, then the operations; the leading
`('step', 0.001)`s are padding (a stream has at least 8 operations, and
"step" is what the shrinker turns unneeded ones into; on an idle engine a step
does nothing). The wire test runs once per focus (xargs, tokens, stops,
utility, scheduler, sampling, all), each its own search.

Profiles, example counts and the printed case total: conftest.py here.

§N: section N of docs/protocol.md.
"""

from __future__ import annotations

import os
import re
import struct
import time
from collections import Counter, defaultdict
from typing import Any, Dict, List, Optional, Tuple

import msgpack
import pytest
from hypothesis import given, note, settings
from hypothesis import strategies as st
from loguru import logger

import wire_rules
from fake_frontend import engine_core_request
from gmock_engine.core.engine import EngineCore, EngineSettings
from gmock_engine.timing.latency import LatencyModel
from gmock_engine.content.lengths import OutputLengths
from gmock_engine.content.tokens import EchoTokens, FileTokens, RandomTokens
from gmock_engine.wire.eras import DEFAULT_PROTOCOL_VERSION, WIRE_LAYOUTS
from gmock_engine.wire.inputs import EngineCoreRequest, InvalidRequest, UtilityCall, decode_input
from gmock_engine.wire.types import EngineCoreEventType, EngineCoreRequestType, FinishReason, ProtocolError

LAYOUT = WIRE_LAYOUTS[DEFAULT_PROTOCOL_VERSION]
#: Client index of the coordinator_output socket in the engine's (client, message) pairs (vLLM's too).
COORDINATOR = -1
#: Decoded ADDs: a request, or (newer decoders) an ADD with a bad value that
#: the engine answers with an ERROR output for that request.
ADD_TYPES = tuple(t for t in (EngineCoreRequest, InvalidRequest) if t is not None)
MOCK_KEYS = ("mock_output_len", "mock_stop_token_id", "mock_finish", "mock_fail_after", "mock_ttft_ms")
UTILITY_METHODS = (
    "sleep",
    "wake_up",
    "is_sleeping",
    "pause_generation",
    "pause_scheduler",
    "resume_scheduler",
    "is_scheduler_paused",
    "reset_prefix_cache",
    "set_weight_version",
    "get_weight_version",
    "get_supported_tasks",
    "gmock_stats",
    "reset_mm_cache",
    "add_lora",
    "list_loras",
    "collective_rpc",
)
#: Steps at the end before everything is aborted (requests may ask for 2**64 tokens).
FINAL_STEPS = 48


def examples(default: int) -> int:
    """Examples per test: GMOCK_HYPOTHESIS_EXAMPLES, else the test's default."""
    value = os.environ.get("GMOCK_HYPOTHESIS_EXAMPLES")
    return int(value) if value else default


# --------------------------------------------------------------------------
# Counting cases (printed by conftest.pytest_terminal_summary)
# --------------------------------------------------------------------------


class CaseCounter:
    """Examples and generated cases (the settings draw + every operation) per test."""

    def __init__(self) -> None:
        self.per_test: Dict[str, List[float]] = {}
        self.current = "?"

    def add(self, cases: int) -> None:
        entry = self.per_test.setdefault(self.current, [0, 0, 0.0])
        entry[0] += 1
        entry[1] += cases

    def timed(self, test: str, seconds: float) -> None:
        self.per_test.setdefault(test, [0, 0, 0.0])[2] += seconds

    def totals(self) -> Tuple[int, int, float]:
        return (
            sum(int(e[0]) for e in self.per_test.values()),
            sum(int(e[1]) for e in self.per_test.values()),
            sum(e[2] for e in self.per_test.values()),
        )


CASES = CaseCounter()


@pytest.fixture(scope="module", autouse=True)
def _quiet_engine_and_case_count(request):
    """The engine logs a warning for every bad input: off here (millions of
    lines). The case counter is handed to conftest for the final summary."""
    request.config.gmock_property_cases = CASES
    logger.disable("gmock_engine")
    yield
    logger.enable("gmock_engine")


@pytest.fixture(autouse=True)
def _time_each_test(request):
    CASES.current = request.node.name
    start = time.perf_counter()
    yield
    CASES.timed(request.node.name, time.perf_counter() - start)


# --------------------------------------------------------------------------
# Failures: one AssertionError subclass per rule (distinct bugs for Hypothesis)
# --------------------------------------------------------------------------

_ERROR_CLASSES: Dict[str, type] = {}


def violation(rule: str, detail: str) -> AssertionError:
    """An AssertionError whose class names the rule, e.g. WireRule_stop_reason_u32."""
    name = re.sub(r"\W", "_", rule)
    cls = _ERROR_CLASSES.get(name)
    if cls is None:
        cls = _ERROR_CLASSES[name] = type(name, (AssertionError,), {})
    return cls(detail)


# --------------------------------------------------------------------------
# Strategies: values
# --------------------------------------------------------------------------

#: Every int msgpack can carry, and the edges that matter (u32, i64, u64).
EDGE_INTS = [0, 1, -1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**53, 2**63 - 1, 2**63, 2**64 - 1, -(2**31), -(2**63)]
any_int = st.one_of(st.integers(-(2**63), 2**64 - 1), st.sampled_from(EDGE_INTS))
small_int = st.integers(0, 20)
any_float = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([1e300, -1e300, 1e19, 2.0**64, 0.5, -0.5, 3.0, float("nan"), float("inf"), float("-inf")]),
)
weird_scalar = st.one_of(
    st.none(),
    st.booleans(),
    any_int,
    any_float,
    st.text(max_size=12),
    st.sampled_from(["", "stop", "length", "error", "12", "1e3", "nan", "-1"]),
    st.binary(max_size=4),
)
weird_value = st.recursive(
    weird_scalar,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=6,
)

#: Request ids: a small reused pool (duplicates, aborts that hit), edge cases
#: (empty: rejected by decode; long; unicode) and fresh text.
ID_POOL = ["r0", "r1", "r2", "cmpl-a-0123abcd", "dup", "é-ü-🙂-ß", "x" * 300, "L" * 1000, " ", "-"]
request_ids = st.one_of(st.sampled_from(ID_POOL), st.sampled_from(ID_POOL), st.text(max_size=10))


def token_ids(vocab: int, adversarial: bool) -> st.SearchStrategy:
    """Token ids in the vocabulary, and (adversarial) any int msgpack carries."""
    inside = st.integers(0, max(0, vocab - 1))
    return st.one_of(inside, inside, any_int) if adversarial else inside


@st.composite
def prompts(draw, vocab: int, adversarial: bool):
    kind = draw(st.sampled_from(["list", "list", "long", "none", "bad"] if adversarial else ["list", "list", "long"]))
    if kind == "none":
        return None  # prompt given as embeddings only
    if kind == "bad":
        return draw(st.one_of(weird_value, st.lists(weird_scalar, min_size=1, max_size=3)))
    if kind == "long":  # up to ~44 blocks of 16: larger than a small KV cache
        base = draw(st.lists(token_ids(vocab, adversarial), min_size=1, max_size=4))
        n = draw(st.integers(0, 700))
        return (base * (n // len(base) + 1))[:n]
    return draw(st.lists(token_ids(vocab, adversarial), max_size=24))


@st.composite
def stop_lists(draw, vocab: int, adversarial: bool):
    kind = draw(st.sampled_from(["short", "short", "cover", "none"]))
    if kind == "none":
        return None
    if kind == "cover":  # the whole vocabulary, maybe but one id (EOS may cover it)
        ids = list(range(vocab))
        if draw(st.booleans()) and ids:
            ids.remove(draw(st.sampled_from(ids)))
        return ids
    return draw(st.lists(token_ids(vocab, adversarial), max_size=6))


def choice_of(*strategies: st.SearchStrategy) -> st.SearchStrategy:
    """One of `strategies`, each as likely (st.one_of would flatten nested
    one_ofs and weigh each of their branches as much as a whole strategy)."""
    return st.integers(0, len(strategies) - 1).flatmap(lambda i: strategies[i])


#: A vllm_xargs value: each kind as common as the others (whole floats beyond
#: int64 / u64 such as 1e300, inf and nan; ints of every size; numeric
#: strings; bools; nil; nested).
XARG_VALUES = choice_of(
    small_int,
    any_int,
    st.sampled_from([1e300, -1e300, 2.0**64, 1e19]),
    st.sampled_from([float("nan"), float("inf"), float("-inf")]),
    st.one_of(st.floats(), st.sampled_from([2.0**32, -1.0, 0.5, 3.0])),
    st.sampled_from(["stop", "length", "error"]),
    st.sampled_from(["", "12", "1e300", "-1", "nan", "inf", "0x10"]),
    st.booleans(),
    st.none(),
    st.lists(weird_scalar, max_size=2),
    st.dictionaries(st.text(max_size=4), weird_scalar, max_size=2),
)


def mostly(usual: st.SearchStrategy, odd: st.SearchStrategy) -> st.SearchStrategy:
    """`usual` 3 times in 4, else `odd` (the shrinker goes towards `usual`)."""
    return st.integers(0, 3).flatmap(lambda i: odd if i == 3 else usual)


#: ... and per key, mostly values that make the scenario happen (one bad value
#: rejects the whole request, which would hide what the others do).
XARG_BY_KEY = {
    "mock_finish": mostly(st.sampled_from(["stop", "stop", "length", "error"]), XARG_VALUES),
    "mock_output_len": mostly(small_int, XARG_VALUES),
    "mock_fail_after": mostly(small_int, XARG_VALUES),
    "mock_ttft_ms": mostly(st.sampled_from([0, 1, 5.5, 50]), XARG_VALUES),
    "mock_stop_token_id": choice_of(st.integers(0, 200), any_int, st.sampled_from([1e300, -1e300, 2.0**64]), XARG_VALUES),
}


@st.composite
def extra_args(draw, adversarial: bool):
    """vllm_xargs (SamplingParams.extra_args) with every mock_* key."""
    if adversarial and draw(st.integers(0, 15)) == 15:
        return draw(weird_value)  # not a map: decode rejects it (or it is nil)
    keys = [key for key in MOCK_KEYS + ("other",) if draw(st.booleans())]
    out = {}
    for key in keys:
        if adversarial:
            out[key] = draw(XARG_BY_KEY.get(key, XARG_VALUES))
        elif key == "mock_finish":
            out[key] = draw(st.sampled_from(["stop", "length", "error"]))
        elif key == "mock_ttft_ms":
            out[key] = draw(st.sampled_from([0, 1, 5.5, 50]))
        else:
            out[key] = draw(small_int)
    return out


@st.composite
def sampling_params(draw, vocab: int, features: frozenset):
    adversarial = "values" in features
    if adversarial and draw(st.integers(0, 20)) == 20:
        return draw(st.one_of(st.none(), weird_value))  # pooling request, or not a map
    params: Dict[str, Any] = {"temperature": draw(st.sampled_from([1.0, 0.0, 0.7]))}
    max_tokens = st.one_of(small_int, small_int, small_int, st.integers(0, 200))
    if adversarial:
        max_tokens = st.one_of(max_tokens, any_int, st.sampled_from([None, 2**64 - 1, 10**12]), weird_scalar)
    if draw(st.integers(0, 5)):
        params["max_tokens"] = draw(max_tokens)
    if "stops" in features:
        if draw(st.booleans()):
            params["stop_token_ids"] = draw(stop_lists(vocab, adversarial))
        if draw(st.booleans()):
            params["_eos_token_id"] = draw(st.one_of(token_ids(vocab, adversarial), st.none()))
        if draw(st.booleans()):
            params["_all_stop_token_ids"] = draw(st.lists(token_ids(vocab, adversarial), max_size=4))
        if draw(st.booleans()):
            params["ignore_eos"] = draw(st.one_of(st.booleans(), weird_scalar) if adversarial else st.booleans())
        if draw(st.booleans()):
            params["min_tokens"] = draw(st.one_of(st.integers(0, 10), any_int, weird_scalar) if adversarial else st.integers(0, 10))
    if "xargs" in features and draw(st.booleans()):
        params["extra_args"] = draw(extra_args(adversarial))
    if "sampling" in features:
        # logprobs (new_logprobs / new_prompt_logprobs_tensors on the wire,
        # docs/protocol.md Appendix E) and the sampling controls that pick ids
        count = st.integers(0, 5)
        for key in ("logprobs", "prompt_logprobs"):
            if draw(st.booleans()):
                params[key] = draw(mostly(count, st.one_of(st.just(-1), st.integers(6, 2000), weird_scalar)) if adversarial else count)
        ids = token_ids(vocab, adversarial)
        if draw(st.integers(0, 3)) == 3:
            params["allowed_token_ids"] = draw(st.lists(ids, min_size=1, max_size=5))
        if draw(st.integers(0, 3)) == 3:
            params["logit_bias"] = draw(st.dictionaries(ids, st.one_of(st.sampled_from([100.0, -100.0, 0.0]), st.floats(-100, 100)), max_size=4))
        if draw(st.integers(0, 3)) == 3:
            params["_bad_words_token_ids"] = draw(st.lists(st.lists(ids, min_size=1, max_size=3), max_size=3))
    return params


@st.composite
def add_frame(draw, vocab: int, features: frozenset, clients: int = 1):
    """One ADD payload as a frontend sends it (the full 22-element array),
    with adversarial values where the features ask for them."""
    adversarial = "values" in features
    rid = draw(request_ids)
    prompt = draw(prompts(vocab, "tokens" in features))
    request = engine_core_request(
        rid,
        (),
        {},
        client_index=draw(client_indexes(clients)),
        priority=draw(st.one_of(st.integers(-3, 3), any_int) if "scheduler" in features or adversarial else st.just(0)),
        abort_immediately=draw(st.sampled_from([False] * 10 + [True])),
    )
    request[1] = prompt
    request[3] = draw(sampling_params(vocab, features))
    if adversarial:
        for _ in range(draw(st.integers(0, 2))):
            index = draw(st.integers(0, len(request) - 1))
            request[index] = draw(weird_value)
        if draw(st.integers(0, 7)) == 7:  # a short array (the decoder takes defaults)
            request = request[: draw(st.integers(0, len(request)))]
    return ("add", request)


@st.composite
def add_many(draw, vocab: int):
    """Many ADDs at once (up to past the ledger's 1024-id memory)."""
    # past 1024 one time in 12 (they are slow: kept to ~1 example in 10)
    n = draw(st.integers(0, 11).flatmap(lambda i: st.integers(1000, 1100) if i == 11 else st.integers(1, 40)))
    max_tokens = draw(st.sampled_from([1, 1, 2, 5, 16, 2**20]))
    # (not 0: a thousand empty prompts need no KV block to be admitted, then
    # all get preempted one by one, quadratic per step: see the slow-step test)
    prompt_len = draw(st.sampled_from([1, 3, 16, 40]))
    return ("add_many", n, max_tokens, prompt_len, draw(st.sampled_from(["m", "r", "bulk-"])))


@st.composite
def abort_frame(draw, features: frozenset):
    kind = draw(st.sampled_from(["ids", "ids", "known", "bad"] if "values" in features else ["ids", "ids", "known"]))
    if kind == "known":
        return ("abort_known", draw(st.integers(1, 2000)))  # the first N ids ever added
    if kind == "bad":
        return ("abort", draw(weird_value))
    return ("abort", draw(st.lists(request_ids, max_size=4)))


PAUSE_MODES = st.sampled_from(["abort", "wait", "keep"])


def client_indexes(clients: int) -> st.SearchStrategy:
    """Mostly an output socket the frontend has, sometimes one past them
    (the engine drops those: there is no socket to answer on)."""
    return mostly(st.integers(0, clients - 1), st.integers(clients, clients + 1))


@st.composite
def utility_frame(draw, features: frozenset, clients: int = 1):
    adversarial = "values" in features or "utility" in features
    method = draw(st.one_of(st.sampled_from(UTILITY_METHODS), st.text(max_size=8)) if adversarial else st.sampled_from(UTILITY_METHODS))
    if method == "sleep":
        args = [draw(st.one_of(st.integers(0, 2), weird_scalar) if adversarial else st.integers(0, 2)), draw(PAUSE_MODES)]
    elif method in ("pause_generation", "pause_scheduler"):
        args = [draw(st.one_of(PAUSE_MODES, weird_scalar) if adversarial else PAUSE_MODES), draw(st.booleans())]
    elif method == "wake_up":
        args = [draw(st.sampled_from([None, ["weights"], ["kv_cache"]]))]
    elif method == "set_weight_version":
        args = [draw(st.one_of(st.text(max_size=8), weird_scalar) if adversarial else st.text(max_size=8))]
    elif method == "reset_prefix_cache":
        args = [draw(st.booleans()), draw(st.booleans())]
    else:
        args = []
    if adversarial and draw(st.integers(0, 3)) == 3:
        args = draw(st.one_of(st.lists(weird_value, max_size=3), weird_value))  # wrong-typed or not a list
    client = draw(mostly(client_indexes(clients), weird_scalar) if adversarial else client_indexes(clients))
    call_id = draw(st.one_of(st.integers(1, 50), st.integers(-(2**63), 2**64 - 1)))
    payload = [client, call_id, method, args]
    if adversarial and draw(st.integers(0, 9)) == 9:
        payload = draw(st.one_of(weird_value, st.just(payload[:3])))
    return ("utility", payload)


@st.composite
def raw_frames(draw):
    """Frames a frontend would not send: unknown type bytes, garbage, START_DP_WAVE."""
    kind = draw(st.sampled_from(["garbage", "wave", "type"]))
    if kind == "wave":
        return ("raw", [b"\x02", msgpack.packb([draw(any_int), draw(weird_scalar)], use_bin_type=True)])
    if kind == "type":
        return ("raw", [bytes([draw(st.integers(0, 255))]), msgpack.packb(draw(weird_value), use_bin_type=True)])
    return ("raw", draw(st.lists(st.binary(max_size=12), max_size=3)))


STEP_DT = st.sampled_from([0.001, 0.01, 0.04, 0.06, 0.25, 1.0])


@st.composite
def operation(draw, vocab: int, features: frozenset, clients: int):
    # "step" first: it is what the shrinker turns unneeded operations into.
    kinds = ["step", "step", "step", "add", "add", "add", "steps", "abort"]
    if "utility" in features:
        kinds += ["utility", "utility"]
    if "values" in features:
        kinds += ["raw"]
    if "bulk" in features:
        kinds += ["add_many"]
    kind = draw(st.sampled_from(kinds))
    if kind == "add":
        return draw(add_frame(vocab, features, clients))
    if kind == "step":
        return ("step", draw(STEP_DT))
    if kind == "steps":
        return ("steps", draw(st.integers(2, 40)), draw(STEP_DT))
    if kind == "abort":
        return draw(abort_frame(features))
    if kind == "utility":
        return draw(utility_frame(features, clients))
    if kind == "raw":
        return draw(raw_frames())
    return draw(add_many(vocab))


@st.composite
def engine_settings(draw, features: frozenset, kv_blocks: Optional[bool] = None):
    """EngineSettings keyword arguments (token source as a spec, built later)."""
    vocab = draw(st.sampled_from([1, 2, 3, 5, 16, 100, 32000]))
    source: Tuple[Any, ...] = ("random",)
    if "tokens" in features:
        source = draw(
            st.sampled_from([("random",), ("echo",), ("range",), ("file",)]).flatmap(
                lambda s: st.just(s)
                if s[0] in ("random", "echo")
                else st.tuples(st.just("range"), st.integers(0, vocab - 1), st.integers(1, vocab)).filter(lambda t: t[1] < t[2])
                if s[0] == "range"
                else st.tuples(st.just("file"), st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=6))
            )
        )
    scheduler = "scheduler" in features
    use_kv = draw(st.booleans()) if kv_blocks is None else kv_blocks
    lengths = draw(st.sampled_from([None, None, "fixed:3", "uniform:1:6", "eos:0.3"]))
    latency = draw(st.sampled_from([None, None, None, (1.0, 0.0, 2.0), (0.5, 3.0, 0.0)]))
    return {
        "rank": draw(st.integers(0, 3)),
        "num_clients": draw(st.integers(1, 3)),
        "output_token_chunk_size": draw(st.integers(1, 4)),
        "vocab_size": vocab,
        "seed": draw(st.integers(0, 3)),
        "has_coordinator": draw(st.booleans()),
        "max_num_seqs": draw(st.one_of(st.none(), st.integers(1, 8))) if scheduler else None,
        "scheduling_policy": draw(st.sampled_from(["fcfs", "priority"])) if scheduler else "fcfs",
        "kv_blocks": draw(st.integers(3, 40)) if use_kv else None,
        "block_size": 16,
        "max_num_batched_tokens": draw(st.one_of(st.none(), st.integers(1, 64))) if scheduler else None,
        "prefix_caching": draw(st.booleans()) if scheduler else False,
        "max_model_len": draw(st.sampled_from([1 << 20, 1 << 20, 64, 12])),
        "output_lengths": lengths,
        "latency": latency,
        "token_source": source,
    }


def build_settings(spec: Dict[str, Any]) -> EngineSettings:
    kw = dict(spec)
    source = kw.pop("token_source")
    lengths = kw.pop("output_lengths")
    latency = kw.pop("latency")
    if lengths == "eos:0.3":
        kw["output_lengths"] = OutputLengths.eos(0.3)
    elif lengths:
        kw["output_lengths"] = OutputLengths.parse(lengths)
    if latency:
        kw["latency"] = LatencyModel(itl_ms=latency[0], ttft_ms=latency[1], prefill_ms_per_token=latency[2])
    if source[0] == "echo":
        kw["token_source"] = EchoTokens()
    elif source[0] == "range":
        kw["token_source"] = RandomTokens(spec["vocab_size"], spec["seed"], spec["rank"], source[1], source[2])
    elif source[0] == "file":
        kw["token_source"] = FileTokens(source[1], spec["seed"], spec["rank"])
    return EngineSettings(**kw)


@st.composite
def scenarios(draw, features: frozenset, kv_blocks: Optional[bool] = None):
    spec = draw(engine_settings(features, kv_blocks))
    # min_size 8 makes Hypothesis draw ~16 operations on average (the default
    # average list size is 5, too short for the interleavings that matter).
    ops = draw(st.lists(operation(spec["vocab_size"], features, spec["num_clients"]), min_size=8, max_size=60))
    return spec, ops


ALL = frozenset({"values", "tokens", "stops", "xargs", "utility", "scheduler", "bulk", "sampling"})


# --------------------------------------------------------------------------
# The driver: frames -> decode -> apply, steps on a fake clock
# --------------------------------------------------------------------------


class StepClock:
    """The engine clock: constant between steps, advanced by each step."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Observer:
    """Sees every decoded input and every returned message; raises on a violation."""

    def input(self, run: "Run", message: Any) -> None:
        pass

    def output(self, run: "Run", client: int, message: List[Any]) -> None:
        pass

    def after(self, run: "Run") -> None:
        """After every apply and every step."""

    def end(self, run: "Run") -> None:
        pass


class Run:
    def __init__(self, spec: Dict[str, Any], observers: List[Observer]) -> None:
        self.spec = spec
        self.settings = build_settings(spec)
        self.clock = StepClock()
        self.engine = EngineCore(self.settings, clock=self.clock)
        self.observers = observers
        self.next_step_at: Optional[float] = None
        self.added_ids: Dict[str, None] = {}  # every id of a decoded ADD, in order
        self.stats = Counter()

    # -- input ---------------------------------------------------------------

    def frames(self, frames: List[bytes]) -> None:
        try:
            message = decode_input(frames, LAYOUT)
        except ProtocolError:
            self.stats["rejected"] += 1  # the reader logs and drops it
            return
        self.stats["decoded"] += 1
        if isinstance(message, ADD_TYPES):
            self.added_ids[message.request_id] = None
        for observer in self.observers:
            observer.input(self, message)
        self.emit(self.engine.apply(message))

    def add_payload(self, payload: Any) -> None:
        self.frames([EngineCoreRequestType.ADD.value, msgpack.packb(payload, use_bin_type=True)])

    def abort_payload(self, payload: Any) -> None:
        self.frames([EngineCoreRequestType.ABORT.value, msgpack.packb(payload, use_bin_type=True)])

    def utility_payload(self, payload: Any) -> None:
        self.frames([EngineCoreRequestType.UTILITY.value, msgpack.packb(payload, use_bin_type=True)])

    # -- steps ---------------------------------------------------------------

    def step(self, dt: float) -> bool:
        """One step as the runtime's stepper takes it; False when idle."""
        engine = self.engine
        if not engine.has_work:
            self.next_step_at = None
            return False
        now = self.clock.now + dt
        if self.next_step_at is not None and now < self.next_step_at:
            now = self.next_step_at
        self.clock.now = now
        self.emit(engine.step())
        self.next_step_at = engine.next_step_time(now)
        self.stats["steps"] += 1
        return True

    def emit(self, out: List[Tuple[int, List[Any]]]) -> None:
        for client, message in out:
            for observer in self.observers:
                observer.output(self, client, message)
        for observer in self.observers:
            observer.after(self)

    # -- operations ------------------------------------------------------------

    def do(self, op: Tuple[Any, ...]) -> None:
        kind = op[0]
        if kind == "add":
            self.add_payload(op[1])
        elif kind == "add_many":
            _, n, max_tokens, prompt_len, prefix = op
            for i in range(n):
                sampling = {"temperature": 1.0, "max_tokens": max_tokens}
                self.add_payload(engine_core_request(f"{prefix}{i}", list(range(prompt_len)), sampling))
        elif kind == "abort":
            self.abort_payload(op[1])
        elif kind == "abort_known":
            self.abort_payload(list(self.added_ids)[: op[1]])
        elif kind == "utility":
            self.utility_payload(op[1])
        elif kind == "raw":
            self.frames(op[1])
        elif kind == "step":
            self.step(op[1])
        elif kind == "steps":
            for _ in range(op[1]):
                if not self.step(op[2]):
                    break
        else:
            raise AssertionError(f"unknown op {op!r}")

    def finish(self) -> None:
        """Step until idle, abort everything, step until idle."""
        for _ in range(FINAL_STEPS):
            if not self.step(0.05):
                break
        if self.added_ids:
            self.abort_payload(list(self.added_ids))
        for _ in range(FINAL_STEPS):
            if not self.step(0.05):
                break
        for observer in self.observers:
            observer.end(self)


def run_scenario(scenario: Tuple[Dict[str, Any], List[Tuple[Any, ...]]], observers: List[Observer]) -> Run:
    spec, ops = scenario
    CASES.add(1 + len(ops))
    run = Run(spec, observers)
    for op in ops:
        run.do(op)
    run.finish()
    note(f"run stats: {dict(run.stats)}")
    return run


# --------------------------------------------------------------------------
# Observers: one per property
# --------------------------------------------------------------------------


class WireObserver(Observer):
    """(b) every message packs and passes wire_rules."""

    def __init__(self) -> None:
        #: call id -> method, for typed results; an id reused for another
        #: method is dropped (a deferred reply could belong to either call).
        self.methods: Dict[int, str] = {}
        self.ambiguous: set = set()

    def input(self, run, message):
        if isinstance(message, UtilityCall) and message.call_id not in self.ambiguous:
            if self.methods.setdefault(message.call_id, message.method) != message.method:
                del self.methods[message.call_id]
                self.ambiguous.add(message.call_id)

    def output(self, run, client, message):
        _, problems = wire_rules.pack_and_check(message, LAYOUT, engine_index=run.settings.rank, utility_methods=self.methods)
        if problems:
            raise violation(
                "WireRule_" + wire_rules.rule_of(problems[0]),
                f"message to client {client} breaks the wire rules:\n  " + "\n  ".join(problems[:6]) + f"\nmessage: {message!r:.1500}",
            )


class LedgerObserver(Observer):
    """(c) the engine's own ledger finds nothing wrong."""

    def after(self, run):
        summary = run.engine.ledger.summary()
        if summary["violations"]:
            raise violation("Ledger_violation", f"ledger: {summary['violations']} violation(s), e.g. {run.engine.ledger.violations[:3]}")


class PreemptionObserver(Observer):
    """(d) no PREEMPTED event at the timestamp of a SCHEDULED one (same step,
    in either order: vLLM schedules waiting requests only in a step that
    preempted none, and preempts only requests scheduled before), within one
    request's events and across requests: a request preempted in a step
    holds up every admission of that step, whoever it would admit (with the
    priority policy, a newcomer that fits in the blocks just freed). A
    request's events ride on its next output, so the times are gathered over
    the whole run and each new one is checked against all the others."""

    def __init__(self) -> None:
        self.scheduled: Dict[float, str] = {}  # timestamp -> a request SCHEDULED then
        self.preempted: Dict[float, str] = {}  # timestamp -> a request PREEMPTED then

    def output(self, run, client, message):
        events_at = LAYOUT.output_position("events")
        for output in message[1]:
            events = output[events_at] if len(output) > events_at else None
            if not events:
                continue
            rid = output[0]
            scheduled = {e["timestamp"] for e in events if e["type"] == EngineCoreEventType.SCHEDULED}
            preempted = {e["timestamp"] for e in events if e["type"] == EngineCoreEventType.PREEMPTED}
            if scheduled & preempted:
                raise violation(
                    "Preempted_in_admitting_step",
                    f"request {rid!r:.60} was SCHEDULED and PREEMPTED in the same step (t={sorted(scheduled & preempted)}): events {events}",
                )
            for t in scheduled:
                self.scheduled.setdefault(t, rid)
                if t in self.preempted:
                    raise violation(
                        "Admitted_in_preempting_step",
                        f"request {rid!r:.60} was SCHEDULED at t={t}, the step that PREEMPTED {self.preempted[t]!r:.60}: events {events}",
                    )
            for t in preempted:
                self.preempted.setdefault(t, rid)
                if t in self.scheduled:
                    raise violation(
                        "Admitted_in_preempting_step",
                        f"request {rid!r:.60} was PREEMPTED at t={t}, the step that SCHEDULED {self.scheduled[t]!r:.60}: events {events}",
                    )


class LifecycleObserver(Observer):
    """(e) one terminal per accepted ADD, on its client, nothing after it;
    finished_requests names every end; one reply per UTILITY, on its client;
    coordinator messages are stats only."""

    def __init__(self) -> None:
        self.open: Dict[str, List[int]] = defaultdict(list)  # id -> clients of its open ADDs
        self.calls: Counter = Counter()  # (client, call_id) -> replies owed

    def input(self, run, message):
        clients = run.settings.num_clients
        if isinstance(message, ADD_TYPES) and message.client_index < clients:
            self.open[message.request_id].append(message.client_index)
        elif isinstance(message, UtilityCall) and message.client_index < clients:
            self.calls[(message.client_index, message.call_id)] += 1

    def output(self, run, client, message):
        if client == COORDINATOR:
            if not run.settings.has_coordinator or message[1] or message[2] is None or len(message) > 4:
                raise violation("Lifecycle_coordinator", f"coordinator message is not stats-only (or no coordinator): {message!r:.300}")
            return
        if not 0 <= client < run.settings.num_clients:
            raise violation("Lifecycle_client", f"message to client {client}, which does not exist: {message!r:.300}")
        if len(message) > 4 and message[4] is not None:
            key = (client, message[4][0])
            if self.calls[key] <= 0:
                raise violation("Lifecycle_utility_reply", f"reply to call {message[4][0]} on client {client}: no such call pending (second reply or wrong client)")
            self.calls[key] -= 1
        finished = list(message[5]) if len(message) > 5 and message[5] else []
        terminal = Counter()
        for output in message[1]:
            rid = output[0]
            clients = self.open.get(rid)
            if not clients:
                raise violation("Lifecycle_after_terminal", f"output for {rid!r:.60} with no open ADD (after its terminal output, or never added): {output!r:.200}")
            if client not in clients:
                raise violation("Lifecycle_routing", f"output for {rid!r:.60} on client {client}, its ADD came from client(s) {clients}")
            if len(output) > 5 and output[5] is not None:
                terminal[rid] += 1
                clients.remove(client)
                if rid not in finished:
                    raise violation("Lifecycle_finished_requests", f"terminal output for {rid!r:.60} but its id is not in finished_requests {finished!r:.200}")
        for rid, count in Counter(finished).items():
            extra = count - terminal[rid]
            for _ in range(extra):  # abort_immediately: the id alone ends it
                clients = self.open.get(rid)
                if not clients or client not in clients:
                    raise violation("Lifecycle_finished_requests", f"finished_requests names {rid!r:.60} on client {client}, which has no open ADD there")
                clients.remove(client)
        for rid in terminal:
            if not self.open.get(rid):
                self.open.pop(rid, None)

    def end(self, run):
        still_open = {rid: clients for rid, clients in self.open.items() if clients}
        if still_open:
            raise violation("Lifecycle_no_terminal", f"{len(still_open)} request(s) never ended (after abort of every id): {list(still_open.items())[:5]!r:.400}")
        engine = run.engine
        if engine.num_active == 0 and (engine.used_blocks or engine.kv_tokens):
            # every request ended (by ABORT, pause/sleep in abort mode, ...): none holds KV
            raise violation("Lifecycle_kv_held", f"no request active, but {engine.used_blocks} KV block(s) and {engine.kv_tokens} token(s) held")
        owed = {key: n for key, n in self.calls.items() if n}
        if owed:
            raise violation("Lifecycle_utility_unanswered", f"utility calls never answered: {list(owed.items())[:5]}")


class StopCoverObserver(Observer):
    """(f) stop ids (+ EOS unless ignore_eos) covering the engine's whole
    vocabulary: the first token is a stop token, finish_reason STOP (vLLM
    check_stop, vllm/v1/core/sched/utils.py: EOS first, stop_reason nil; a
    stop id: stop_reason = that id)."""

    def __init__(self) -> None:
        self.watch: Dict[str, Tuple[Optional[int], bool]] = {}  # id -> (EOS id on the wire, ignore_eos)
        self.checked = 0

    def input(self, run, message):
        if not isinstance(message, EngineCoreRequest) or message.client_index >= run.settings.num_clients:
            return
        rid = message.request_id
        if rid in run.engine.active or rid in run.engine.waiting:
            return  # a duplicate of an active id (answered with ERROR)
        vocab = run.settings.vocab_size
        eos = message.eos_token_id if not message.ignore_eos else None
        cover = set(message.stop_token_ids) | ({eos} if eos is not None else set())
        eligible = (
            message.has_sampling_params
            and not message.abort_immediately
            and message.min_tokens == 0
            and (message.max_tokens or 0) > 0
            and run.settings.max_model_len > message.prompt_len
            and not any(key in message.extra_args for key in MOCK_KEYS)
            and run.spec["token_source"] == ("random",)
            and cover.issuperset(range(vocab))
            # (newer decoders) ids the sampling controls may force must be in the vocabulary
            and set(getattr(message, "allowed_token_ids", None) or ()).issubset(range(vocab))
            and set(getattr(message, "logit_bias", None) or ()).issubset(range(vocab))
        )
        if eligible:
            self.watch[rid] = (message.eos_token_id, message.ignore_eos)

    def output(self, run, client, message):
        for output in message[1]:
            rid = output[0]
            if rid not in self.watch:
                continue
            final = len(output) > 5 and output[5] is not None
            if not output[1]:
                if final:
                    del self.watch[rid]  # ended without a token (abort, pause, ...)
                continue
            eos, ignore_eos = self.watch.pop(rid)
            self.checked += 1
            token = output[1][0]
            stop_reason = output[6] if len(output) > 6 else None
            # EOS: stop_reason nil; a stop id: that id. An EOS id sent with
            # ignore_eos (no frontend does: Python drops the id, vllm-rs sends
            # none) is EOS to vLLM's check_stop and not to the mock: either.
            if token != eos:
                expected = {token}
            else:
                expected = {None, token} if ignore_eos else {None}
            if not (len(output[1]) == 1 and final and output[5] == FinishReason.STOP and stop_reason in expected):
                raise violation(
                    "StopCover_first_token_not_stop",
                    f"request {rid!r:.60}: its stop ids + EOS {eos} (ignore_eos {ignore_eos}) cover the vocabulary of "
                    f"{run.settings.vocab_size}, but its first output is tokens {output[1][:8]} finish_reason "
                    f"{output[5] if len(output) > 5 else None} stop_reason {stop_reason!r} (expected one stop token, "
                    f"STOP, stop_reason {' or '.join(sorted(map(repr, expected)))})",
                )


# --------------------------------------------------------------------------
# The properties
# --------------------------------------------------------------------------

#: The wire check, once per focus: each focus gets its own search, so a bug in
#: one area does not stop Hypothesis from looking at the others.
WIRE_FOCUS = {
    "xargs": frozenset({"xargs", "values"}),
    "tokens": frozenset({"tokens"}),
    "stops": frozenset({"stops"}),
    "utility": frozenset({"utility"}),
    "scheduler": frozenset({"scheduler", "bulk", "stops"}),
    "sampling": frozenset({"sampling", "stops"}),
    "all": ALL,
}


@pytest.mark.parametrize("focus", list(WIRE_FOCUS))
def test_every_output_packs_and_decodes_in_both_frontends(focus):
    """(a) + (b)."""

    @settings(max_examples=examples(650))
    @given(scenario=scenarios(WIRE_FOCUS[focus]))
    def check(scenario):
        run_scenario(scenario, [WireObserver()])

    check()


@settings(max_examples=examples(750))
@given(scenario=scenarios(ALL))
def test_the_ledger_finds_no_violation(scenario):
    """(a) + (c)."""
    run_scenario(scenario, [LedgerObserver()])


def test_no_request_is_preempted_in_the_step_that_admitted_it():
    """(a) + (d), with the KV cache always enforced (3..40 blocks of 16);
    fails unless some examples preempted under the priority policy (where a
    newcomer may outrank the preempted request at the head of the queue)."""
    counts: Counter = Counter()

    @settings(max_examples=examples(700))
    @given(scenario=scenarios(frozenset({"scheduler", "bulk"}), kv_blocks=True))
    def check(scenario):
        run = run_scenario(scenario, [PreemptionObserver()])
        if run.engine.counters["preemptions"]:
            counts[run.settings.scheduling_policy] += 1

    check()
    assert counts["priority"] > 0, f"no example preempted under the priority policy: {dict(counts)}"


@settings(max_examples=examples(900))
@given(scenario=scenarios(ALL))
def test_every_request_ends_exactly_once_and_every_call_is_answered(scenario):
    """(a) + (e)."""
    run_scenario(scenario, [LifecycleObserver()])


@settings(max_examples=examples(700))
@given(scenario=scenarios(frozenset({"stops", "scheduler"})))
def test_stop_ids_covering_the_vocabulary_stop_on_the_first_token(scenario):
    """(a) + (f)."""
    run_scenario(scenario, [StopCoverObserver()])


class BytesObserver(Observer):
    """Every message packed as it is returned (a reused output list changes
    in the next step, as the runtime's encoder sees it)."""

    def __init__(self) -> None:
        self.sent: List[Tuple[int, bytes]] = []

    def output(self, run, client, message):
        self.sent.append((client, msgpack.packb(message, use_bin_type=True)))


def _steady_counted(run: Run, counts: Counter) -> None:
    """Count the steps `steady_step` took in `run`."""
    steady_step = run.engine.output_processor.steady_step

    def counted():
        result = steady_step()
        counts["steady" if result is not None else "general"] += 1
        return result

    run.engine.output_processor.steady_step = counted


class LogprobRowsObserver(Observer):
    """(h): each output's new_logprobs read as the frontends read them
    (Appendix E), when it is returned (reused lists change at the next
    step); counts the steps that had a lane of requests with logprobs."""

    def __init__(self, counts: Counter) -> None:
        self.counts = counts

    def output(self, run, client, message):
        for output in message[1]:
            if len(output) < 3 or output[2] is None:
                continue
            tokens, (ids, lps, ranks) = output[1], output[2][:3]
            rows, columns = ids[1]
            found = (
                list(struct.unpack(f"<{rows * columns}{'q' if ids[0] == '<i8' else 'i'}", bytes(ids[2].data))),
                list(struct.unpack(f"<{rows * columns}f", bytes(lps[2].data))),
                list(struct.unpack(f"<{rows}q", bytes(ranks[2].data))),
            )
            for row in range(rows):
                row_ids = found[0][row * columns : (row + 1) * columns]
                row_lps = found[1][row * columns : (row + 1) * columns]
                problem = _row_problem(row_ids, row_lps, found[2][row], tokens[row] if row < len(tokens) else None)
                if problem:
                    raise violation("Logprob_rows", f"{output[0]!r} row {row}: {problem}: ids {row_ids} logprobs {row_lps} rank {found[2][row]}")
            self.counts["rows checked"] += rows

    def after(self, run):
        if any(key[2] is not None for key in run.engine.output_processor.lanes):
            self.counts["steps with a logprobs lane"] += 1


def _row_problem(ids: List[int], lps: List[float], rank: int, token: Optional[int]) -> Optional[str]:
    top_ids, top_lps = ids[1:], lps[1:]
    if ids[0] != token:
        return f"column 0 is {ids[0]}, the token {token}"
    if len(set(top_ids)) != len(top_ids):
        return "alternatives repeat"
    if any(lp > 0 for lp in lps) or any(a < b for a, b in zip(top_lps, top_lps[1:])):
        return "logprobs above 0 or increasing"
    if rank < 1:
        return "rank below 1"
    if rank <= len(top_ids) and (top_ids[rank - 1] != ids[0] or top_lps[rank - 1] != lps[0]):
        return "the sampled token is not at its rank"
    if rank > len(top_ids) and ids[0] in top_ids:
        return "the sampled token is among the alternatives beyond its rank"
    return None


def test_logprob_rows_carry_the_tokens_wherever_they_come_from():
    """(a) + (h); fails unless some examples ran a lane of requests with logprobs."""
    counts: Counter = Counter()

    @settings(max_examples=examples(400))
    @given(scenario=scenarios(frozenset({"tokens", "stops", "scheduler", "sampling", "bulk"})))
    def check(scenario):
        spec, ops = scenario
        CASES.add(1 + len(ops))
        run = Run({**spec, "reuse_outputs": True}, [LogprobRowsObserver(counts)])
        for op in ops:
            run.do(op)
        run.finish()

    check()
    assert counts["steps with a logprobs lane"] > 0 and counts["rows checked"] > 0, dict(counts)


@pytest.mark.parametrize("focus", ["scheduler", "all"])
def test_the_steady_step_sends_what_the_general_step_sends(focus):
    """(a) + (g); fails unless some examples took the steady path."""
    totals: Counter = Counter()

    @settings(max_examples=examples(400))
    @given(scenario=scenarios(WIRE_FOCUS[focus]))
    def check(scenario):
        spec, ops = scenario
        CASES.add(1 + len(ops))
        spec = {**spec, "reuse_outputs": True}
        sent = []
        for steady in (True, False):
            observer = BytesObserver()
            run = Run(spec, [observer])
            if steady:
                _steady_counted(run, totals)
            else:
                run.engine.output_processor.steady_step = lambda: None
            for op in ops:
                run.do(op)
            run.finish()
            sent.append(observer.sent)
        with_path, without = sent
        if with_path != without:
            at = next((i for i, (a, b) in enumerate(zip(with_path, without)) if a != b), min(len(with_path), len(without)))

            def shown(messages):
                return msgpack.unpackb(messages[at][1], raw=False, strict_map_key=False) if at < len(messages) else None

            raise violation(
                "Steady_step_differs",
                f"message {at} of {len(with_path)} (steady path) / {len(without)} (general):\n"
                f"  steady : {shown(with_path)!r:.600}\n"
                f"  general: {shown(without)!r:.600}",
            )

    check()
    assert totals["steady"] > 0, f"no example took the steady path: {dict(totals)}"
