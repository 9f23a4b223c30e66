"""No value in a request can stop the engine, and what it tells the
frontends stays true (bad vllm_xargs, stop ids covering the vocabulary,
preemption at admission, stale KV usage, the ledger's window, log floods)."""

import msgpack
import pytest

from gmock_engine.core.ledger import Ledger
from gmock_engine.utils.logs import Throttle, short
from gmock_engine.content.tokens import EchoTokens, FileTokens, RandomTokens
from gmock_engine.wire.eras import WIRE_LAYOUTS
from gmock_engine.wire.inputs import EngineCoreRequest, InvalidRequest, UtilityCall
from gmock_engine.wire.types import FinishReason
from engine_steps import Clock, engine_with, outputs_of, run

ERROR_AT = WIRE_LAYOUTS["0.33"].output_position("error")
EOS = 31999


def req(rid="r", max_tokens=10, prompt_len=4, **kw):
    kw.setdefault("eos_token_id", EOS)
    kw.setdefault("all_stop_token_ids", (EOS,))
    return EngineCoreRequest(rid, prompt_len, max_tokens, True, **kw)


# -- vllm_xargs: taken strictly, refused with a message naming key and value --

BAD_XARGS = [
    ({"mock_stop_token_id": 1e300, "mock_finish": "stop"}, "mock_stop_token_id must be an int in 0..4294967295, not 1e\\+300"),
    ({"mock_stop_token_id": 10**30, "mock_finish": "stop"}, "mock_stop_token_id must be an int"),
    ({"mock_stop_token_id": "1" * 30, "mock_finish": "stop"}, "mock_stop_token_id must be an int"),
    ({"mock_stop_token_id": 2**32}, "mock_stop_token_id must be an int in 0..4294967295, not 4294967296"),
    ({"mock_stop_token_id": -1}, "mock_stop_token_id must be an int in 0..4294967295, not -1"),
    ({"mock_stop_token_id": True}, "not True"),
    ({"mock_output_len": -1}, "mock_output_len must be an int in 1..9223372036854775807, not -1"),
    ({"mock_output_len": 0}, "mock_output_len must be an int in 1"),
    ({"mock_output_len": "12"}, "not '12'"),
    ({"mock_output_len": 0.5}, "not 0.5"),
    ({"mock_output_len": True}, "not True"),
    ({"mock_output_len": [1, 2]}, r"not \[1, 2\]"),
    ({"mock_fail_after": {"a": 1}}, "mock_fail_after must be an int in 0"),
    ({"mock_fail_after": 1e12}, "not 1000000000000.0"),
    ({"mock_finish": "maybe"}, "mock_finish must be stop, length or error, not 'maybe'"),
    ({"mock_finish": ["stop"]}, "mock_finish must be stop, length or error"),
    ({"mock_finish": {"stop": 1}}, "mock_finish must be stop, length or error"),
    ({"mock_ttft_ms": float("inf")}, "mock_ttft_ms must be a number in 0..3600000, not inf"),
    ({"mock_ttft_ms": float("nan")}, "not nan"),
    ({"mock_ttft_ms": -1}, "not -1"),
    ({"mock_ttft_ms": "5"}, "not '5'"),
    ({"mock_ttft_ms": False}, "not False"),
    ({"mock_output_length": 5}, "unknown key mock_output_length"),
]


@pytest.mark.parametrize("xargs,reason", BAD_XARGS, ids=[repr(x)[:50] for x, _ in BAD_XARGS])
def test_a_bad_vllm_xargs_value_ends_that_request_with_an_error_naming_it(xargs, reason):
    import re

    e = engine_with(Clock())
    out = e.apply(req(extra_args=xargs))
    sent = [m for _, m in out]
    [output] = outputs_of(out, "r")
    assert output[5] == FinishReason.ERROR and sent[0][5] == ["r"]
    assert output[ERROR_AT]["code"] == "validation_error"
    assert re.search(reason, output[ERROR_AT]["message"]), output[ERROR_AT]["message"]
    msgpack.packb(sent, use_bin_type=True)
    # nothing else is affected: the next request is served exactly
    e.apply(req("next", max_tokens=5))
    assert sum(len(o[1]) for o in outputs_of(run(e), "next")) == 5
    assert e.ledger.summary()["violations"] == 0 and e.ledger.summary()["finished_error"] == 1


