"""benchmarks/fidelity.py's `sitting`: the order of its runs (the real
engine's calibration and held-out sets alternating), what each is given,
and the files it leaves. The runs themselves are replaced by a recorder
here; tests/e2e/test_fidelity_e2e.py runs the real thing."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # a script of the checkout

import fidelity  # noqa: E402
from gmock_engine.tools import fit  # noqa: E402


def test_a_sitting_alternates_real_runs_fits_their_calibration_then_runs_the_mock(tmp_path, monkeypatch):
    calls = []

    def fake_run(options):
        calls.append(options)
        runs = [{"workloads": {"w": {"p50_ttft_ms": 10.0 + len(calls)}}} for _ in range(options.repeat)]
        Path(options.out).write_text(json.dumps({"target": options.target, "engine_args": options.engine_arg, "runs": runs}))
        return 0

    fitted = []

    def fake_fit(argv):
        fitted.append(argv)
        Path(argv[argv.index("-o") + 1]).write_text("[latency-profile]\nbatch = 1\nstep_ms = 1\n")
        return 0

    monkeypatch.setattr(fidelity, "run", fake_run)
    monkeypatch.setattr(fit, "main", fake_fit)
    assert fidelity.main(["sitting", "--dir", str(tmp_path), "--repeat", "2", "--reference", "real"]) == 0
    order = [(c.target, c.set, Path(c.out).name) for c in calls]
    assert order == [
        ("real", "cal", "real-cal1.json"), ("real", "held", "real-held1.json"),
        ("real", "cal", "real-cal2.json"), ("real", "held", "real-held2.json"),
        ("mock", "held", "mock-profile.json"), ("mock", "held", "mock-linear.json"),
    ]  # fmt: skip
    assert [Path(c.trace).name if c.trace else None for c in calls] == [
        "cal1.jsonl", "held1.jsonl", "cal2.jsonl", "held2.jsonl", "mock{run}.jsonl", None]  # fmt: skip
    [argv] = fitted
    assert argv[:2] == [str(tmp_path / "cal1.jsonl"), str(tmp_path / "cal2.jsonl")]  # the calibration traces only
    assert calls[4].engine_arg == [f"--latency-profile={tmp_path / 'profile.ini'}"] and calls[4].repeat == 2
    assert calls[5].engine_arg == fidelity.LINEAR_FLAGS
    merged = json.loads((tmp_path / "real-held.json").read_text())
    assert [r["workloads"]["w"]["p50_ttft_ms"] for r in merged["runs"]] == [12.0, 14.0]  # both held-out runs
    assert "| w | TTFT p50 |" in (tmp_path / "compare-profile.md").read_text()


def test_a_failed_fit_stops_the_sitting_before_the_mock(tmp_path, monkeypatch):
    calls = []

    def fake_run(options):
        calls.append(options.target)
        Path(options.out).write_text(json.dumps({"target": options.target, "engine_args": [], "runs": [{"workloads": {}}]}))
        return 0

    monkeypatch.setattr(fidelity, "run", fake_run)
    monkeypatch.setattr(fit, "main", lambda argv: 2)
    assert fidelity.main(["sitting", "--dir", str(tmp_path), "--repeat", "1"]) == 2
    assert calls == ["emulated", "emulated"]  # the default reference


def test_the_twin_table_judges_the_real_calibration_runs_of_a_held_out_shape_as_the_mock(capsys):
    """The held-out c16 workload has a calibration twin of the same shape:
    its calibration runs go in the mock's column, against the held-out runs."""
    held = [{"c16_128_256_held": {"p50_itl_ms": 15.0, "request_throughput": 4.0}, "c2_768_128": {"p50_itl_ms": 6.0}},
            {"c16_128_256_held": {"p50_itl_ms": 15.6, "request_throughput": 3.8}}]  # fmt: skip
    drifted = [{"c16_128_256": {"p50_itl_ms": 17.6, "request_throughput": 3.9}, "c1_64_64": {"p50_itl_ms": 5.0}}]
    assert fidelity.twin_table(held, drifted) == 1  # ITL 15 % above; the rate inside the held-out runs' range
    out = capsys.readouterr().out
    assert "c16_128_256 for c16_128_256_held" in out
    assert "| c16_128_256_held | ITL p50 | 15 | 15.6 | 3.9 % | 17.6 | +15.0 % | **no** |" in out
    assert "c2_768_128" not in out  # no twin: not in the table
    steady = [{"c16_128_256": {"p50_itl_ms": 15.2, "request_throughput": 3.9}}]
    assert fidelity.twin_table(held, steady) == 0
    assert fidelity.twin_table(held, [{"c1_64_64": {"p50_itl_ms": 5.0}}]) == 0  # calibration without the twin
