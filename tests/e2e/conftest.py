"""Fixtures for the end-to-end tests: real vLLM frontends driving gmock_engine.

Packages the tests need (beyond the standard library): pytest, requests
(both in the project's `test` extra).  The frontends themselves are installed by
install_frontends.sh into $GMOCK_FRONTENDS_HOME (default ~/.cache/gmock-frontends)
on first use: about 2 minutes and 3.5 GB of disk, then reused (< 1 s to check).

Select / deselect:  pytest -m e2e tests/e2e   |   pytest -m "not e2e"
One topology:       pytest tests/e2e -k rs-dp4
Environment knobs:  GMOCK_FRONTENDS_HOME, GMOCK_E2E_TIMEOUT_SCALE (multiplies the
start-up deadlines), GMOCK_E2E_ENGINE_ARGS (extra run.sh arguments, shell-quoted),
GMOCK_E2E_TOPOLOGIES (comma-separated ids, e.g. "py-dp1-api1,rs-dp4"),
GMOCK_E2E_VERSIONS (test_versions_e2e.py: which older frontends, e.g. "rs-0.22.0,py-0.28.0";
"none" runs none).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import e2e_harness as h  # noqa: E402

E2E_DIR = Path(__file__).resolve().parent


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "e2e: end-to-end tests against the real vLLM frontends (installs them on first use)"
    )
    h.install_sigterm_as_interrupt()


def pytest_collection_modifyitems(config, items):
    solo = os.environ.get("GMOCK_SOLO") == "1"
    skip_solo = pytest.mark.skip(
        reason="compares timing with a real engine core, which another test's load would distort: "
        "run alone with GMOCK_SOLO=1 GMOCK_TEST_WORKERS=0 ./run.sh test -m solo (.ci/run does, after the suite)"
    )
    docs_slow = os.environ.get("GMOCK_DOCS_SLOW") == "1"
    skip_docs_slow = pytest.mark.skip(
        reason="a documented command with a heavy client (GuideLLM, aiperf) or the Python frontend: "
        "GMOCK_DOCS_SLOW=1 ./run.sh test -m docs_slow tests/e2e/test_docs_commands.py (.ci/run does, after the suite)"
    )
    for item in items:
        if Path(str(item.path)).resolve().parent == E2E_DIR:
            item.add_marker(pytest.mark.e2e)
        if item.get_closest_marker("solo") is not None and not solo:
            item.add_marker(skip_solo)
        if item.get_closest_marker("docs_slow") is not None and not docs_slow:
            item.add_marker(skip_docs_slow)


def _selected_topologies():
    wanted = os.environ.get("GMOCK_E2E_TOPOLOGIES")
    if not wanted:
        return h.TOPOLOGIES
    ids = {w.strip() for w in wanted.split(",") if w.strip()}
    unknown = ids - {t.id for t in h.TOPOLOGIES}
    if unknown:
        raise pytest.UsageError(f"GMOCK_E2E_TOPOLOGIES: unknown {sorted(unknown)}; "
                                f"known: {[t.id for t in h.TOPOLOGIES]}")
    return [t for t in h.TOPOLOGIES if t.id in ids]


# --------------------------------------------------------------------------- session


@pytest.fixture(scope="session")
def frontends() -> h.Frontends:
    """Install (first time) or find the frontends; < 1 s when present."""
    return h.install_frontends()


@pytest.fixture(scope="session")
def model_dir(frontends, tmp_path_factory) -> Path:
    """The weightless model dir both frontends serve as `mock`."""
    return h.make_model_dir(tmp_path_factory.mktemp("model"))


# --------------------------------------------------------------------------- stacks


@pytest.fixture(scope="module", params=_selected_topologies(), ids=lambda t: t.id)
def stack(request, frontends, model_dir, tmp_path_factory):
    """One frontend + gmock_engine pair per topology, shared by all scenarios of a module.

    Teardown always stops both process groups and fails (as a teardown error) when a
    process had to be SIGKILLed or survived.
    """
    topo: h.Topology = request.param
    t0 = time.monotonic()
    # A test module may set ENGINE_ARGS (extra run.sh arguments for its stacks);
    # $GMOCK_E2E_ENGINE_ARGS comes after them, so it wins for a repeated flag.
    engine_args = list(getattr(request.module, "ENGINE_ARGS", []))
    # A topology with a version (test_versions_e2e.py) gets that frontend, installed on first use.
    fe = frontends if topo.version is None else h.install_version(topo.frontend, topo.version)
    install_s = round(time.monotonic() - t0, 1)
    s = h.Stack(topo, fe, model_dir, tmp_path_factory.mktemp(topo.id), engine_args=engine_args)
    if topo.version is not None:
        s.timings["install_s"] = install_s
    s.start()
    try:
        yield s
    finally:
        died_before = {g.name for g in s.engines if not g.alive()}
        problems = s.stop()
        s.timings["total_s"] = round(time.monotonic() - t0, 1)
        # printed at the end of the session by tests/conftest.py
        request.config.gmock_stack_timings[f"{request.module.__name__}::{topo.id}"] = dict(s.timings)
        for g in s.engines:
            rc = g.popen.returncode
            if rc != 0 and g.name not in died_before:
                # gmock_engine is expected to shut down cleanly on SIGTERM.
                problems.append(f"{g.name} exited rc={rc} after SIGTERM (expected 0)")
        if problems:
            pytest.fail(f"{topo.id}: teardown problems: {problems}\n{s.logs_report()}", pytrace=False)


@pytest.fixture(autouse=True)
def _stack_alive(request):
    """Fail a scenario at once when its frontend or engine is gone: the Python frontend
    never notices a dead engine, and its requests would just hang until the timeouts."""
    if "stack" in request.fixturenames:
        s: h.Stack = request.getfixturevalue("stack")
        for g in (s.frontend, *s.engines):
            if g is not None and not g.alive():
                pytest.fail(f"{g.name} is not running ({g.describe_exit()})\n{s.logs_report(60)}",
                            pytrace=False)
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """On a failed e2e test, attach the tails of the frontend and engine logs."""
    outcome = yield
    report = outcome.get_result()
    if report.failed and report.when in ("call", "setup"):
        s = getattr(item, "funcargs", {}).get("stack")
        if isinstance(s, h.Stack):
            report.sections.append((f"e2e logs {s.topology.id}", s.logs_report(60)))