@pytest.mark.parametrize(
    "xargs,tokens,finish",
    [
        ({"mock_output_len": 3}, 3, FinishReason.STOP),
        ({"mock_output_len": None}, 10, FinishReason.LENGTH),  # null: as if not given
        ({"mock_fail_after": 0}, 0, FinishReason.ERROR),
        ({"mock_stop_token_id": 2**32 - 1, "mock_finish": "stop"}, 10, FinishReason.STOP),
        ({"mock_ttft_ms": 0.5}, 10, FinishReason.LENGTH),
        ({"mock_output_len": 2**63 - 1}, 10, FinishReason.LENGTH),
        ({"kv_transfer_params": {"x": 1}, "other": "kept"}, 10, FinishReason.LENGTH),  # not ours: ignored
    ],
)
def test_good_vllm_xargs_values_still_work(xargs, tokens, finish):
    clock = Clock()
    e = engine_with(clock)
    e.apply(req(extra_args=xargs))
    outputs = outputs_of(run(e, clock, tick=0.01), "r")
    assert sum(len(o[1]) for o in outputs) == tokens and outputs[-1][5] == finish
    if "mock_stop_token_id" in xargs:
        assert outputs[-1][6] == 2**32 - 1 and outputs[-1][1][-1] == 2**32 - 1


def test_an_invalid_request_from_the_decoder_is_answered_once():
    e = engine_with(Clock())
    out = e.apply(InvalidRequest("bad", 0, "priority 'x' is not an int"))
    [(client, message)] = out
    assert client == 0 and message[5] == ["bad"]
    [output] = message[1]
    assert output[5] == FinishReason.ERROR and output[ERROR_AT]["message"] == "priority 'x' is not an int"
    assert e.ledger.summary() == {"started": 1, "finished_error": 1, "active": 0, "violations": 0}
    assert e.apply(InvalidRequest("bad", 5, "x")) == []  # no such client: nothing to answer on


def test_a_prompt_longer_than_max_model_len_is_refused():
    e = engine_with(max_model_len=100)
    [(_, message)] = e.apply(req(prompt_len=101))
    assert message[1][0][5] == FinishReason.ERROR and "max_model_len 100" in message[1][0][ERROR_AT]["message"]


def test_utility_calls_with_wrong_arguments_fail_that_call_only():
    e = engine_with(Clock())
    for call_id, (method, args) in enumerate(
        [("sleep", [[1, 2]]), ("sleep", [2**64 - 1, {"m": 1}]), ("pause_generation", [{"a": 1}]), ("set_weight_version", [5]), ("x" * 10_000, [])]
    ):
        [(_, message)] = e.apply(UtilityCall(0, call_id, method, args))
        reply = message[4]
        assert reply[0] == call_id and isinstance(reply[1], str) and reply[2] is None
        assert len(reply[1]) < 400
        msgpack.packb(message, use_bin_type=True)
    e.apply(UtilityCall(0, 99, "wake_up", []))
    e.apply(req())
    assert sum(len(o[1]) for o in outputs_of(run(e), "r")) == 10


# -- stop ids covering every id the engine could emit -----------------------------


def test_stop_ids_covering_the_vocabulary_stop_on_the_first_token():
    e = engine_with(vocab_size=50)
    e.apply(req(max_tokens=20, eos_token_id=None, all_stop_token_ids=(), stop_token_ids=tuple(range(50))))
    outputs = outputs_of(run(e), "r")
    assert sum(len(o[1]) for o in outputs) == 1
    last = outputs[-1]
    assert last[5] == FinishReason.STOP and last[6] == last[1][0] and 0 <= last[1][0] < 50  # stop_reason: the stop id hit


def test_covering_with_eos_reports_no_stop_reason_and_honours_min_tokens():
    e = engine_with(vocab_size=50)
    e.apply(req(max_tokens=20, eos_token_id=7, all_stop_token_ids=(7,), stop_token_ids=tuple(i for i in range(50) if i != 7), min_tokens=3))
    outputs = outputs_of(run(e), "r")
    tokens = [t for o in outputs for t in o[1]]
    assert len(tokens) == 3 and outputs[-1][5] == FinishReason.STOP
    assert all(0 <= t < 50 for t in tokens)


def test_covering_stops_even_on_the_last_allowed_token():
    e = engine_with(vocab_size=10)
    e.apply(req(max_tokens=1, eos_token_id=None, all_stop_token_ids=(), stop_token_ids=tuple(range(10))))
    assert outputs_of(run(e), "r")[-1][5] == FinishReason.STOP  # vLLM checks stops before length


