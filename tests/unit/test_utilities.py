"""core/utilities.py through the engine's input: each call answered once, on the
caller's socket, with its call id; a result, or a failure for what the mock
does not know or cannot use, that call only (the common answers, pause
modes and gmock_stats' window are in test_engine.py; LoRA's in test_lora.py)."""

import pytest

from gmock_engine.wire.inputs import EngineCoreRequest, UtilityCall
from gmock_engine.wire.types import FinishReason
from gmock_engine.core.utilities import SUPPORTED_UTILITIES
from engine_steps import TickClock, engine_with, run, run_steps, tokens_of


def make(**settings):
    settings.setdefault("num_clients", 3)
    return engine_with(TickClock(), **settings)


def answer(engine, method, args=(), client=0, call_id=7):
    """Apply one call; the (client, [call_id, failure, result]) of its only answer."""
    sent = engine.apply(UtilityCall(client, call_id, method, args if not isinstance(args, (list, tuple)) else list(args)))
    replies = [(c, m[4]) for c, m in sent if len(m) > 4 and m[4] is not None]
    assert len(replies) == 1, sent
    (to, reply) = replies[0]
    assert reply[0] == call_id
    return to, reply


def result(engine, method, args=(), **kw):
    _, (_, failure, value) = answer(engine, method, args, **kw)
    assert failure is None, failure
    return value[1]


def failure(engine, method, args=(), **kw):
    _, (_, message, value) = answer(engine, method, args, **kw)
    assert value is None and isinstance(message, str)
    return message


def add(rid, max_tokens=5, client=0, **kw):
    return EngineCoreRequest(request_id=rid, prompt_len=8, max_tokens=max_tokens, has_sampling_params=True, client_index=client, **kw)


def test_the_table_is_sorted_and_holds_vllms_methods_and_gmock_stats():
    assert list(SUPPORTED_UTILITIES) == sorted(SUPPORTED_UTILITIES)
    for method in ("sleep", "wake_up", "pause_generation", "pause_scheduler", "resume_scheduler", "reset_prefix_cache",
                   "get_supported_tasks", "add_lora", "collective_rpc", "gmock_stats"):  # fmt: skip
        assert method in SUPPORTED_UTILITIES


@pytest.mark.parametrize("method", SUPPORTED_UTILITIES)
def test_every_method_answers_the_caller_with_its_call_id(method):
    engine = make()
    to, reply = answer(engine, method, client=2, call_id=2**63 + 5)
    assert to == 2 and reply[0] == 2**63 + 5


@pytest.mark.parametrize(
    "method,value",
    [("collective_rpc", []), ("compute_weight_checksums", []), ("release_kv_cache_memory", None), ("save_sharded_state", None)],
)
def test_executor_methods_answer_the_recommended_value(method, value):
    assert result(make(), method, ["anything", {"x": 1}]) == value


def test_an_unknown_method_fails_naming_the_mock_and_the_engine_goes_on():
    engine = make()
    engine.apply(add("r"))
    message = failure(engine, "start_profile_v2", client=1)
    assert message == "unsupported method 'start_profile_v2' (gmock_engine)"
    assert len(tokens_of(run(engine), "r")) == 5


def test_weight_version_round_trip():
    engine = make()
    assert result(engine, "get_weight_version") is None
    assert result(engine, "set_weight_version", ["step-1200"]) is None
    assert result(engine, "get_weight_version") == "step-1200"
    assert "must be a string, got int" in failure(engine, "set_weight_version", [12])
    assert result(engine, "get_weight_version") == "step-1200"  # the failed call changed nothing
    result(engine, "set_weight_version", [])  # no argument: back to none
    assert result(engine, "get_weight_version") is None


@pytest.mark.parametrize("level", [-1, True, "2", 1.5, None])
def test_sleep_refuses_a_level_that_is_not_a_non_negative_int(level):
    engine = make()
    engine.apply(add("r", 20))
    run_steps(engine, 2)
    assert "Invalid sleep level" in failure(engine, "sleep", [level])
    assert result(engine, "is_sleeping") is False and engine.num_active == 1  # not paused, nothing aborted


def test_sleep_level_zero_pauses_and_a_bad_mode_leaves_the_level():
    engine = make()
    assert result(engine, "sleep", [0, "keep"]) is None
    assert result(engine, "is_sleeping") is True and result(engine, "is_scheduler_paused") is True  # paused, though level 0
    assert result(engine, "wake_up") is True
    assert "Invalid pause mode" in failure(engine, "sleep", [2, "later"])
    assert result(engine, "is_sleeping") is False


