"""benchmarks/closed_loop.py: the engine's side of TTFT on a virtual clock, beside a real trace."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # a script of the checkout

import closed_loop  # noqa: E402


def _trace(path):
    """A real engine's trace: 4 requests of 64 tokens one after another, each
    sent 5 ms after the previous one finished, first token 12 ms after its ADD."""
    records = [{"format": "gmock-trace", "version": 1}]
    t = 10.0
    for i in range(4):
        rid = f"q{i}"
        records.append({"kind": "add", "t": t, "rank": 0, "request_id": rid, "prompt_len": 64, "max_tokens": 2})
        records.append({"kind": "output", "t": t + 0.012, "rank": 0, "engine_timestamp": t, "requests": [{"id": rid, "tokens": 1, "finish_reason": None}]})
        records.append({"kind": "output", "t": t + 0.020, "rank": 0, "engine_timestamp": t, "requests": [{"id": rid, "tokens": 1, "finish_reason": 1}]})
        t += 0.025
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_the_real_figures_and_the_mock_engine_under_a_profile(tmp_path, capsys):
    trace, profile = tmp_path / "real.jsonl", tmp_path / "p.ini"
    _trace(trace)
    ttft, gaps = closed_loop.real_figures(str(trace), 64)
    assert [round(x, 6) for x in ttft] == [12.0] * 4 and [round(g, 6) for g in gaps] == [0.005] * 3
    # every step 10 ms, a 64-token prefill 6.4 ms more: one client's first token 16.4 ms after its ADD
    profile.write_text("[latency-profile]\nbatch = 1\nstep_ms = 10\nprefill_ms_per_token = 0.1\n")
    argv = ["--profile", str(profile), "--real", str(trace), "--prompt-len", "64", "--max-tokens", "4",
            "--clients", "1", "--requests", "6", "--seeds", "2"]  # fmt: skip
    assert closed_loop.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    real = next(line for line in lines if line.startswith("real engine")).split()
    mock = next(line for line in lines if line.startswith("mock engine")).split()
    assert real[-3:] == ["12.0", "12.0", "12.0"]
    assert mock[3:6] == ["16.4", "16.4", "16.4"], lines
    assert closed_loop.main(argv[:2] + ["--real", str(trace), "--prompt-len", "99", "--max-tokens", "4", "--clients", "1", "--requests", "2"]) == 2


def test_the_mock_engine_starts_with_the_step_sizes_the_real_one_had_run(tmp_path, capsys):
    trace, profile = tmp_path / "real.jsonl", tmp_path / "p.ini"
    _trace(trace)
    # before the workload, the real engine ran a 200-token prompt: a step larger than the workload's
    earlier = [{"kind": "add", "t": 5.0, "rank": 0, "request_id": "w0", "prompt_len": 200, "max_tokens": 2},
               {"kind": "output", "t": 5.02, "rank": 0, "engine_timestamp": 5.02, "requests": [{"id": "w0", "tokens": 1, "finish_reason": None}]},
               {"kind": "output", "t": 5.03, "rank": 0, "engine_timestamp": 5.03, "requests": [{"id": "w0", "tokens": 1, "finish_reason": 1}]}]  # fmt: skip
    lines = trace.read_text().splitlines(keepends=True)
    trace.write_text(lines[0] + "".join(json.dumps(r) + "\n" for r in earlier) + "".join(lines[1:]))
    assert max(closed_loop.sizes_before(str(trace), 64)) == 200
    # a new size costs 3 times its prediction, a new largest one 5 times: the
    # workload's first prefill (64 tokens) is new, but not the largest
    profile.write_text("[latency-profile]\nbatch = 1\nstep_ms = 10\nprefill_ms_per_token = 0.1\n"
                       "spread_new_size = 3 3\nspread_new_max = 5 5\n")  # fmt: skip
    argv = ["--profile", str(profile), "--real", str(trace), "--prompt-len", "64", "--max-tokens", "4",
            "--clients", "1", "--requests", "6", "--seeds", "1"]  # fmt: skip
    assert closed_loop.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    mock = next(line for line in lines if line.startswith("mock engine")).split()
    assert mock[3:6] == ["16.4", "49.2", "49.2"], lines  # the first of six at 3 x 16.4 (new largest: 5 x)
