"""benchmarks/silicon.py's choice of rows: a shipped profile is one TP group,
so a silicon row of an expert-parallel or attention-data-parallel
deployment is served by none, even where a profile of the same model,
system, TP and precision ships. Read from AIConfigurator's own
silicon_sample.csv; skipped without the `gpu` extra."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # a script of the checkout

pytest.importorskip("aiconfigurator_core", reason="the gpu extra (pip install 'gmock-engine[gpu]') is not installed")

import silicon  # noqa: E402


def _spread(row):
    return int(row["moe_ep_size"] or 1) > 1 or int(row["attention_dp_size"] or 1) > 1


def test_a_row_is_served_by_the_profile_of_its_deployment_and_never_an_expert_parallel_one():
    index = silicon.profile_index()
    rows = silicon.silicon_rows()
    served = [(row, silicon.row_key(row)) for row in rows if silicon.row_key(row) in index]
    assert len(served) > 400
    for row, (model, system, tp, _) in served:
        assert not _spread(row)
        assert (system, tp) == (row["system"], int(row["tp_size"]))
        with open(index[(model, system, tp, _)], encoding="utf-8") as f:
            assert f.readline().startswith(f"# {model} on {system}, TP {tp}, ")
    # MiniMax-M2.5 on B200 at TP 4 in fp8 ships; the file also holds that model, system, TP and
    # precision with its experts over 4 and 16 GPUs, which are other deployments
    minimax = [r for r in rows if r["model_path"] == "MiniMaxAI/MiniMax-M2.5" and r["system"] == "b200_sxm"
               and r["tp_size"] == "4" and r["precision"] == "fp8"]  # fmt: skip
    assert any(_spread(r) for r in minimax) and any(not _spread(r) for r in minimax)
    assert all((silicon.row_key(r) is None) == _spread(r) for r in minimax)
    assert ("MiniMaxAI/MiniMax-M2.5", "b200_sxm", 4, "native") in index


def test_a_row_in_the_checkpoint_s_own_format_is_served_by_the_native_profile():
    # MiniMax-M2.5 and Qwen3-235B-A22B-FP8 ship block-scaled fp8 (their config's weight_block_size),
    # gpt-oss MXFP4 (which the rows call fp4), Kimi-K2.5 int4; Llama-3.1-70B ships bf16, so its
    # fp8 rows are an fp8 deployment of a bf16 checkpoint, as are MiniMax's NVFP4 rows of its fp8 one
    keys = {(r["model_path"], r["precision"]): silicon.row_key(r) for r in silicon.silicon_rows() if not _spread(r)}
    assert keys[("MiniMaxAI/MiniMax-M2.5", "fp8")][3] == "native"
    assert keys[("Qwen/Qwen3-235B-A22B-FP8", "fp8")][3] == "native"
    assert keys[("openai/gpt-oss-120b", "fp4")][3] == "native"
    assert keys[("moonshotai/Kimi-K2.5", "int4")][3] == "native"
    assert keys[("meta-llama/Llama-3.1-70B", "fp8")][3] == "fp8"
    assert keys[("MiniMaxAI/MiniMax-M2.5", "fp4")][3] == "fp4"
    assert keys[("moonshotai/Kimi-K2.5", "fp4")][3] == "fp4"