def test_sleep_defaults_to_abort_mode():
    engine = make()
    engine.apply(add("a", 50))
    run_steps(engine, 2)
    sent = engine.apply(UtilityCall(0, 1, "sleep", []))
    assert [o[5] for _, m in sent for o in m[1]] == [FinishReason.ABORT]
    assert engine.num_active == 0


def test_pause_scheduler_keep_holds_new_adds_without_rejecting_them():
    engine = make()
    assert result(engine, "pause_scheduler", ["keep"]) is None
    assert engine.apply(add("held", 3)) == []  # neither rejected nor started
    assert not engine.has_work
    result(engine, "resume_scheduler")
    assert len(tokens_of(run(engine), "held")) == 3


def test_pause_wait_with_nothing_running_answers_at_once():
    engine = make()
    assert result(engine, "pause_generation", ["wait"]) is None
    assert result(engine, "is_scheduler_paused") is True


def test_wait_mode_answers_every_waiting_call_on_its_own_socket():
    engine = make()
    engine.apply(add("w", 4))
    first = engine.step()
    assert engine.apply(UtilityCall(1, 11, "pause_scheduler", ["wait"])) == []
    assert engine.apply(UtilityCall(2, 12, "pause_generation", ["wait"])) == []
    sent = first + run(engine)
    replies = sorted((c, m[4][0]) for c, m in sent if len(m) > 4 and m[4] is not None)
    assert replies == [(1, 11), (2, 12)]
    assert len(tokens_of(sent, "w")) == 4


@pytest.mark.parametrize("method", ["sleep", "pause_generation", "pause_scheduler", "reset_prefix_cache", "gmock_stats"])
def test_arguments_that_are_not_a_list_fail_that_call_only(method):
    engine = make()
    engine.apply(add("r", 6))
    message = failure(engine, method, 5)
    assert message.startswith(f"{method}: bad arguments 5: TypeError")
    assert result(engine, "is_scheduler_paused") is False
    assert len(tokens_of(run(engine), "r")) == 6


def test_reset_prefix_cache_is_refused_while_requests_hold_blocks_unless_it_may_preempt_them():
    engine = make(prefix_caching=True, block_size=4)
    engine.apply(add("r", 30, prompt_token_ids=list(range(8))))
    sent = run_steps(engine, 3)
    assert result(engine, "reset_prefix_cache", [False, False]) is False
    assert result(engine, "reset_prefix_cache", [True, False]) is True  # preempted first, then cleared
    assert result(engine, "gmock_stats")["counters"]["preemptions"] == 1
    sent += run(engine)
    assert len(tokens_of(sent, "r")) == 30  # it goes on after recomputing: nothing lost
    assert result(engine, "reset_prefix_cache") is True  # idle: nothing holds blocks


def test_reset_running_requests_without_prefix_caching_preempts_nothing():
    engine = make()
    engine.apply(add("r", 10))
    run_steps(engine, 2)
    assert result(engine, "reset_prefix_cache", [True, False]) is True
    assert result(engine, "gmock_stats")["counters"].get("preemptions", 0) == 0


def test_gmock_stats_reports_the_batch_and_the_books():
    engine = make(max_num_seqs=1)
    for rid in "abc":
        engine.apply(add(rid, 3))
    run_steps(engine, 1)
    stats = result(engine, "gmock_stats", [], client=1)
    assert (stats["rank"], stats["active"], stats["waiting"]) == (0, 1, 2)
    assert stats["ledger"]["started"] == 3 and stats["ledger"]["active"] == 3
    assert stats["counters"]["steps"] >= 1
    assert "lora" not in stats
    run(engine)
    stats = result(engine, "gmock_stats")
    assert (stats["active"], stats["waiting"], stats["ledger"]["finished_length"]) == (0, 0, 3)
    assert "lora" in result(make(enable_lora=True), "gmock_stats")


def test_is_sleeping_follows_pause_and_sleep_separately():
    engine = make()
    assert result(engine, "pause_scheduler", ["keep"]) is None
    assert result(engine, "is_sleeping") is True  # vLLM 0.33: a paused scheduler counts as sleeping
    result(engine, "resume_scheduler")
    assert result(engine, "is_sleeping") is False
    result(engine, "sleep", [1, "keep"])
    result(engine, "resume_scheduler")  # resumes the scheduler, but level 1 stays: still asleep
    assert result(engine, "is_sleeping") is True and result(engine, "is_scheduler_paused") is False
    assert result(engine, "wake_up", [["weights"]]) is True
    assert result(engine, "is_sleeping") is False
