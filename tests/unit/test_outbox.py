"""Outbox.flush: one EngineCoreOutputs per client of the call, stats on the
first only, every id in finished_requests of its own client's message."""

from gmock_engine.ledger import Ledger
from gmock_engine.outbox import COORDINATOR, Outbox
from gmock_engine.protocol import FinishReason, engine_core_output


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
