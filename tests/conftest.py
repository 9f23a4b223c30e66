"""Shared test setup: tests/ on sys.path for the fake frontend helpers, and
the e2e stacks' start-up timings printed at the end of the session.

The timings are kept here, not in tests/e2e/conftest.py: `./run.sh test`
runs pytest-xdist workers, and only this conftest is loaded by the
controller that prints the summary.
"""

import os
import sys

import pytest

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
if TESTS_DIR not in sys.path:
    sys.path.insert(0, TESTS_DIR)


def pytest_configure(config):
    #: "module::topology id" -> that stack's timings (tests/e2e/conftest.py fills it)
    config.gmock_stack_timings = {}


def pytest_sessionfinish(session):
    """A pytest-xdist worker hands its stacks' timings to the controller."""
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["stack_timings"] = dict(session.config.gmock_stack_timings)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    node.config.gmock_stack_timings.update(getattr(node, "workeroutput", {}).get("stack_timings", {}))


def pytest_terminal_summary(terminalreporter, config):
    timings = config.gmock_stack_timings
    if timings:
        terminalreporter.section("e2e stack timings")
        for key in sorted(timings):
            terminalreporter.write_line(f"{key}: {timings[key]}")
