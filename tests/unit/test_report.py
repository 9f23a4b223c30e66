"""gmock_engine/tools/report.py: the HTML reports of `bench --report` and
`soak --report`, built from canned data (no load runs here)."""

import base64
import re
import sys

import pytest

from gmock_engine.tools import bench, report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
IMG = re.compile(r'<img alt="([^"]*)" src="data:image/png;base64,([A-Za-z0-9+/=]+)">')

RESULTS = [
    {"target": "gmock", "tokens_per_s": 712345.0, "requests_per_s": 2800.0, "cpu_us_per_token": 1.25, "engine_cpu_pct": 89.0,
     "ttft_p50_ms": 12.0, "ttft_p99_ms": 64.0, "lateness_p50_us": 110.0, "lateness_p99_us": 410.0, "idle_cpu_pct": 0.0,
     "driver_cpu_us_per_token": 0.45, "rss_mb": 40.9, "join_s": 0.27, "ratio_vs_reference": 1.51,
     "tokens_per_s_series": [[1.0, 700000.0], [2.0, 724690.0]]},
    {"target": "reference", "tokens_per_s": 665084.0, "requests_per_s": 2612.0, "cpu_us_per_token": 0.83, "engine_cpu_pct": 55.0,
     "ttft_p50_ms": 3.8, "ttft_p99_ms": 14.4, "idle_cpu_pct": 0.0, "driver_cpu_us_per_token": 0.37, "rss_mb": 22.2, "join_s": 0.08,
     "tokens_per_s_series": [[1.0, 668000.0], [2.0, 662168.0]]},
]  # fmt: skip

KINDS = ("error_mid_stream", "stall_outputs")
SAMPLES = [
    {"t": 10.0 * i, "rss_mb": 40.0 + 0.01 * i, "fds": 31, "started": 200.0 * i, "running": 12.0, "violations": 0.0,
     "ok": 178 * i, "aborted_by_client": 20 * i, "failed": i // 3, "error_mid_stream": float(2 * i), "stall_outputs": float(i // 4),
     "output_tokens": 13000.0 * i, "finished_length": 176.0 * i, "finished_abort": 20.0 * i, "finished_error": 2.0 * i,
     "late_p50_us": 95.0, "late_p99_us": 380.0 + i, "ttft_p50_ms": 6.5, "ttft_p99_ms": 30.0 + i, "itl_p50_ms": 5.1, "itl_p99_ms": 6.0}
    for i in range(1, 13)
]  # fmt: skip
VERDICT = {"verdict": "FAIL", "problems": ["4 failed requests > 3 injected faults that fail one"],
           "requests": {"ok": 2136, "aborted_by_client": 240, "failed": 4}, "ledger_started": 2400.0, "ledger_violations": 0.0,
           "ledger_aborted": 240.0, "rss_warm_mb": 40.03, "rss_end_mb": 40.12, "rss_growth_pct": 0.22,
           "faults_injected": {"error_mid_stream": 24.0, "stall_outputs": 3.0}, "failures": ["stream ended badly: <done=False>"]}  # fmt: skip


def _images(text):
    images = IMG.findall(text)
    for _, data in images:
        assert base64.b64decode(data).startswith(PNG_MAGIC)
    return [alt for alt, _ in images]


def test_bench_report_has_every_chart_and_the_figures(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "bench.html"
    report.bench_report(str(path), RESULTS, {"duration": 2.0, "concurrency": 256, "report": str(path), "json": None})
    text = path.read_text()
    assert text.startswith("<!DOCTYPE html>") and text.rstrip().endswith("</html>")
    assert _images(text) == ["Output tokens per second", "Engine CPU per output token", "Time to first token",
                             "gmock / reference", "Step lateness", "Tokens per second over the window"]  # fmt: skip
    assert "gmock / reference CPU per token: 1.51" in text
    assert "712,345" in text and "665,084" in text and "<td>concurrency</td><td>256</td>" in text
    assert "http://" not in text and "https://" not in text  # self-contained: nothing to fetch


def test_bench_report_of_one_target_has_no_ratio(tmp_path):
    pytest.importorskip("matplotlib")
    text = report.bench_html(RESULTS[1:], {})
    assert "gmock / reference" not in text and "Step lateness" not in text
    assert _images(text) == ["Output tokens per second", "Engine CPU per output token", "Time to first token", "Tokens per second over the window"]


def test_soak_report_has_the_verdict_on_top_and_every_chart(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "soak.html"
    report.soak_report(str(path), SAMPLES, VERDICT, {"duration": 120.0, "frontend": "python", "engine_arg": []}, warmup=24.0)
    text = path.read_text()
    assert text.index('<span class="verdict FAIL">FAIL</span>') < text.index("<img")
    assert "4 failed requests &gt; 3 injected faults that fail one" in text
    assert "stream ended badly: &lt;done=False&gt;" in text  # escaped
    assert "<td>fault error-mid-stream</td><td>24</td>" in text and "<td>RSS growth %</td><td>0.22</td>" in text
    assert _images(text) == ["Throughput", "Latency seen by the clients", "Engine step lateness", "Memory and file descriptors",
                             "Requests by finish reason", "Injected faults"]  # fmt: skip
    assert "engine_arg" not in text  # empty settings are left out


def test_soak_report_with_only_the_original_sample_keys():
    # samples as soak.py wrote them before --report: no latencies, no faults
    pytest.importorskip("matplotlib")
    samples = [{"t": 10.0 * i, "rss_mb": 40.0, "fds": 30, "ok": 10 * i, "aborted_by_client": i, "failed": 0} for i in range(1, 4)]
    text = report.soak_html(samples, {"verdict": "PASS", "problems": [], "faults_injected": {}}, {})
    assert '<span class="verdict PASS">PASS</span>' in text
    assert _images(text) == ["Throughput", "Memory and file descriptors", "Requests by finish reason"]


def test_fault_intervals_come_from_the_counters():
    faults = report._fault_times(SAMPLES[:5], KINDS)
    assert faults[0] == (0.0, 10.0, {"error_mid_stream": 2.0})
    assert (30.0, 40.0, {"error_mid_stream": 2.0, "stall_outputs": 1.0}) in faults


def test_bench_tokens_series_is_per_second_rates():
    assert bench.tokens_series([(1.0, 1000), (2.0, 2500), (2.5, 3000)]) == [[1.0, 1000.0], [2.0, 1500.0], [2.5, 1000.0]]
    assert bench.tokens_series([(1.0, 10), (1.0, 10)]) == [[1.0, 10.0]]


def test_without_matplotlib_report_stops_bench_at_start(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    monkeypatch.setattr(bench, "run_target", lambda *a: pytest.fail("no load may run without matplotlib"))
    assert bench.main(["--report", "never.html"]) == 2
    err = capsys.readouterr().err
    assert "--report needs matplotlib" in err and "pip install 'gmock-engine[report]'" in err
