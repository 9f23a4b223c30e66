"""`./run.sh profile --kv-cache-dtype`: a deployment's KV cache kept in
another element type than its precision's (vLLM's `--kv-cache-dtype fp8`
on a bf16 or MXFP4 checkpoint). Checked against AIConfigurator's own engine
compiled with that kv-cache quant mode, and the KV blocks against the
bytes of a cached element. Skipped without the `gpu` extra."""

from __future__ import annotations

import configparser
import logging

import pytest

from gmock_engine.timing.profile import read_profile
from gmock_engine.tools import gpu_profile

GPT_OSS = ["--system", "b200_sxm", "--model", "openai/gpt-oss-120b", "--tp", "2", "--precision", "native"]


def _write(tmp_path, name, argv):
    out = tmp_path / name
    assert gpu_profile.main([*argv, "-o", str(out)]) == 0
    engine = configparser.ConfigParser(interpolation=None)
    engine.read(str(out))
    return out, engine["gmock_engine"], out.read_text()


@pytest.fixture(autouse=True)
def _library():
    pytest.importorskip("aiconfigurator_core", reason="the gpu extra (pip install 'gmock-engine[gpu]') is not installed")
    logging.getLogger("aiconfigurator_core").setLevel(logging.ERROR)


def test_an_fp8_kv_cache_of_an_mxfp4_checkpoint_times_its_attention_and_holds_twice_the_tokens(tmp_path):
    from aiconfigurator_core.sdk import engine

    _, plain_limits, _ = _write(tmp_path, "auto.ini", GPT_OSS)
    path, fp8_limits, text = _write(tmp_path, "fp8.ini", [*GPT_OSS, "--kv-cache-dtype", "fp8"])
    assert text.startswith("# openai/gpt-oss-120b on b200_sxm, TP 2, native, KV cache fp8: vLLM 0.24.0 tables")
    assert "--precision native --kv-cache-dtype fp8 -o " in text.splitlines()[1]
    # gpt-oss-120b: 8 KV heads of 64 over 36 layers, 4 per rank at TP 2: 2 x 4 x 64 x 36 x (1 byte in fp8, 2 in bf16)
    assert "at 18 KiB per token per rank" in text and "at 36 KiB per token per rank" not in text
    assert int(fp8_limits["num-gpu-blocks"]) in (2 * int(plain_limits["num-gpu-blocks"]), 2 * int(plain_limits["num-gpu-blocks"]) + 1)
    # the decode steps follow AIConfigurator's engine compiled with the fp8 kv-cache quant mode,
    # which reads half the bytes per held token: at 256-1024 requests of 4 096 tokens 7-15 % below bf16's
    profile = read_profile(str(path))
    kw = dict(tp_size=2, moe_tp_size=2, gemm_quant_mode=None, moe_quant_mode=None)
    fp8 = engine.EngineHandle.compile("openai/gpt-oss-120b", "b200_sxm", "vllm", kvcache_quant_mode="fp8", **kw)
    bf16 = engine.EngineHandle.compile("openai/gpt-oss-120b", "b200_sxm", "vllm", kvcache_quant_mode=None, **kw)
    for batch in (256, 512, 1024):
        predicted = profile.predict_ms(batch, context_tokens=batch * 4096)
        assert predicted == pytest.approx(fp8.predict_decode_latency(batch, 4096), rel=0.02), batch
        assert predicted < 0.95 * bf16.predict_decode_latency(batch, 4096), batch


def test_a_bf16_kv_cache_beside_fp8_weights_halves_the_blocks(tmp_path):
    argv = ["--system", "h100_sxm", "--model", "meta-llama/Llama-3.1-8B", "--precision", "fp8"]
    _, fp8_limits, fp8_text = _write(tmp_path, "auto.ini", argv)
    _, bf16_limits, bf16_text = _write(tmp_path, "bf16.ini", [*argv, "--kv-cache-dtype", "bf16"])
    # Llama-3.1-8B: 8 KV heads of 128 over 32 layers: 64 KiB per token in fp8, 128 in bf16
    assert "at 64 KiB per token per rank" in fp8_text and "at 128 KiB per token per rank" in bf16_text
    assert int(fp8_limits["num-gpu-blocks"]) // 2 == int(bf16_limits["num-gpu-blocks"])
    assert "fp8, KV cache bf16:" in bf16_text.splitlines()[0]


def test_an_unknown_kv_cache_dtype_stops_naming_the_flag(tmp_path, capsys):
    out = tmp_path / "p.ini"
    assert gpu_profile.main([*GPT_OSS, "--kv-cache-dtype", "fp4", "-o", str(out)]) == 2
    assert "--kv-cache-dtype" in capsys.readouterr().err and not out.exists()


@pytest.mark.parametrize("tp", [4, 8])
def test_an_mla_model_s_kv_cache_holds_its_latent_whole_on_every_rank(tmp_path, tp):
    # Kimi-K2.5: a multimodal checkpoint whose language model (text_config) has MLA attention:
    # 61 layers caching a 512-wide latent and a 64-wide rotary key per token, in fp8 with fp4
    # weights: 61 x (512 + 64) x 1 byte = 34.3 KiB per token, and vLLM's MLA cache keeps it whole
    # on every TP rank (the KV heads are not split)
    argv = ["--system", "b200_sxm", "--model", "moonshotai/Kimi-K2.5", "--tp", str(tp), "--precision", "fp4"]
    _, limits, text = _write(tmp_path, f"tp{tp}.ini", argv)
    assert "at 34 KiB per token per rank" in text
    kv_line = next(line for line in text.splitlines() if line.startswith("# KV cache "))
    kv_gib = float(kv_line.split()[3])
    assert int(limits["num-gpu-blocks"]) == pytest.approx(kv_gib * 2 ** 30 / (61 * 576 * 16), rel=0.01)
