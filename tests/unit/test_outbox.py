"""Outbox.flush: one EngineCoreOutputs per client of the call, stats on the
first only, every id in finished_requests of its own client's message.

§N: section N of docs/protocol.md."""

from gmock_engine.core.ledger import Ledger
from gmock_engine.core.outbox import COORDINATOR, Outbox
from gmock_engine.wire.outputs import engine_core_output
from gmock_engine.wire.types import FinishReason


class _Log:
    def __init__(self):
        self.errors = []

    def error(self, *args):
        self.errors.append(args)


def _outbox(stats=None, coordinator=False):
    ledger = Ledger()
    for rid in ("a", "b", "c", "d"):
        ledger.started(rid)
    log = _Log()
    return Outbox(0, lambda: 5.0, ledger, lambda now: stats, coordinator, False, log), ledger, log


def test_every_client_of_a_call_gets_one_message_with_its_own_ids():
    outbox, ledger, log = _outbox(stats={"running": 1})
    outbox.finish(2, "c")  # abort_immediately: an id, no output
    outbox.outputs_for(0).append(["a", [7]])
    outbox.end(0, "b", engine_core_output("b", [8], FinishReason.LENGTH))
    outbox.end(1, "d", engine_core_output("d", [], FinishReason.ABORT))
    out = outbox.flush()
    by_client = {client: message for client, message in out}
    assert sorted(by_client) == [0, 1, 2] and len(out) == 3
    assert [o[0] for o in by_client[0][1]] == ["a", "b"] and by_client[0][5] == ["b"]
    assert [o[0] for o in by_client[1][1]] == ["d"] and by_client[1][5] == ["d"]
    assert by_client[2][1] == [] and by_client[2][5] == ["c"]
    # SchedulerStats ride on the first message only (§7.3)
    assert [message[2] is not None for _, message in out] == [True, False, False]
    assert ledger.summary()["active"] == 1 and not log.errors  # a runs on; b, c, d ended
    assert outbox.flush() == []  # the call's lists were handed over, not kept


def test_stats_go_to_the_coordinator_too_and_a_discarded_call_sends_nothing():
    outbox, _, _ = _outbox(stats={"running": 1}, coordinator=True)
    outbox.finish(1, "c")
    out = outbox.flush()
    assert [client for client, _ in out] == [1, COORDINATOR]
    assert out[0][1][5] == ["c"] and out[1][1][1] == [] and out[1][1][2] == {"running": 1}
    outbox.outputs_for(0).append(["a", [1]])
    outbox.finish(0, "b")
    outbox.discard()
    assert outbox.flush() == []


def test_a_step_of_one_client_with_nothing_ended_is_the_general_message():
    # the common step's message, built inline by flush, is engine_core_outputs' (§4.2)
    from gmock_engine.wire.outputs import engine_core_outputs

    for stats, coordinator in ((None, False), ({"running": 2}, False), ({"running": 2}, True)):
        outbox, ledger, log = _outbox(stats=stats, coordinator=coordinator)
        outbox.outputs_for(3).extend([["a", [1]], ["b", [2]]])
        out = outbox.flush()
        assert out[0] == (3, engine_core_outputs(0, [["a", [1]], ["b", [2]]], 5.0, None, stats))
        assert type(out[0][1][3]) is float
        if coordinator:
            assert out[1] == (COORDINATOR, engine_core_outputs(0, [], 5.0, None, stats))
        else:
            assert len(out) == 1
        assert not log.errors


def test_a_step_of_one_client_is_checked_by_the_ledger_too():
    outbox, ledger, log = _outbox()
    outbox.outputs_for(0).append(["never-started", [1]])
    outbox.flush()
    assert ledger.summary()["violations"] == 1 and log.errors
