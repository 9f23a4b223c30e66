"""`./run.sh profile --decode-comm-scale F`: the decode steps' tensor-parallel
communication (AIConfigurator's all-reduce ops and a MoE layer's dispatch)
times F; a prompt chunk's own stays the tables'. Checked against the per-op breakdown of AIConfigurator's own
engine, the op names spelled out here; skipped without the `gpu` extra."""

from __future__ import annotations

import logging

import pytest

from gmock_engine.timing.profile import read_profile
from gmock_engine.tools import gpu_profile

LLAMA = ["--system", "h100_sxm", "--model", "meta-llama/Llama-3.1-70B", "--precision", "fp8"]
ALL_REDUCES = {"context_ar_1", "context_ar_2", "context_embedding_ar"}
MOE_DISPATCH = {"context_moe_pre_dispatch", "context_moe_post_dispatch", "context_embedding_ar"}


@pytest.fixture(autouse=True)
def _library():
    pytest.importorskip("aiconfigurator_core", reason="the gpu extra (pip install 'gmock-engine[gpu]') is not installed")
    logging.getLogger("aiconfigurator_core").setLevel(logging.ERROR)


def _profiles(tmp_path, argv, scale):
    paths = []
    for name, extra in (("plain.ini", []), ("scaled.ini", ["--decode-comm-scale", str(scale)])):
        path = tmp_path / name
        assert gpu_profile.main([*argv, *extra, "-o", str(path)]) == 0
        paths.append(path)
    return read_profile(str(paths[0])), read_profile(str(paths[1])), paths[1].read_text()


def _breakdown(model, tp, quant, prompt_tokens, decodes, names):
    import tempfile

    from aiconfigurator_core.sdk import engine

    path = gpu_profile.resolve_model(model, tempfile.mkdtemp())  # the bundled config of a listed model
    handle = engine.EngineHandle.compile(path, "h100_sxm", "vllm", tp_size=tp, moe_tp_size=tp, gemm_quant_mode=quant,
                                         kvcache_quant_mode=quant, moe_quant_mode=quant)  # fmt: skip
    ops = handle.mixed_step_breakdown_per_op(prompt_tokens, decodes, max(prompt_tokens, 1024), 2)[0]
    return sum(op[1] for op in ops if op[0] in names)


def test_at_tp_8_a_decode_step_gains_its_all_reduces_times_the_scale_less_one(tmp_path):
    plain, scaled, text = _profiles(tmp_path, [*LLAMA, "--tp", "8"], 2.5)
    assert "--precision fp8 --decode-comm-scale 2.5 -o " in text.splitlines()[1]
    assert "decode steps' tensor-parallel communication x 2.5 (--decode-comm-scale)" in text
    for batch in (1, 8, 64):
        added = scaled.predict_ms(batch, context_tokens=batch * 512) - plain.predict_ms(batch, context_tokens=batch * 512)
        expected = 1.5 * _breakdown("meta-llama/Llama-3.1-70B", 8, "fp8", 0, batch, ALL_REDUCES)
        assert expected > 0.5 and added == pytest.approx(expected, abs=0.01), batch
    # a 1 024-token chunk beside one decode: the decode step's all-reduces only, the chunk's stay
    added = scaled.predict_ms(2, 1024, context_tokens=2048) - plain.predict_ms(2, 1024, context_tokens=2048)
    assert added == pytest.approx(1.5 * _breakdown("meta-llama/Llama-3.1-70B", 8, "fp8", 0, 2, ALL_REDUCES), abs=0.01)


def test_at_tp_1_nothing_is_communicated_and_the_steps_stay(tmp_path):
    plain, scaled, _ = _profiles(tmp_path, ["--system", "h100_sxm", "--model", "meta-llama/Llama-3.1-8B", "--precision", "fp8"], 2)
    for batch in (1, 16, 256):
        assert scaled.predict_ms(batch, 512, context_tokens=batch * 512) == pytest.approx(
            plain.predict_ms(batch, 512, context_tokens=batch * 512), abs=0.01)


def test_a_moe_model_scales_its_experts_dispatch(tmp_path):
    argv = ["--system", "h100_sxm", "--model", "openai/gpt-oss-120b", "--tp", "4", "--precision", "native"]
    plain, scaled, _ = _profiles(tmp_path, argv, 2)
    added = scaled.predict_ms(8, context_tokens=8 * 512) - plain.predict_ms(8, context_tokens=8 * 512)
    expected = _breakdown("openai/gpt-oss-120b", 4, None, 0, 8, MOE_DISPATCH)
    assert expected > 0.1 and added == pytest.approx(expected, abs=0.01)
