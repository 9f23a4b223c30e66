"""The request ledger: exactly one terminal output, nothing after it."""

import pytest

from gmock_engine.core.engine import EngineCore, EngineSettings, LedgerViolation
from gmock_engine.core.ledger import Ledger
from gmock_engine.wire.inputs import AbortRequests, EngineCoreRequest, UtilityCall


def msg(outputs, finished=None):
    m = [0, outputs, None, 1.0]
    if finished:
        m += [None, finished]
    return m


def test_a_normal_request_balances():
    ledger = Ledger()
    ledger.started("a")
    assert ledger.sent(msg([["a", [1]]])) is None
    assert ledger.sent(msg([["a", [2], None, None, None, 1]], ["a"])) is None
    assert ledger.summary() == {"started": 1, "finished_length": 1, "active": 0, "violations": 0}


@pytest.mark.parametrize(
    "messages,expected",
    [
        ([msg([["a", [], None, None, None, 1]], ["a"]), msg([["a", [5]]])], "after its terminal output"),
        ([msg([["zzz", [5]]])], "never started"),
        ([msg([], ["ghost"])], "finished_requests names ghost"),
        ([msg([["a", [], None, None, None, 2]], ["a"]), msg([["a", [], None, None, None, 2]], ["a"])], "after its terminal"),
    ],
)
def test_violations_are_found(messages, expected):
    ledger = Ledger()
    ledger.started("a")
    found = [v for m in messages for v in (ledger.sent(m) or [])]
    assert found and expected in found[0]
    assert ledger.summary()["violations"] == len(found)


def test_abort_immediately_and_duplicates_are_not_violations():
    ledger = Ledger()
    ledger.started("x")
    assert ledger.sent(msg([], ["x"])) is None  # abort_immediately: only finished_requests
    ledger.started("d")
    ledger.started("d")  # duplicate: answered with its own ERROR, the original goes on
    assert ledger.sent(msg([["d", [], None, None, None, 3]], ["d"])) is None
    assert ledger.sent(msg([["d", [7]]])) is None
    assert ledger.sent(msg([["d", [8], None, None, None, 1]], ["d"])) is None
    summary = ledger.summary()
    assert summary["active"] == 0 and summary["duplicates"] == 1 and summary["violations"] == 0


def test_memory_of_ended_ids_is_bounded():
    ledger = Ledger(memory=3)
    for i in range(10):
        ledger.started(f"r{i}")
        ledger.sent(msg([[f"r{i}", [], None, None, None, 1]], [f"r{i}"]))
    assert len(ledger._ended) == 3
    assert "after its terminal" in ledger.sent(msg([["r9", [1]]]))[0]
    assert "never started" in ledger.sent(msg([["r0", [1]]]))[0]


def test_the_engine_keeps_its_books_through_every_path():
    engine = EngineCore(EngineSettings(rank=0, num_clients=1, max_num_seqs=2))
    for i in range(5):
        engine.apply(EngineCoreRequest(f"r{i}", 3, 4, True))
    engine.apply(EngineCoreRequest("r0", 3, 4, True))  # duplicate
    engine.apply(EngineCoreRequest("none", 3, None, False))  # pooling: ERROR
    engine.apply(EngineCoreRequest("imm", 3, 4, True, abort_immediately=True))
    engine.step()
    engine.apply(AbortRequests(["r1", "r4", "unknown"]))
    engine.apply(UtilityCall(0, 1, "pause_generation", ["abort", True]))
    engine.apply(UtilityCall(0, 2, "resume_scheduler", []))
    engine.apply(EngineCoreRequest("late", 3, 2, True))
    while engine.has_work:
        engine.step()
    summary = engine.ledger.summary()
    assert summary["violations"] == 0 and summary["active"] == 0
    assert summary["started"] == 8 and summary["duplicates"] == 1


def test_strict_ledger_stops_on_a_violation():
    engine = EngineCore(EngineSettings(rank=0, num_clients=1, strict_ledger=True))
    engine.apply(EngineCoreRequest("a", 3, 2, True))
    while engine.has_work:
        engine.step()
    # as if the engine had a bug and sent one more output for the finished request
    with pytest.raises(LedgerViolation, match="after its terminal"):
        engine.outbox._report(engine.ledger.sent(msg([["a", [1]]])))


