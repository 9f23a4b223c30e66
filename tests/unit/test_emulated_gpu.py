"""The emulated GPU's pure parts (benchmarks/emulated_gpu/gmock_emulated_gpu:
pacing.py, config/loader.py) and its model dir (tools/model_dir.py): the batch read
from vLLM's attention lengths, the step functions, the cadence on a virtual
clock, the settings. The model itself runs inside a real vLLM engine core
(benchmarks/fidelity.py --target emulated, tests/e2e/test_fidelity_e2e.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from gmock_engine.timing.profile import parse_profile
from gmock_engine.tools import model_dir

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "emulated_gpu"))
from gmock_emulated_gpu import ARCHITECTURE, config, pacing  # noqa: E402

PROFILE = parse_profile(
    "[latency-profile]\nbatch = 1 4 16\nstep_ms = 10 11 15\nprefill_ms_per_token = 0.03\n"
    "prefill_attention_ms = 0.002\nprefill_ms_per_request = 0.8\ncontext_ms_per_ktoken = 0.35\n"
)


def test_the_batch_is_read_from_query_and_sequence_lengths_as_the_mock_counts_it():
    # two decodes (sequences of 70 and 300), a whole prompt of 64, the second chunk (512 from 512)
    # of a long prompt, and a padded slot with no query
    b = pacing.batch_from_lengths([1, 1, 64, 512, 0], [70, 300, 64, 1024, 0])
    assert (b.decodes, b.prefill_reqs, b.prefill_tokens, b.batch) == (2, 2, 576, 4)
    assert b.prefill_attention == 64 * (0 + 32) + 512 * (512 + 256)
    assert b.context == 70 + 300 + 64 + 1024
    assert (b.chunk_starts, b.chunk_ends) == ((0, 512), (64, 1024))
    # a one-token prompt computes a prompt, not a decode
    assert pacing.batch_from_lengths([1], [1]) == pacing.Batch(prefill_reqs=1, prefill_tokens=1, prefill_attention=0.5, context=1)


def test_a_profile_step_is_the_mocks_prediction_and_draws_its_spread_only_when_asked():
    b = pacing.Batch(decodes=3, prefill_reqs=1, prefill_tokens=256, prefill_attention=256 * 128, context=2000)
    expected = PROFILE.predict_ms(4, 256, 256 * 128, 2000, 1)
    assert pacing.profile_step(PROFILE)(b) == pytest.approx(expected)
    spread = parse_profile("[latency-profile]\nbatch = 1\nstep_ms = 10\nspread_decode = 2 2\n")
    assert pacing.profile_step(spread)(pacing.Batch(decodes=1)) == 10.0
    assert pacing.profile_step(spread, spread=True)(pacing.Batch(decodes=1)) == 20.0


def test_a_step_expression_is_a_function_of_the_batch_and_a_bad_one_is_refused():
    step = pacing.expression_step("6 + 0.5*decodes + 1e-5*prefill_tokens**2 + 0.35*context/1000 + max(0, batch-8)")
    b = pacing.Batch(decodes=10, prefill_reqs=1, prefill_tokens=1000, context=4000)
    assert step(b) == pytest.approx(6 + 5 + 10 + 1.4 + 3)
    for bad, says in (("6 +", "not a Python expression"), ("__import__('os')", "unknown name"),
                      ("decodes.__class__", "unknown name"), ("1 / decodes", "fails"), ("-1", "ms >= 0")):  # fmt: skip
        with pytest.raises(pacing.StepFunctionError, match=says):
            pacing.expression_step(bad)


class Clock:
    """A virtual clock: sleeping advances it."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds >= 0
        self.now += seconds


def test_the_cadence_times_a_step_from_the_last_forward_end_when_that_was_less_than_a_step_ago():
    clock = Clock()
    pacer = pacing.Pacer(lambda b: 10.0, clock, clock.sleep)  # 10 ms steps
    one = pacing.Batch(decodes=1, context=10)
    ends = []
    for host_ms in (0.0, 3.0, 3.0, 25.0, 4.0):  # the host's work before each forward, then 1 ms of compute
        clock.now += host_ms / 1000
        started = clock.now
        clock.now += 0.001
        pacer.pace(one, started)
        ends.append(round((clock.now - 100.0) * 1000, 6))
    # back to back: every 10 ms, the host's 3-4 ms inside the step; after 25 ms idle: from the forward's start
    assert ends == [10.0, 20.0, 30.0, 65.0, 75.0]
    assert pacer.steps == 5 and pacer.overruns == 0