def test_ignore_eos_leaves_the_eos_out_of_the_covering_set():
    e = engine_with(vocab_size=10)
    e.apply(req(max_tokens=6, eos_token_id=3, all_stop_token_ids=(3,), ignore_eos=True, stop_token_ids=tuple(i for i in range(10) if i != 3)))
    outputs = outputs_of(run(e), "r")
    assert sum(len(o[1]) for o in outputs) == 6 and outputs[-1][5] == FinishReason.LENGTH


def test_token_sources_say_whether_they_can_only_emit_stop_ids():
    random_tokens = RandomTokens(100, 0, 0, low=10, high=20)
    assert random_tokens.only_emits(0, frozenset(range(10, 20)))
    assert not random_tokens.only_emits(0, frozenset(range(11, 40)))
    assert random_tokens.avoid([10, 19], frozenset({10, 11, 19})) == [12, 12]  # wraps within [10, 20)
    echo = EchoTokens()
    state = echo.initial_state("r", [5, 6])
    assert echo.only_emits(state, {5, 6, 7}) and not echo.only_emits(state, {5})
    assert echo.avoid([5, 6], {5}) == [6, 6]
    assert echo.avoid([2**32 - 1], {2**32 - 1}) == [0]  # never beyond a u32
    file_tokens = FileTokens([1, 2, 3], 0, 0)
    assert file_tokens.only_emits(0, {1, 2, 3}) and not file_tokens.only_emits(0, {1, 2})


# -- the scheduler: running first, no preemption at admission ---------------------


def events_of(messages, rid):
    return [(e["type"], e["timestamp"]) for o in outputs_of(messages, rid) if len(o) > 7 and o[7] for e in o[7]]


def test_a_request_that_outgrows_the_whole_cache_alone_ends_with_error_not_a_cycle():
    """5 blocks of 16 and a request whose prompt fills them: it is admitted
    (vLLM admits a sequence that fits), and the KV of its first sampled
    token needs a sixth block that no preemption can free. It is preempted
    once and, as what it holds can no longer fit the whole cache, ends with
    ERROR: never admitted, preempted and re-admitted step after step."""
    clock = Clock()
    e = engine_with(clock, kv_blocks=5, block_size=16)
    e.apply(EngineCoreRequest("big", 80, 20, True))
    sent = run(e, clock, tick=0.01)
    outputs = outputs_of(sent, "big")
    assert [o[5] if len(o) > 5 else None for o in outputs[:-1]] == [None] * (len(outputs) - 1) and 1 <= len(outputs) - 1 < 20
    assert outputs[-1][5] == FinishReason.ERROR and outputs[-1][ERROR_AT]["code"] == "kv_cache_too_small"
    assert e.counters["preemptions"] == 1 and e.used_blocks == 0


def test_a_prompt_larger_than_the_whole_cache_ends_with_error_at_once():
    clock = Clock()
    e = engine_with(clock, kv_blocks=5, block_size=16)
    e.apply(EngineCoreRequest("big", 81, 20, True))
    outputs = outputs_of(run(e, clock, tick=0.01), "big")
    assert [o[5] for o in outputs] == [FinishReason.ERROR] and outputs[0][ERROR_AT]["code"] == "kv_cache_too_small"
    assert e.counters["preemptions"] == 0


def test_under_kv_pressure_no_request_is_preempted_in_the_step_that_admitted_it():
    clock = Clock()
    e = engine_with(clock, kv_blocks=6, block_size=4, prefix_caching=True)
    for i in range(6):
        e.apply(EngineCoreRequest(f"r{i}", 3 + i % 3, 12, True, prompt_token_ids=[i] * (3 + i % 3)))
    sent = run(e, clock, tick=0.01)
    assert e.counters["preemptions"] > 0  # the pressure is real
    for i in range(6):
        rid = f"r{i}"
        assert sum(len(o[1]) for o in outputs_of(sent, rid)) == 12
        events = events_of(sent, rid)
        scheduled = {t for kind, t in events if kind == 2}
        preempted = {t for kind, t in events if kind == 3}
        assert not scheduled & preempted, (rid, events)
    assert e.ledger.summary()["violations"] == 0 and e.used_blocks == 0