def test_an_abort_immediately_duplicate_does_not_end_the_original():
    """Found by the fuzzer: the duplicate is answered with ERROR, the original goes on."""
    engine = EngineCore(EngineSettings(rank=0, num_clients=1))
    engine.apply(EngineCoreRequest("x", 3, 4, True))
    engine.step()
    [(_, message)] = engine.apply(EngineCoreRequest("x", 3, 4, True, abort_immediately=True))
    assert message[1][0][5] == 3  # ERROR for the duplicate
    while engine.has_work:
        engine.step()
    assert engine.ledger.summary()["violations"] == 0 and engine.ledger.summary().get("finished_length", 0) == 1


def test_a_reused_id_is_remembered_as_newly_ended():
    """Found by the fuzzer: ids come back (clients retry with the same id)."""
    ledger = Ledger(memory=2)
    for rid in ("a", "b", "a"):  # "a" ends twice, then "b" must be the oldest
        ledger.started(rid)
        ledger.sent(msg([[rid, [], None, None, None, 1]], [rid]))
    ledger.started("c")
    ledger.sent(msg([["c", [], None, None, None, 1]], ["c"]))
    assert ledger.sent(msg([], ["a"])) is None  # still remembered: a repeat listing is harmless


@pytest.mark.parametrize("how", ["terminal output", "finished_requests only", "another client's message"])
def test_a_remembered_message_is_checked_again_once_a_request_ended(how):
    """A steady engine sends the same output lists step after step
    (reuse_outputs); the ledger remembers a message it found all open and
    does not check it id by id again, but only until a request ends: then
    the same outputs name an ended request, and that must be found."""
    ledger = Ledger()
    for rid in ("a", "b", "c"):
        ledger.started(rid)
    a, b = ["a", [1]], ["b", [2]]
    assert ledger.sent(msg([a, b])) is None
    a[1][0], b[1][0] = 3, 4  # the next step's tokens, in the same lists
    assert ledger.sent(msg([a, b])) is None
    if how == "terminal output":
        assert ledger.sent(msg([["a", [5], None, None, None, 1]], ["a"])) is None
    elif how == "finished_requests only":
        assert ledger.sent(msg([], ["a"])) is None  # abort_immediately
    else:
        assert ledger.sent(msg([["c", [6]], ["a", [5], None, None, None, 1]], ["a"])) is None
    found = ledger.sent(msg([a, b]))
    assert found and "after its terminal output" in found[0] and len(found) == 1


def test_only_messages_of_running_outputs_are_remembered_and_a_repeat_is_not_checked_again():
    ledger = Ledger()
    for rid in ("a", "b"):
        ledger.started(rid)
    first = [["a", [1], None, None, None, None, [{"type": 1, "timestamp": 0.0}]], ["b", [2]]]
    assert ledger.sent(msg(first)) is None
    assert ledger._checked == {}  # a first output's events are not kept alive
    running = [["a", [1]], ["b", [2]]]
    assert ledger.sent(msg(running)) is None
    # White box: the repeat is taken as checked. Had it been checked id by
    # id, "b" (taken out of the books behind the ledger's back) would be found.
    del ledger.open["b"]
    assert ledger.sent(msg(list(running))) is None
    assert ledger.sent(msg([["b", [9]], ["a", [1]]])) is not None  # other outputs: checked
    forgetful = Ledger(checked_memory=0)  # nothing remembered: every message checked
    for rid in ("a", "b"):
        forgetful.started(rid)
    assert forgetful.sent(msg(running)) is None
    del forgetful.open["b"]
    assert forgetful.sent(msg(running)) is not None


def test_a_busy_message_that_ends_requests_is_checked_output_by_output_and_not_remembered():
    # Many running outputs and a few ends in one message: the shape of every
    # step at high request rates, which takes the per-output path each time.
    ledger = Ledger()
    ids = [f"r{i}" for i in range(200)]
    for rid in ids:
        ledger.started(rid)
    running = [[rid, [i]] for i, rid in enumerate(ids[2:])]
    ends = [[ids[0], [7], None, None, None, 1], [ids[1], [], None, None, None, 0]]
    assert ledger.sent(msg(running[:100] + ends + running[100:], [ids[0], ids[1]])) is None
    assert ledger.summary()["finished_length"] == 1 and ledger.summary()["finished_stop"] == 1
    assert ledger._checked == {}  # it ended requests: remembered it is not
    # a stray among them (after its end) and one never started, next to a third end
    later = running[:50] + [[ids[0], [8]], ["ghost", [9]]] + running[50:] + [[ids[2], [1], None, None, None, 1]]
    found = ledger.sent(msg(later, [ids[2]]))
    assert found is not None and len(found) == 2
    assert any("r0 after its terminal output" in v for v in found) and any("ghost" in v and "never started" in v for v in found)
    assert ledger.summary()["finished_length"] == 2  # the third end is booked despite the strays
