"""Hypothesis profiles for the property tests, and the case count at the end.

Profiles (GMOCK_HYPOTHESIS_PROFILE, default `gmock-ci`):

* `gmock-ci`: derandomized (the same examples on every run of one Hypothesis
  version), no example database, no deadline. What `./run.sh test` and CI run.
* `gmock-dev`: random examples with the local example database
  (.hypothesis/), which replays earlier failures first; for exploring.

GMOCK_HYPOTHESIS_EXAMPLES=N runs N examples per property test instead of its
default (the defaults add up to 100 000+ generated operations in about two
minutes on two cores), e.g. `GMOCK_HYPOTHESIS_EXAMPLES=20000 ./run.sh test
tests/property` for a long local run.
"""

import os
import time

import pytest
from engine_driver import CASES
from hypothesis import HealthCheck, settings
from loguru import logger

_COMMON = dict(
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
)
settings.register_profile("gmock-ci", derandomize=True, database=None, **_COMMON)
settings.register_profile("gmock-dev", **_COMMON)
settings.load_profile(os.environ.get("GMOCK_HYPOTHESIS_PROFILE", "gmock-ci"))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Print how many cases the property tests generated (see CaseCounter)."""
    counter = getattr(config, "gmock_property_cases", None)
    if counter is None or not counter.per_test:
        return
    terminalreporter.section("gmock_engine property tests")
    for name, (examples, cases, seconds) in counter.per_test.items():
        terminalreporter.write_line(f"{name}: {examples} examples, {cases} cases, {seconds:.1f} s")
    examples, cases, seconds = counter.totals()
    terminalreporter.write_line(
        f"TOTAL: {cases} generated cases (inputs and operations) in {examples} examples, {seconds:.1f} s "
        f"(profile {os.environ.get('GMOCK_HYPOTHESIS_PROFILE', 'gmock-ci')})"
    )


@pytest.fixture(scope="module")
def _quiet_engine_and_case_count(request):
    """The engine logs a warning for every bad input: off here (millions of
    lines). The case counter is handed to conftest for the final summary."""
    request.config.gmock_property_cases = CASES
    logger.disable("gmock_engine")
    yield
    logger.enable("gmock_engine")


@pytest.fixture
def _time_each_test(request):
    """Which test the case counter counts for, and its time."""
    CASES.current = request.node.name
    start = time.perf_counter()
    yield
    CASES.timed(request.node.name, time.perf_counter() - start)
