"""`./run.sh profile` on a checkpoint in block-scaled fp8 (MiniMax-M2.5's,
Qwen3-235B-A22B-FP8's): AIConfigurator's vLLM tables time those GEMMs
without CUDA graphs (its collector's `use_cuda_graph=gemm_type !=
"fp8_block"`), so each entry holds its call's host time. The profile's
header says so, and `--block-fp8-gemms per-tensor` prices the dense layers'
GEMMs with the per-tensor fp8 tables (timed under CUDA graphs) and nothing
else. Checked against the library's own tables and per-op breakdown;
skipped without the `gpu` extra."""

from __future__ import annotations

import logging
import os

import pytest

from gmock_engine.timing.profile import read_profile
from gmock_engine.tools import gpu_profile

MINIMAX = ["--system", "h200_sxm", "--model", "MiniMaxAI/MiniMax-M2.5", "--tp", "4", "--precision", "native"]


@pytest.fixture(autouse=True)
def _library():
    pytest.importorskip("aiconfigurator_core", reason="the gpu extra (pip install 'gmock-engine[gpu]') is not installed")
    logging.getLogger("aiconfigurator_core").setLevel(logging.ERROR)


def _gemm_table(system):
    import aiconfigurator_core
    import pandas

    root = os.path.join(os.path.dirname(aiconfigurator_core.__file__), "systems", "data", system, "gemm", "vllm", "0.24.0")
    return pandas.read_parquet(os.path.join(root, "gemm_perf.parquet"))


@pytest.mark.parametrize("system", ["h200_sxm", "b200_sxm"])
def test_the_tables_block_fp8_gemms_are_flat_where_the_graphed_ones_are_not(system):
    """What the header says of the tables: at MiniMax-M2.5's attention shapes (TP 4) a block-fp8
    GEMM of 8 or 128 rows costs several times the per-tensor fp8 one, and about what one of
    1 024 rows grows far less from those rows than the per-tensor one's does (a call's host
    time, not the GPU's work, which grows with the rows)."""
    table = _gemm_table(system)

    def latency(dtype, m, n, k):
        row = table[(table.gemm_dtype == dtype) & (table.m == m) & (table.n == n) & (table.k == k)]
        assert len(row) == 1, (dtype, m, n, k)
        return float(row.latency.iloc[0])

    for n, k in ((2048, 3072), (3072, 1536)):
        for m in (8, 128):
            assert latency("fp8_block", m, n, k) > 5 * latency("fp8", m, n, k), (m, n, k)
            block_growth = latency("fp8_block", 1024, n, k) / latency("fp8_block", m, n, k)
            graphed_growth = latency("fp8", 1024, n, k) / latency("fp8", m, n, k)
            assert graphed_growth > 2 and block_growth < 0.6 * graphed_growth, (m, n, k, block_growth, graphed_growth)


def _decode_ops(block_fp8_gemms, tmp_path):
    handle, dep = gpu_profile.compile_engine("h200_sxm", "MiniMaxAI/MiniMax-M2.5", 4, "native", None, str(tmp_path / "s"),
                                             block_fp8_gemms=block_fp8_gemms)  # fmt: skip
    assert dep.dense_gemms == "fp8_block"
    ops = {}
    for name, ms, *_ in handle.mixed_step_breakdown_per_op(0, 8, 1000, 2)[0]:
        ops[name] = ops.get(name, 0.0) + ms
    return ops


def test_per_tensor_reprices_the_dense_gemms_and_nothing_else(tmp_path):
    tables, per_tensor = _decode_ops("tables", tmp_path), _decode_ops("per-tensor", tmp_path)
    assert tables.keys() == per_tensor.keys()
    dense = {name for name in tables if name.endswith("_gemm") and "router" not in name}
    assert dense >= {"context_qkv_gemm", "context_proj_gemm"}
    for name in dense:
        assert per_tensor[name] < tables[name] / 3, name
    for name in tables.keys() - dense:  # the experts (context_moe) in their block fp8, attention, norms, router
        assert per_tensor[name] == pytest.approx(tables[name], rel=1e-9), name


def test_the_header_says_how_the_dense_gemms_are_priced(tmp_path):
    plain, repriced = tmp_path / "tables.ini", tmp_path / "per-tensor.ini"
    assert gpu_profile.main([*MINIMAX, "-o", str(plain)]) == 0
    assert gpu_profile.main([*MINIMAX, "--block-fp8-gemms", "per-tensor", "-o", str(repriced)]) == 0
    text, text2 = plain.read_text(), repriced.read_text()
    assert "dense GEMMs in block-scaled fp8:" in text and "without CUDA graphs" in text
    assert "--block-fp8-gemms" not in text.splitlines()[1]
    assert "--precision native --block-fp8-gemms per-tensor -o " in text2.splitlines()[1]
    assert "priced with the per-tensor fp8 tables" in text2
    # the decode step of one request: the tables' block-fp8 GEMMs are most of it
    assert read_profile(str(repriced)).predict_ms(1, context_tokens=128) < 0.6 * read_profile(str(plain)).predict_ms(1, context_tokens=128)


def test_a_checkpoint_without_block_fp8_gemms_has_no_note_and_refuses_the_flag(tmp_path, capsys):
    llama = ["--system", "h200_sxm", "--model", "meta-llama/Llama-3.1-8B", "--precision", "fp8"]
    out = tmp_path / "llama.ini"
    assert gpu_profile.main([*llama, "-o", str(out)]) == 0
    assert "block-scaled fp8" not in out.read_text()
    capsys.readouterr()
    assert gpu_profile.main([*llama, "--block-fp8-gemms", "per-tensor", "-o", str(tmp_path / "x.ini")]) == 2
    err = capsys.readouterr().err
    assert "--block-fp8-gemms per-tensor" in err and "fp8_block" in err
    assert gpu_profile.main([*llama, "--block-fp8-gemms", "eager", "-o", str(tmp_path / "y.ini")]) == 2
