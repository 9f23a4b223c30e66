"""Property tests of the engine with its outputs reused, as the runtime runs
it (`reuse_outputs`), over the scenarios and the driver of
test_engine_properties.py (which lists properties (a) to (f)):

(g) the steady step (OutputProcessor.steady_step, core/lanes.py) sends the
    same bytes as the general step: each scenario runs once as it is and
    once with that path turned off;
(h) every new_logprobs row is self-consistent (distinct alternatives,
    non-increasing logprobs <= 0, the sampled token at its rank when within
    k) and carries the output's own tokens in column 0, wherever the rows
    come from (drawn, a RowPool on the full path, a lane of requests with
    logprobs).

Profiles, example counts and the printed case total: conftest.py here.

§ sections: docs/protocol.md.
"""

from __future__ import annotations

import struct
from collections import Counter
from typing import List, Optional, Tuple

import msgpack
import pytest
from engine_driver import CASES, Observer, Run, examples, violation
from engine_scenarios import WIRE_FOCUS, scenarios
from hypothesis import given, settings

#: The engine's logging off and each test's cases counted (conftest.py).
pytestmark = pytest.mark.usefixtures("_quiet_engine_and_case_count", "_time_each_test")


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
    # KV blocks enforced: never the steady path (lanes.py), so both runs are the same by
    # construction; without them each example can reach it, whatever examples a Hypothesis
    # version derandomizes to (one drew none among 400 with them)
    @given(scenario=scenarios(WIRE_FOCUS[focus], kv_blocks=False))
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
