"""Outputs on their way out: pure (vLLM: the engine core's output batching).

During one input or one step the engine puts each request's output into the
batch of its client (§4.1: one EngineCoreOutputs per client and step);
`flush` turns the batches into messages, attaches SchedulerStats to the
first of them when due (§7.3) and copies them to the DP coordinator (§6.2),
and passes every message through the ledger (ledger.py) on its way out.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

from gmock_engine.core.ledger import Ledger
from gmock_engine.wire.outputs import engine_core_outputs

#: One message to send: (client index = output socket, EngineCoreOutputs array).
Outbound = Tuple[int, List[Any]]
#: Client index of the coordinator_output socket in Outbound pairs (vLLM uses -1 too).
COORDINATOR = -1
#: SchedulerStats go out when something they show changed, at most this often
#: while requests run (at once when the engine becomes idle, so gauges drop to 0).
STATS_INTERVAL_S = 0.05
#: While requests run and nothing the stats show moved, how soon to look again.
STATS_RECHECK_S = 0.002


class LedgerViolation(RuntimeError):
    """An engine sent something a frontend must never see (--strict-ledger)."""


class Outbox:
    """Per-client batches of one call, the stats cadence and the ledger check."""

    def __init__(
        self,
        rank: int,
        clock: Callable[[], float],
        ledger: Ledger,
        stats_if_due: Callable[[float], Optional[Dict[str, Any]]],
        has_coordinator: bool,
        strict_ledger: bool,
        log: Any,
    ) -> None:
        self.rank = rank
        self.clock = clock
        self.ledger = ledger
        #: now -> SchedulerStats, or None when none are due (StatsCadence)
        self._stats_if_due = stats_if_due
        self.has_coordinator = has_coordinator
        self.strict_ledger = strict_ledger
        self.log = log
        #: client index -> its outputs in the call being built (a plain
        #: dict of lists: the per-token path appends to them inline)
        self.outputs: Dict[int, List[List[Any]]] = {}
        #: client index -> the ids for its finished_requests in this call
        self.finished: Dict[int, List[str]] = {}

    def outputs_for(self, client: int) -> List[List[Any]]:
        """The outputs list of `client` in the call being built."""
        outputs = self.outputs.get(client)
        if outputs is None:
            outputs = self.outputs[client] = []
        return outputs

    def finish(self, client: int, request_id: str) -> None:
        """`request_id` goes into `client`'s finished_requests of this call
        (alone: abort_immediately, §3.2; with its terminal output: `end`)."""
        finished = self.finished.get(client)
        if finished is None:
            self.finished[client] = [request_id]
        else:
            finished.append(request_id)

    def end(self, client: int, request_id: str, output: List[Any]) -> None:
        """A request's terminal output, and its id in finished_requests."""
        self.outputs_for(client).append(output)
        self.finish(client, request_id)

    def discard(self) -> None:
        """Drop what the call has gathered (a step that failed)."""
        self.outputs = {}
        self.finished = {}

    def flush(self) -> List[Outbound]:
        """One EngineCoreOutputs per client; SchedulerStats on the first one
        when due (§4.1, §7.3), and then also to the coordinator (§6.2).
        Every message passes the ledger on its way out."""
        outputs, finished = self.outputs, self.finished
        if not outputs and not finished:
            return []
        self.outputs = {}
        if not finished and len(outputs) == 1:
            for client, batch in outputs.items():
                if batch:
                    return self._single(client, batch)
        now = self.clock()
        stats = self._stats_if_due(now)
        if finished:
            self.finished = {}
        out: List[Outbound] = []
        rank, checked, make = self.rank, self._checked, engine_core_outputs
        for client, batch in outputs.items():
            out.append((client, checked(make(rank, batch, now, finished.pop(client, None) if finished else None, stats))))
            stats = None
        for client, ids in finished.items():  # ids with no output in this call (abort_immediately)
            out.append((client, checked(make(rank, [], now, ids, stats))))
            stats = None
        if out and out[0][1][2] is not None and self.has_coordinator:
            out.append((COORDINATOR, make(rank, [], now, None, out[0][1][2])))
        return out

    def flush_step(self, client: int, batch: List[List[Any]]) -> List[Outbound]:
        """`flush` of a call whose outputs are `batch`, all for `client`,
        and which ends nothing (OutputProcessor.steady_step's, lanes.py)."""
        if self.outputs or self.finished:  # something gathered before it: in order, one message
            self.outputs_for(client).extend(batch)
            return self.flush()
        return self._single(client, batch)

    def _single(self, client: int, batch: List[List[Any]]) -> List[Outbound]:
        """The common message (one client, nothing ended), built and checked
        inline: a layer of calls less for every step of a few requests,
        where the per-step cost is what a mock behind a real frontend
        spends. The layout is wire.outputs.engine_core_outputs'
        (§4.2), which a test holds it to."""
        now = self.clock()
        stats = self._stats_if_due(now)
        message = [self.rank, batch, stats, now if type(now) is float else float(now)]
        violations = self.ledger.sent(message)
        if violations:
            self._report(violations)
        if stats is not None and self.has_coordinator:
            return [(client, message), (COORDINATOR, engine_core_outputs(self.rank, [], now, None, stats))]
        return [(client, message)]

    def _checked(self, message: List[Any]) -> List[Any]:
        """`message`, once the ledger has seen it (violations reported)."""
        violations = self.ledger.sent(message)
        if violations:
            self._report(violations)
        return message

    def _report(self, violations: List[str]) -> None:
        for violation in violations[:5]:
            self.log.error("ledger violation engine={}: {}", self.rank, violation)
        if self.strict_ledger:
            raise LedgerViolation(violations[0])


class StatsCadence:
    """When SchedulerStats are due: something the frontend shows moved (the
    running/waiting counts, the KV usage, which grows with every token of a
    long request, or the prefix-cache counters); while requests run, at most
    every STATS_INTERVAL_S."""

    def __init__(self) -> None:
        self._counts: Tuple[int, int] = (0, 0)
        self._kv_usage = 0.0
        #: Until when `due` is False while requests run (STATS_INTERVAL_S
        #: after the last stats): an attribute, so the engine can check it
        #: before it takes the counts, once per step.
        self.quiet_until = float("-inf")

    def due(self, now: float, running: int, waiting: int, kv_usage: float, pending: bool) -> bool:
        if running and now < self.quiet_until:
            return False
        counts = (running, waiting)
        if counts == self._counts and kv_usage == self._kv_usage and not pending:
            if running:
                # nothing moved: the next look is STATS_RECHECK_S away, not
                # the next step (a step of a few requests costs less than
                # taking the counts); a change waits at most that long
                self.quiet_until = now + STATS_RECHECK_S
            return False
        self._counts, self._kv_usage, self.quiet_until = counts, kv_usage, now + STATS_INTERVAL_S
        return True
