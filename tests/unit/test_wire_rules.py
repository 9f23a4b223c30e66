"""tests/wire_rules.py itself: it passes what the engine sends and names
each thing a real frontend cannot decode."""

import msgpack
import pytest

import wire_rules
from gmock_engine.core.engine import EngineCore, EngineSettings
from gmock_engine.wire.inputs import EngineCoreRequest, UtilityCall
from gmock_engine.wire.outputs import scheduler_stats
from gmock_engine.wire.types import FinishReason

LAYOUT = wire_rules.DEFAULT_LAYOUT


def rules(message, **kw):
    return sorted({wire_rules.rule_of(p) for p in wire_rules.check_message(message, LAYOUT, **kw)})


def test_what_the_engine_sends_passes():
    clock = iter(float(t) for t in range(1, 10_000))
    engine = EngineCore(EngineSettings(rank=1, num_clients=1, kv_blocks=8, has_coordinator=True), clock=lambda: next(clock))
    out = engine.apply(EngineCoreRequest("a", 20, 4, True, prompt_token_ids=list(range(20))))
    out += engine.apply(EngineCoreRequest("b", 3, None, False))  # pooling: an ERROR output
    for method in ("is_sleeping", "get_supported_tasks", "wake_up", "gmock_stats", "no_such_method"):
        out += engine.apply(UtilityCall(0, 2**64 - 1, method, []))
    while engine.has_work:
        out += engine.step()
    assert len(out) > 5
    for _, message in out:
        data, problems = wire_rules.pack_and_check(message, LAYOUT, engine_index=1)
        assert data is not None and problems == [], (message, problems)


STATS = scheduler_stats(num_running_reqs=1, num_waiting_reqs=0, kv_cache_usage=0.5, step_counter=3)
ONE = [["r", [1, 2]]]


@pytest.mark.parametrize(
    "message,expected",
    [
        ([0, [], None, 1.0], ["family.empty"]),
        ([0, ONE, None, 1.0, [7, None, [None, None]]], ["family.mixed"]),
        ([0, [], None, 1.0, None, None, 3, 4], ["family.mixed"]),
        ([0, ONE, None, 1.0, None, None, None, None, None, None], ["outputs.length"]),
        ([-1, ONE, None, 1.0], ["engine_index"]),
        ([0, ONE, None, 1], ["timestamp"]),
        ([0, ONE, None, float("nan")], ["timestamp"]),
        ([0, [["r", [2**32]]], None, 1.0], ["new_token_ids.u32"]),
        ([0, [["r", [-1]]], None, 1.0], ["new_token_ids.u32"]),
        ([0, [["r", [True]]], None, 1.0], ["new_token_ids.u32"]),
        ([0, [[b"r", [1]]], None, 1.0], ["request_id"]),
        ([0, [["r", [1], None, None, None, 5]], None, 1.0], ["finish_reason"]),
        ([0, [["r", [1], None, None, None, 0, 2**32]], None, 1.0], ["stop_reason.u32"]),
        ([0, [["r", [1], None, None, None, 0, -5]], None, 1.0], ["stop_reason.u32"]),
        ([0, [["r", [1], None, None, None, 0, 1.5]], None, 1.0], ["stop_reason"]),
        ([0, [["r", [1], None, None, None, None, None, [{"type": 4, "timestamp": 1.0}]]], None, 1.0], ["events"]),
        ([0, [["r", [1], None, None, None, None, None, [{"type": 1}]]], None, 1.0], ["events"]),
        ([0, [["r", [1], None, None, None, None, None, None, None, None, None, {"num_prompt_tokens": -1}]], None, 1.0], ["prefill_stats"]),
        ([0, [["r", [1]] + [None] * 12], None, 1.0], ["num_nans_in_logits"]),  # nil at index 13
        ([0, [["r", [1], None, None, None, 3] + [None] * 7 + [0] + [None] * 4 + [{"code": "x", "message": "y"}]], None, 1.0], ["error"]),
        ([0, [["r", [1], None, None, None, 3] + [None] * 7 + [0] + [None] * 4 + [{"code": 1, "message": "y", "retryable": False}]], None, 1.0], ["error"]),
        ([0, [["r", [1], None, None, None, None, None, None, {1: 2}]], None, 1.0], ["kv_transfer_params"]),
        ([0, [], {"num_running_reqs": 1}, 1.0], ["scheduler_stats.missing"]),
        ([0, [], {**STATS, "prefix_cache_stats": {"reset": False}}, 1.0], ["scheduler_stats.missing"]),
        ([0, [], {**STATS, "kv_cache_eviction_events": None}, 1.0], ["scheduler_stats"]),
        ([0, [], {**STATS, "kv_cache_usage": 1.5}, 1.0], ["scheduler_stats.kv_usage"]),
        ([0, [], {**STATS, "step_counter": -1}, 1.0], ["scheduler_stats"]),
        ([0, [], None, 1.0, None, [1]], ["finished_requests"]),
        ([0, [], None, 1.0, [1, None]], ["utility"]),
        ([0, [], None, 1.0, [1, None, None]], ["utility.envelope"]),
        ([0, [], None, 1.0, [1, None, ["int", 3]]], ["utility.envelope"]),
        ([0, [], None, 1.0, [1.5, None, [None, 3]]], ["utility.call_id"]),
        ([0, [], None, 1.0, None, None, 2**32], ["dp_control"]),
    ],
)
def test_each_rule(message, expected):
    assert rules(message) == expected


def test_good_shapes_pass():
    assert rules([0, ONE, None, 1.0]) == []
    assert rules([0, [], STATS, 1.0]) == []
    assert rules([0, [["r", [], None, None, None, FinishReason.STOP, "stop string"]], None, 1.0, None, ["r"]]) == []
    assert rules([0, [], None, 1.0, [2**64 - 1, None, [None, {"x": [1]}]]]) == []
    assert rules([0, [], None, 1.0, [-(2**63), "boom", None]]) == []
    assert rules([3, [], None, 1.0, None, None, 7]) == []  # wave_complete
    assert rules([0, [["r", [1]] + [None] * 30], None, 1.0]) == ["num_nans_in_logits"]  # longer is fine, nil nans is not


def test_typed_utility_results_when_the_method_is_known():
    reply = [0, [], None, 1.0, [9, None, [None, None]]]
    assert rules(reply, utility_methods={9: "wake_up"}) == ["utility.result"]  # vllm-rs decodes a bool
    assert rules(reply, utility_methods={9: "sleep"}) == []


def test_engine_index_must_be_the_senders_rank():
    assert rules([2, ONE, None, 1.0], engine_index=1) == ["engine_index"]


def test_pack_failures_are_named():
    data, problems = wire_rules.pack_and_check([0, [["r", [10**30]]], None, 1.0])
    assert data is None
    assert [wire_rules.rule_of(p) for p in problems] == ["pack", "new_token_ids.u32"]
    data, problems = wire_rules.pack_and_check([0, [["r", [1]]], None, 1.0, None, {"a"}])  # a set
    assert data is None and wire_rules.rule_of(problems[0]) == "pack"
    data, problems = wire_rules.pack_and_check([0, [["r", (1, 2)]], None, 1.0])  # a tuple is an array
    assert msgpack.unpackb(data) == [0, [["r", [1, 2]]], None, 1.0] and problems == []
