"""`./run.sh calibrate --quick` between the real Python frontend and the mock
engine (docs/latency-profile.md, "Make it behave like my GPU"): it starts
the record tap, waits for the engine to join through it, sends its sweep
through the frontend, writes the trace, and fits a profile to it."""

from __future__ import annotations

import os
import subprocess

import e2e_harness as h
from gmock_engine.timing.profile import read_profile
from gmock_engine.timing.trace import read_trace
from gmock_engine.tools.calibrate_plan import sweep

BUDGET = 256
MAX_MODEL_LEN = 1024


class CalibrateStack(h.Stack):
    """The frontend; `./run.sh calibrate` in the tap's place; the mock joining it."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        (self.tap_port,) = h.free_ports(1)
        self.trace_path = self.log_dir / "trace.jsonl"
        self.profile_path = self.log_dir / "profile.ini"
        self.calibrate = None

    def engine_argv(self, process_args=None):
        argv = super().engine_argv(process_args)
        return [a.replace(f":{self.hs_port}", f":{self.tap_port}") if a.startswith("tcp://") else a for a in argv]

    def start_engine(self):
        argv = [h.RUN_SH, "calibrate", "--quick", "--base-url", self.base_url, "--max-concurrency", "4",
                "--max-num-batched-tokens", str(BUDGET), "--max-model-len", str(MAX_MODEL_LEN),
                "--handshake-address", f"tcp://127.0.0.1:{self.hs_port}",
                "--engine-handshake-address", f"tcp://127.0.0.1:{self.tap_port}",
                "-o", self.trace_path, "--profile-output", self.profile_path]  # fmt: skip
        env = {k: v for k, v in os.environ.items() if not k.startswith("GMOCK_E2E_") and k != "GMOCK_FRONTENDS_HOME"}
        self.calibrate = h.ProcessGroup("calibrate", [str(a) for a in argv], self.log_dir / "calibrate.log",
                                        env={**env, "PYTHONUNBUFFERED": "1"}, cwd=h.REPO)  # fmt: skip
        super().start_engine()
        self.engines.append(self.calibrate)


def test_calibrate_quick_records_the_sweep_and_fits_a_profile(frontends, model_dir, tmp_path):
    s = CalibrateStack(h.Topology("python", dp=1), frontends, model_dir, tmp_path,
                       engine_args=["--itl-ms", "2", "--prefill-ms-per-token", "0.01",
                                    "--max-num-batched-tokens", str(BUDGET), "--max-model-len", str(MAX_MODEL_LEN)])  # fmt: skip
    s.start()
    try:
        s.calibrate.popen.wait(timeout=240)
    except subprocess.TimeoutExpired:
        pass
    finally:
        problems = s.stop()
    log = (tmp_path / "calibrate.log").read_text()
    assert s.calibrate.popen.returncode == 0, log + s.logs_report()
    assert not [p for p in problems if "calibrate" not in p], problems
    planned = sorted(r.prompt for p in sweep(4, BUDGET, MAX_MODEL_LEN, quick=True) for r in p.requests)
    _, records = read_trace(str(s.trace_path))
    adds = sorted(r["prompt_len"] for r in records if r["kind"] == "add")
    assert adds == planned, (adds, planned)  # every request of the sweep went through the tap, lengths exact
    assert max(adds) > BUDGET  # chunked prefill
    assert "coverage: " in log and "chosen: " in log, log
    profile = read_profile(str(s.profile_path))
    assert profile.step_ms[0] > 0
