"""The scenarios of the engine's property tests: Hypothesis strategies for
engine settings and streams of operations (ADD, ABORT, UTILITY and raw
frames built as the frontends build them, with adversarial values where a
feature asks for them, plus decode steps), each feature switched on by name
(`ALL`, `WIRE_FOCUS`). test_engine_properties.py says what is checked;
engine_driver.py runs a scenario. § sections: docs/protocol.md."""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import msgpack
from fake_frontend import engine_core_request
from hypothesis import strategies as st

from gmock_engine.content.lengths import OutputLengths
from gmock_engine.content.tokens import EchoTokens, FileTokens, RandomTokens
from gmock_engine.core.engine import EngineSettings
from gmock_engine.timing.latency import LatencyModel

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