def test_a_step_that_goes_on_with_nothing_after_a_short_idle_spell_starts_with_its_forward():
    clock = Clock()
    pacer = pacing.Pacer(lambda b: 10.0, clock, clock.sleep)  # 10 ms steps
    ends = []
    # a decode; 4 ms later (its request ended, the next one came) a fresh prompt, its first 512 tokens;
    # 2 ms later the prompt's second chunk; 3 ms later its first decode; it ends, and 4 ms later a
    # prompt behind 256 tokens of prefix-cache hits
    for host_ms, lengths in ((0.0, ([1], [70])), (4.0, ([512], [512])), (2.0, ([512], [1024])),
                             (3.0, ([1], [1025])), (4.0, ([64], [320]))):  # fmt: skip
        clock.now += host_ms / 1000
        started = clock.now
        clock.now += 0.001
        pacer.pace(pacing.batch_from_lengths(*lengths), started)
        ends.append(round((clock.now - 100.0) * 1000, 6))
    # the fresh prompt's step and the cached one's: 10 ms from their forwards (14 -> 24, 48 -> 58),
    # not from the last forward's end (-> 20, -> 54); the second chunk and the decode: back to back
    assert ends == [10.0, 24.0, 34.0, 44.0, 58.0]


def test_a_forward_longer_than_its_step_is_counted_and_not_slept():
    clock = Clock()
    pacer = pacing.Pacer(lambda b: 10.0, clock, clock.sleep)
    started = clock.now
    clock.now += 0.015  # the CPU took 15 ms for a 10 ms step
    pacer.pace(pacing.Batch(decodes=1), started)
    assert clock.now == pytest.approx(started + 0.015)
    assert pacer.overruns == 1 and pacer.overrun_ms == pytest.approx(5.0)


def test_settings_come_from_config_json_and_the_environment_overrides_them(tmp_path):
    path = tmp_path / "p.ini"
    path.write_text("[latency-profile]\nbatch = 1\nstep_ms = 7\n")
    settings = config.from_mapping({"latency_profile": str(path)}, env={})
    assert settings.step_function()(pacing.Batch(decodes=1)) == 7.0
    by_env = config.from_mapping({"latency_profile": str(path)}, env={config.ENV_STEP_MS: "3 + decodes"})
    assert by_env.step_function()(pacing.Batch(decodes=2)) == 5.0
    with pytest.raises(pacing.StepFunctionError, match="unknown key"):
        config.from_mapping({"latency_profil": str(path)}, env={})
    with pytest.raises(pacing.StepFunctionError, match="one of them"):
        config.from_mapping({}, env={})
    bad = tmp_path / "bad.ini"
    bad.write_text("[latency-profile]\nbatch = 1\n")
    with pytest.raises(ValueError, match="missing key step_ms"):
        config.from_mapping({"latency_profile": str(bad)}, env={}).step_function()


def test_the_model_dir_writer_makes_the_emulated_gpus_dir(tmp_path):
    profile = tmp_path / "p.ini"
    profile.write_text("[latency-profile]\nbatch = 1\nstep_ms = 7\n")
    assert model_dir.main([str(tmp_path / "m"), "--emulated-gpu-profile", str(profile)], say=lambda _: None) == 0
    written = json.loads((tmp_path / "m" / "config.json").read_text())
    assert written["architectures"] == [ARCHITECTURE] == [model_dir.EMULATED_GPU_ARCHITECTURE]
    assert written["num_hidden_layers"] == 1 and written["head_dim"] == 64
    settings = written[config.CONFIG_KEY]
    assert config.from_mapping(settings, env={}).step_function()(pacing.Batch(decodes=1)) == 7.0
    assert (tmp_path / "m" / "tokenizer.json").exists()
    model_dir.main([str(tmp_path / "m"), "--emulated-gpu-step-ms", "2*batch"], say=lambda _: None)
    again = json.loads((tmp_path / "m" / "config.json").read_text())[config.CONFIG_KEY]
    assert config.from_mapping(again, env={}).step_function()(pacing.Batch(decodes=3)) == 6.0
    with pytest.raises(ValueError, match="one of them"):
        model_dir.write_emulated_gpu_dir(tmp_path / "n")
