"""benchmarks/pipeline.py's verdict: per held-out workload, both mocks against
the reference's mean at the client, at the engine boundary and in the
frontend's own /metrics histograms, each outside the pipeline's goals in
bold, and how many figures each mock met (synthetic result files; the
engine-boundary figures stubbed)."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # a script of the checkout

import engine_boundary  # noqa: E402
import pipeline  # noqa: E402


def _workload(scale, metrics=True):
    out = {"request_throughput": 2.0}
    for p, base in (("p50", 30.0), ("p90", 40.0), ("p99", 50.0)):
        out[f"{p}_ttft_ms"] = base * scale
        out[f"{p}_itl_ms"] = base / 2 * scale
        if metrics:
            out[f"metrics_ttft_{p}_ms"] = base * 1.1 * scale
            out[f"metrics_itl_{p}_ms"] = base / 2 * 1.1 * scale
    return out


def test_the_verdict_holds_the_frontend_s_histograms(tmp_path, monkeypatch):
    docs = {"reference": [1.0, 1.0], "mock-profile": [1.02], "mock-linear": [1.2]}
    for name, scales in docs.items():
        runs = [{"workloads": {"w": _workload(s)}} for s in scales]
        (tmp_path / f"{name}.json").write_text(json.dumps({"runs": runs}))
    engine = {"w": {"ttft": [10.0, 20.0, 30.0], "itl": [5.0, 5.0, 6.0], "throughput": 2.0}}
    monkeypatch.setattr(engine_boundary, "run_figures", lambda path: [engine])
    text = pipeline.verdict(tmp_path)
    frontend = [line for line in text.splitlines() if "| frontend |" in line]
    assert [line.split(" | ")[2] for line in frontend] == [
        f"/metrics {m} {p}" for m in ("TTFT", "ITL") for p in ("p50", "p90", "p99")]
    # the reference's /metrics TTFT p50 is 33 ms; the profile's 2 % above (within 3 %), the linear flags' 20 % (bold)
    assert "| w | frontend | /metrics TTFT p50 | 33 (0.0 %) | 33.7 (+2.0 %) | 39.6 (**+20.0 %**) |" in text
    # 7 client + 7 engine + 6 frontend figures; the profile meets all, the linear flags only the
    # engine's (stubbed the same) and the client's req/s (the same in every file)
    assert text.rstrip().endswith("the fitted profile 20 of 20, the hand-set linear flags 8 of 20.")


def test_a_run_without_the_frontend_s_histograms_leaves_them_out(tmp_path, monkeypatch):
    for name, scale in (("reference", 1.0), ("mock-profile", 1.0), ("mock-linear", 1.0)):
        metrics = name != "mock-linear"
        (tmp_path / f"{name}.json").write_text(json.dumps({"runs": [{"workloads": {"w": _workload(scale, metrics)}}]}))
    engine = {"w": {"ttft": [10.0], "itl": [5.0], "throughput": 2.0}}
    monkeypatch.setattr(engine_boundary, "run_figures", lambda path: [engine])
    text = pipeline.verdict(tmp_path)
    assert "| frontend |" not in text and text.rstrip().endswith("of 14, the hand-set linear flags 14 of 14.")


def test_time_scale_lengthens_the_reference_s_steps_and_the_linear_flags_alike():
    """`--time-scale K`: the reference's step expression gives K times its
    step for every batch, and the hand-set linear flags read off it are K
    times as long, so that the mock with them still stands for the same
    reference."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "emulated_gpu"))
    from gmock_emulated_gpu.pacing import Batch, expression_step

    base, slow = expression_step(pipeline.STEP_MS), expression_step(pipeline.scaled_step(pipeline.STEP_MS, 3.0))
    batches = [Batch(decodes=d, prefill_tokens=t, prefill_reqs=r, context=c)
               for d in (0, 1, 8, 9, 16) for t, r in ((0, 0), (64, 1), (1024, 2)) for c in (0, 5000) if d + r]
    for b in batches:
        assert abs(slow(b) - 3.0 * base(b)) < 1e-9, b
    assert pipeline.scaled_step(pipeline.STEP_MS, 1.0) == pipeline.STEP_MS
    flags = dict(f.split("=") for f in pipeline.linear_flags(3.0))
    assert {k: float(v) for k, v in flags.items()} == {k: 3.0 * v for k, v in pipeline.LINEAR.items()}
    assert pipeline.linear_flags() == ["--itl-ms=14", "--itl-ms-per-request=0.5", "--prefill-ms-per-token=0.02"]
