"""How `./run.sh profile` fits a profile to AIConfigurator's step estimates
(gmock_engine/tools/gpu_profile.py): a long prompt chunk priced as one
prompt, decode steps that never get cheaper with more requests, and the
MoE experts' scale of prompt chunks. The library is AIConfigurator's own
(the `gpu` extra); without it these tests are skipped, except the pure ones."""

from __future__ import annotations

import logging
import re

import pytest

from gmock_engine.tools import gpu_profile


def _compile(tmp_path, system, model, tp, precision):
    pytest.importorskip("aiconfigurator_core", reason="the gpu extra (pip install 'gmock-engine[gpu]') is not installed")
    logging.getLogger("aiconfigurator_core").setLevel(logging.ERROR)
    handle, _ = gpu_profile.compile_engine(system, model, tp, precision, None, str(tmp_path / "scratch"))
    return handle


def test_monotone_takes_the_least_of_each_step_and_the_larger_batches():
    assert gpu_profile.monotone([12.873, 9.7464, 11.518, 8.3646, 8.7408, 9.8141]) == (8.3646, 8.3646, 8.3646, 8.3646, 8.7408, 9.8141)
    assert gpu_profile.monotone([1.0, 2.0, 2.0, 3.5]) == (1.0, 2.0, 2.0, 3.5)


@pytest.mark.parametrize("tokens", [4096, 8192])
def test_a_long_chunk_beside_decodes_is_priced_as_one_prompt(tokens, tmp_path):
    # AIConfigurator's mixed step of `tokens` prompt tokens with isl = tokens: one prompt whose
    # attention grows with its square; the profile's step of that chunk beside 8 and 32 decodes
    # holding as many tokens (the engine passes sum c*(p + c/2) raw, here c = tokens, p = 0)
    handle = _compile(tmp_path, "h200_sxm", "meta-llama/Llama-3.1-70B", 1, "fp8")
    profile, _ = gpu_profile.tabulate(handle, 1024, 8192)
    for gen in (8, 32):
        estimate = handle.mixed_step_latency(tokens, gen, tokens, 2)
        predicted = profile.predict_ms(gen + 1, tokens, tokens * tokens / 2.0, gen * tokens + tokens, 1)
        assert abs(predicted / estimate - 1.0) < 0.04, (gen, predicted, estimate)


def test_decode_steps_of_more_requests_never_cost_less(tmp_path):
    # B200's fp8 tables put the steps of 1, 2 and 4 requests of Llama-3.1-70B TP 4 above that of 8
    handle = _compile(tmp_path, "b200_sxm", "meta-llama/Llama-3.1-70B", 4, "fp8")
    assert handle.predict_decode_latency(1, 128) > handle.predict_decode_latency(8, 128)
    profile, _ = gpu_profile.tabulate(handle, 1024, 8192)
    steps = profile.step_ms
    assert all(a <= b for a, b in zip(steps, steps[1:])), steps
    # where the tables rise, the profile keeps them: the step of 1 024 requests is the estimate's
    assert abs(profile.predict_ms(1024, context_tokens=1024 * 128) / handle.predict_decode_latency(1024, 128) - 1.0) < 0.03


def test_the_moe_prefill_scale_adds_the_experts_share_of_each_chunk(tmp_path):
    handle = _compile(tmp_path, "h100_sxm", "openai/gpt-oss-120b", 2, "native")
    plain, _ = gpu_profile.tabulate(handle, 1024, 8192)
    scaled, lines = gpu_profile.tabulate(handle, 1024, 8192, moe_prefill_scale=2.0)
    assert scaled.step_ms == plain.step_ms and scaled.prefill_attention_ms == plain.prefill_attention_ms
    for n, before, after in zip(plain.prefill_tokens, plain.prefill_ms, scaled.prefill_ms):
        experts = gpu_profile.moe_prefill_ms(handle, n)
        assert experts > 0 and after - before == pytest.approx(experts, abs=2e-4), n
    assert re.search(r"MoE experts \(context_moe\) x 2 \(--moe-prefill-scale\): \+\d+\.\d ms at 1024", lines[-1])


def test_the_moe_prefill_scale_of_a_dense_model_stops_the_command(tmp_path, capsys):
    pytest.importorskip("aiconfigurator_core", reason="the gpu extra is not installed")
    out = tmp_path / "p.ini"
    argv = ["--system", "h100_sxm", "--model", "meta-llama/Llama-3.1-8B", "--moe-prefill-scale", "2", "-o", str(out)]
    assert gpu_profile.main(argv) == 2
    assert "--moe-prefill-scale: the model has no MoE layers" in capsys.readouterr().err
    assert not out.exists()