def test_no_admission_in_a_step_that_preempted():
    """Seen on the wire: no request is SCHEDULED at the time of a step in
    which any request was PREEMPTED (each step has its own time here)."""
    clock = Clock()
    e = engine_with(clock, kv_blocks=4, block_size=4)
    e.apply(EngineCoreRequest("a", 3, 6, True))
    e.apply(EngineCoreRequest("b", 3, 6, True))
    e.apply(EngineCoreRequest("c", 1, 6, True))  # fits only when something leaves
    sent = run(e, clock, tick=0.01)
    events = [event for rid in "abc" for event in events_of(sent, rid)]
    preempted_at = {t for kind, t in events if kind == 3}
    scheduled_at = {t for kind, t in events if kind == 2}
    assert preempted_at and not preempted_at & scheduled_at, events
    for rid in "abc":
        assert sum(len(o[1]) for o in outputs_of(sent, rid)) == 6


# -- KV usage in the stats does not go stale ----------------------------------------


def test_stats_follow_the_kv_usage_of_a_long_request():
    clock = Clock()
    e = engine_with(clock, num_gpu_blocks=10, block_size=16)
    e.apply(req(max_tokens=140, prompt_len=4))
    usages = []
    while e.has_work:
        for _, message in e.step():
            if message[2] is not None:
                usages.append(message[2]["kv_cache_usage"])
        clock.now += 0.06  # beyond the stats interval
    # one stats message per interval while it grows, then 0 when it ends
    assert len(usages) > 100 and usages == sorted(usages[:-1]) + [0.0]
    assert usages[-2] == pytest.approx((4 + 139) / 160)


# -- the ledger -----------------------------------------------------------------------


def test_more_ended_requests_in_one_message_than_the_ledger_remembers_are_not_violations():
    ledger = Ledger(memory=16)
    ids = [f"bench-{i}" for i in range(100)]
    for rid in ids:
        ledger.started(rid)
    message = [0, [[rid, [1], None, None, None, 1] for rid in ids], None, 1.0, None, ids]
    assert ledger.sent(message) is None
    assert ledger.summary() == {"started": 100, "finished_length": 100, "active": 0, "violations": 0}


def test_the_ledger_remembers_ended_ids_in_bounded_bytes():
    ledger = Ledger(memory=4)
    for i in range(10):
        rid = f"{i}-" + "x" * 1_000_000
        ledger.started(rid)
        ledger.sent([0, [[rid, [], None, None, None, 1]], None, 1.0, None, [rid]])
    assert len(ledger._ended) == 4 and all(isinstance(key, int) for key in ledger._ended)
    # a late output for a remembered id is still seen for what it is, and said briefly
    late = "9-" + "x" * 1_000_000
    [violation] = ledger.sent([0, [[late, [5]]], None, 1.0])
    assert "after its terminal output" in violation and len(violation) < 300


def test_long_ids_are_cut_in_log_lines():
    assert short("a" * 10) == "a" * 10
    text = short("b" * 1_000_000)
    assert len(text) < 200 and text.endswith("(1000000 chars)")


def test_the_throttle_writes_a_few_lines_per_kind_and_counts_the_rest():
    lines = []

    class Log:
        def opt(self, **kw):
            return self

        def warning(self, message, *args):
            lines.append(message.format(*args))

    clock = Clock(0.0)
    throttle = Throttle(Log(), per_window=3, window_s=10.0, clock=clock)
    written = [throttle.warning("dup", "dup {}", i) for i in range(10)]
    assert written == [True] * 3 + [False] * 7
    assert throttle.warning("other kind", "x")  # its own budget
    clock.now = 11.0
    assert throttle.warning("dup", "dup {}", 10)
    assert lines == ["dup 0", "dup 1", "dup 2", "x", "7 more 'dup' warnings left out in the last 11 s", "dup 10"]


def test_unchanged_stats_are_looked_at_again_after_the_recheck_interval_only():
    from gmock_engine.core.outbox import STATS_INTERVAL_S, STATS_RECHECK_S, StatsCadence

    cadence = StatsCadence()
    assert cadence.due(0.0, 1, 0, 0.5, False)  # the first figures go out
    assert not cadence.due(STATS_INTERVAL_S / 2, 2, 0, 0.5, False)  # too soon after them
    assert cadence.due(STATS_INTERVAL_S, 2, 0, 0.5, False)  # the change, once the interval is over
    later = 2 * STATS_INTERVAL_S
    assert not cadence.due(later, 2, 0, 0.5, False)  # nothing moved
    # a change right after an unchanged look waits for the recheck, not a whole interval
    assert not cadence.due(later + STATS_RECHECK_S / 2, 3, 0, 0.5, False)
    assert cadence.due(later + STATS_RECHECK_S, 3, 0, 0.5, False)
    # the engine going idle is said at once, whatever the window
    assert cadence.due(later + STATS_RECHECK_S + 1e-6, 0, 0, 0.0, False)
