"""The request ledger: the books on every request, kept from the wire.

Pure. It watches what an engine receives (ADD, ABORT) and what it sends
(every EngineCoreOutputs), independently of the engine's own state, and
checks the invariants a frontend relies on (docs/protocol.md §3.4, §4.2):

* every started request gets exactly one terminal output (a finish reason),
  or, for `abort_immediately`, only its id in `finished_requests`;
* nothing is sent for a request after its terminal output;
* nothing is sent for an id the engine never started;
* every id in `finished_requests` has ended.

A violation is counted and logged as an error (the runtime can make it
fatal with --strict-ledger). To stay bounded in a 12-hour soak, ended ids
are remembered for the last `memory` requests only: a late output for an
older one is reported as "for an unknown id" instead. They are remembered
by a 64-bit hash, not by the id itself: ids come from clients, and 1 024
ids of 1 MB each would otherwise hold 1 GB.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from typing import Any, Dict, List, Optional

from gmock_engine.utils.logs import short as _short
from gmock_engine.wire.types import FinishReason

_NONE: frozenset = frozenset()
#: wire finish_reason -> the name its counter is kept under (a dict lookup,
#: not `FinishReason(value).name` per end: an enum call costs far more)
_REASON_NAMES: Dict[int, str] = {int(reason): reason.name.lower() for reason in FinishReason}
_ERROR = int(FinishReason.ERROR)

#: Messages remembered as checked (`Ledger._checked`): one per client is
#: what a steady engine needs; beyond this many, the memory starts afresh.
CHECKED_MEMORY = 16

#: Ended request ids kept to recognise late outputs: a small window, so a
#: soak's RSS settles at once; an output for an id that ended more
#: than this many requests ago is still a violation, reported as "unknown id".
DEFAULT_MEMORY = 1024


class Ledger:
    """Invariant checks and counters for one engine."""

    def __init__(self, memory: int = DEFAULT_MEMORY, checked_memory: int = CHECKED_MEMORY) -> None:
        self.open: Dict[str, None] = {}
        #: hash(id) of recently ended requests, oldest first (bounded in bytes
        #: whatever the ids' size; a collision only hides a violation).
        self._ended: "OrderedDict[int, None]" = OrderedDict()
        self._memory = memory
        self.counts: Counter = Counter()
        #: Duplicate ADDs of an open id, each answered with its own ERROR output.
        self._duplicates: Counter = Counter()
        self.violations: List[str] = []
        self._violation_log_limit = 100
        #: The outputs of recent messages of running outputs only (`[id,
        #: tokens]`), all open, by the identity of their first output. A message
        #: with equal outputs (the same ids, in the same order, of the same
        #: lengths) is found open by the same check as long as nothing has
        #: ended since, so it is not checked id by id again: a steady
        #: engine's outputs are the same reused lists step after step
        #: (OutputProcessor.reuse_outputs). Forgotten whenever a request ends.
        self._checked: Dict[int, List[Any]] = {}
        #: 0: nothing remembered (an engine that makes new lists every step
        #: would only keep its last messages alive for nothing).
        self._checked_memory = checked_memory

    # -- what the engine received ------------------------------------------------

    def started(self, request_id: str) -> None:
        """An ADD the engine will answer (accepted, or ended at once)."""
        if request_id in self.open:
            # The Rust mock's rule: the duplicate gets an ERROR, the original goes on.
            self._duplicates[request_id] += 1
            self.counts["duplicates"] += 1
            return
        self.counts["started"] += 1
        self.open[request_id] = None

    # -- what the engine sent -------------------------------------------------------

    def sent(self, message: List[Any]) -> Optional[List[str]]:
        """Check one EngineCoreOutputs; return the new violations, if any.

        Per token this is one dict lookup (running outputs are the 2-element
        `[id, tokens]`), or nothing for a message equal to one checked since
        the last end (`_checked`); per request end, a little more.
        """
        outputs = message[1] if len(message) > 1 else ()
        checked = self._checked
        if len(message) < 6 and outputs and checked.get(id(outputs[0])) == outputs:
            return None  # a steady step: as a message checked since the last end, no finished_requests
        found: List[str] = []
        open_ids = self.open
        answered_here: Any = _NONE  # ids with a terminal output in this message
        if outputs and checked.get(id(outputs[0])) == outputs:
            pass  # as a message checked since the last end: only open ids, none terminal
        elif outputs:
            # One pass over every output (this runs for every token, and at
            # high request rates in nearly every step: each end forgets the
            # remembered messages): a running output of an open request
            # ([id, tokens], 2 long) needs nothing more; the others, the
            # step's first and last outputs and any stray, are looked at
            # below: one pass, cheaper than a C-level lookup pass and a
            # second pass for finish reasons.
            odd = [o for o in outputs if len(o) != 2 or o[0] not in open_ids]
            if odd:
                strays = {o[0] for o in odd if o[0] not in open_ids}
                found.extend(self._stray(rid) for rid in strays)
                # (only an output longer than 5 can carry a finish_reason)
                terminal = [o for o in odd if len(o) > 5 and o[5] is not None]
            else:
                terminal = odd
            if terminal:
                answered_here = set()
            for output in terminal:
                rid = output[0]
                if rid not in open_ids:
                    continue  # reported above
                answered_here.add(rid)
                if output[5] == _ERROR and self._duplicates[rid]:
                    self._duplicates[rid] -= 1  # the duplicate's answer, not the original's end
                    if not self._duplicates[rid]:
                        del self._duplicates[rid]
                    continue
                self._end(rid, _REASON_NAMES.get(output[5]) or FinishReason(output[5]).name.lower())
            if not odd and self._checked_memory:
                # only running outputs ([id, tokens]) of open requests:
                # remembered (a first output's events are not kept alive
                # for this; a message that ends a request is not either:
                # the end forgets every message)
                if len(checked) >= self._checked_memory:
                    checked.clear()
                checked[id(outputs[0])] = outputs
        finished = message[5] if len(message) > 5 else None
        if finished:
            for rid in finished:
                if rid in open_ids:  # abort_immediately (no output), or a duplicate's answer
                    if rid not in answered_here:
                        self._end(rid, "abort")
                elif rid not in answered_here and hash(rid) not in self._ended:
                    # (answered_here: ended by this very message, even if
                    # more than `memory` ended in it and the window moved on)
                    found.append(f"finished_requests names {_short(rid)}, which never started")
        if not found:
            return None
        self.counts["violations"] += len(found)
        self.violations.extend(found[: max(0, self._violation_log_limit - len(self.violations))])
        return found

    def _stray(self, rid: str) -> str:
        if hash(rid) in self._ended:
            return f"output for {_short(rid)} after its terminal output"
        return f"output for {_short(rid)}, which the engine never started (or ended long ago)"

    def _end(self, rid: str, reason: str) -> None:
        del self.open[rid]
        self._checked.clear()  # a remembered message may name it
        self.counts["finished_" + reason] += 1
        ended = self._ended
        key = hash(rid)
        ended[key] = None
        ended.move_to_end(key)  # a reused id is the newest again, not the next to go
        if len(ended) > self._memory:
            ended.popitem(last=False)

    # -- reports --------------------------------------------------------------------

    def summary(self) -> Dict[str, int]:
        """Counters, with the requests still open as `active`."""
        out = dict(self.counts)
        out["active"] = len(self.open)
        out.setdefault("violations", 0)
        return out
