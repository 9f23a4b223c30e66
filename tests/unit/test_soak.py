"""benchmarks/soak.py: the verdict, without running a soak (pure functions)."""

import importlib.util
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _load_soak():
    spec = importlib.util.spec_from_file_location("soak", os.path.join(REPO, "benchmarks", "soak.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


soak = _load_soak()

SAMPLES = [{"t": 10.0, "rss_mb": 50.0}, {"t": 60.0, "rss_mb": 60.0}, {"t": 120.0, "rss_mb": 60.2}]


def books(aborted, **faults):
    """engine_books() as a soak reads it once the engine is idle."""
    out = {"gmock_requests_started": 1000.0, "gmock_ledger_violations": 0.0, "gmock_requests_finished_abort": float(aborted)}
    out.update({f"gmock_faults_injected_{kind}": float(n) for kind, n in faults.items()})
    return out


def judge(outcomes, engine_books, samples=SAMPLES):
    return soak.judge(outcomes, engine_books, samples, warmup=60.0, rss_growth_limit=1.0)


def test_a_clean_soak_passes():
    verdict = judge({"ok": 900, "aborted_by_client": 100, "failed": 0}, books(100))
    assert verdict["verdict"] == "PASS" and verdict["problems"] == []
    assert verdict["rss_growth_pct"] == pytest.approx(0.33, abs=0.01) and verdict["ledger_aborted"] == 100


@pytest.mark.parametrize("aborted", [99, 101, 1, 0])
def test_without_faults_aborts_must_equal_disconnects(aborted):
    # docs/operations.md: "client disconnects = engine aborts" when no fault is injected;
    # "more than 0" let a lost ABORT (or an invented one) pass.
    verdict = judge({"ok": 900, "aborted_by_client": 100, "failed": 0}, books(aborted))
    assert verdict["verdict"] == "FAIL"
    assert verdict["problems"] == [f"{aborted} engine aborts != 100 client disconnects"]


def test_no_disconnects_means_no_aborts():
    assert judge({"ok": 1000, "aborted_by_client": 0, "failed": 0}, books(0))["verdict"] == "PASS"
    verdict = judge({"ok": 1000, "aborted_by_client": 0, "failed": 0}, books(3))
    assert verdict["problems"] == ["3 engine aborts != 0 client disconnects"]


@pytest.mark.parametrize("kind", ["duplicate_finish", "slow_steps", "fail_utility"])
def test_faults_that_cannot_move_the_count_keep_equality(kind):
    outcomes = {"ok": 900, "aborted_by_client": 100, "failed": 0}
    assert judge(outcomes, books(100, **{kind: 10}))["verdict"] == "PASS"
    assert judge(outcomes, books(99, **{kind: 10}))["verdict"] == "FAIL"


@pytest.mark.parametrize("kind", ["error_mid_stream", "late_finish", "drop_finish"])
def test_request_faults_move_the_count_by_at_most_their_firings(kind):
    failed = 3 if kind in soak.FAILING_FAULTS else 0
    outcomes = {"ok": 897 if failed else 900, "aborted_by_client": 100, "failed": failed}
    for aborted in (97, 100, 103):
        assert judge(outcomes, books(aborted, **{kind: 3}))["verdict"] == "PASS", aborted
    for aborted in (96, 104, 0):
        verdict = judge(outcomes, books(aborted, **{kind: 3}))
        assert verdict["problems"] == [f"{aborted} engine aborts != 100 client disconnects (± 3 for the request faults injected)"]


def test_request_fault_firings_add_up():
    outcomes = {"ok": 895, "aborted_by_client": 100, "failed": 5}
    faults = {"error_mid_stream": 2, "drop_finish": 3, "late_finish": 1, "duplicate_finish": 50}
    assert judge(outcomes, books(94, **faults))["verdict"] == "PASS"
    assert judge(outcomes, books(93, **faults))["verdict"] == "FAIL"


@pytest.mark.parametrize("kind", ["stall_outputs", "hang"])
def test_engine_faults_keep_only_bounds(kind):
    outcomes = {"ok": 890, "aborted_by_client": 100, "failed": 0}
    # outputs held back while the engine steps on: many closes come too late
    assert judge(outcomes, books(40, **{kind: 1}))["verdict"] == "PASS"
    assert judge(outcomes, books(100, **{kind: 1}))["verdict"] == "PASS"
    assert judge(outcomes, books(0, **{kind: 1}))["problems"] == ["100 client disconnects but no engine aborts"]
    # an abort needs a client that closed its stream
    assert judge(outcomes, books(101, **{kind: 1}))["problems"] == ["101 engine aborts > 100 client disconnects + 0 failed requests"]


def test_the_other_checks_still_hold():
    outcomes = {"ok": 900, "aborted_by_client": 100, "failed": 0}
    violations = dict(books(100), gmock_ledger_violations=2.0)
    assert judge(outcomes, violations)["problems"] == ["2 ledger violations"]
    failed = {"ok": 899, "aborted_by_client": 100, "failed": 1}
    assert judge(failed, books(100))["problems"] == ["1 failed requests > 0 injected faults that fail one"]
    assert judge(failed, books(100, error_mid_stream=1))["verdict"] == "PASS"
    grown = [{"t": 60.0, "rss_mb": 60.0}, {"t": 120.0, "rss_mb": 61.0}]
    assert judge(outcomes, books(100), grown)["problems"] == ["RSS grew 1.67 % after warm-up > 1 %"]
    nothing = judge({"ok": 0, "aborted_by_client": 0, "failed": 0}, books(0))
    assert nothing["problems"] == ["no request completed"]


def test_abort_check_directly():
    assert soak.abort_check(7140, 7140, 0, {}) is None
    assert soak.abort_check(7140, 7139, 0, {}) == "7139 engine aborts != 7140 client disconnects"


def test_report_without_matplotlib_stops_at_start(monkeypatch, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    monkeypatch.setattr(sys, "argv", ["soak.py", "--duration", "10s", "--report", "never.html"])
    monkeypatch.setattr(soak.h, "install_frontends", lambda *a, **k: pytest.fail("nothing may start without matplotlib"))
    with pytest.raises(SystemExit) as stopped:
        soak.main()
    assert stopped.value.code == 2
    assert "--report needs matplotlib" in capsys.readouterr().err
