"""What a GPU deployment is, beside its step timing (`./run.sh profile`,
tools/gpu_profile.py): the precisions AIConfigurator times it in, the
kernels its checkpoint runs, and the limits vLLM gives its engine there
(KV blocks from the GPU's memory, the batch defaults). Reads AIConfigurator's
model configs and system specs (the `gpu` extra); no step estimates.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Tuple

#: vLLM's default KV block size on CUDA, and the share of the GPU's memory it takes.
BLOCK_SIZE = 16
GPU_MEMORY_UTILIZATION = 0.9
GIB = 1 << 30
#: Precisions: gemm / kv-cache quant modes of AIConfigurator (None: the checkpoint's own, as
#: its config.json says: bf16 for most, MXFP4 experts for gpt-oss).
PRECISIONS = {"bf16": ("bfloat16", None), "native": (None, None), "fp8": ("fp8", "fp8"), "fp4": ("nvfp4", "fp8")}
#: --kv-cache-dtype (vLLM's `--kv-cache-dtype`): AIConfigurator's kv-cache quant mode
#: (auto: the precision's, as PRECISIONS says).
KV_CACHE_DTYPES = {"bf16": "bfloat16", "fp8": "fp8"}


def quant_modes(precision: str, kv_cache_dtype: str = "auto") -> Tuple[Optional[str], Optional[str]]:
    """AIConfigurator's gemm and kv-cache quant modes for the deployment: the
    precision's, but the KV cache's as `kv_cache_dtype` names it (a deployment
    that keeps a bf16 checkpoint's KV cache in fp8, as vLLM's
    `--kv-cache-dtype fp8`)."""
    gemm, kv = PRECISIONS[precision]
    return gemm, (kv if kv_cache_dtype == "auto" else KV_CACHE_DTYPES[kv_cache_dtype])


def kv_bytes(kv: Optional[str]) -> int:
    """Bytes of one cached K or V element in kv-cache quant mode `kv` (None: bf16)."""
    return 1 if kv in ("fp8", "int8") else 2


def vllm_limits(system: str) -> Tuple[int, int]:
    """max_num_batched_tokens and max_num_seqs as vLLM's OpenAI server
    defaults them on `system` (EngineArgs.get_batch_defaults): the larger
    pair on a GPU of 70 GiB or more that is not an A100."""
    memory = gpu_memory(system)
    if memory >= 70 * GIB and not system.startswith("a100"):
        return 8192, 1024
    return 2048, 256


def _system_spec(system: str) -> dict:
    import aiconfigurator_core
    import yaml

    with open(os.path.join(os.path.dirname(aiconfigurator_core.__file__), "systems", f"{system}.yaml"), encoding="utf-8") as f:
        return yaml.safe_load(f)


def gpu_memory(system: str) -> int:
    """The GPU's memory, bytes."""
    return int(_system_spec(system)["gpu"]["mem_capacity"])


def memory_budget(system: str, model_path: str, tp: int, precision: str, batched_tokens: int,
                  kv_cache_dtype: str = "auto") -> Dict[str, float]:
    """Bytes per TP rank: the weights, the activations of a step of
    `batched_tokens`, the communication buffers, and the KV cache's share
    (what vLLM's profiling run leaves of gpu_memory_utilization); and the KV
    bytes per token per rank."""
    from aiconfigurator_core.sdk.config_builders import build_model_config
    from aiconfigurator_core.sdk.models import get_model

    gemm, kv = quant_modes(precision, kv_cache_dtype)
    model = get_model(model_path, build_model_config(tp, 1, 1, tp, 1, gemm_quant_mode=gemm, kvcache_quant_mode=kv, moe_quant_mode=gemm), "vllm")
    weights = float(sum(op.get_weights() for op in model.context_ops))
    hidden = model._num_heads * model._head_size
    activations = 2.0 * batched_tokens * hidden * {1: 10, 2: 6, 4: 5}.get(min(tp, 8), 5)
    spec = _system_spec(system)
    nccl = float((spec.get("misc", {}).get("nccl_mem") or {}).get(tp, 0))
    from aiconfigurator_core.sdk.utils import get_model_config_from_model_path

    cfg = get_model_config_from_model_path(model_path)
    raw = cfg["raw_config"]
    # a multimodal checkpoint (Kimi-K2.5, Qwen3-VL) keeps its language model's shape in text_config
    raw = raw.get("text_config") or raw
    layers = int(raw.get("num_hidden_layers") or cfg.get("layers"))
    if raw.get("kv_lora_rank"):
        # MLA (DeepSeek V3, Kimi): one latent vector and its rotary key per token and layer,
        # which every TP rank holds whole (vLLM's MLA cache)
        kv_per_token = float((int(raw["kv_lora_rank"]) + int(raw["qk_rope_head_dim"])) * layers * kv_bytes(kv))
    else:
        heads = int(raw["num_attention_heads"])
        kv_heads = int(raw.get("num_key_value_heads") or heads)
        head_dim = int(raw.get("head_dim") or int(raw["hidden_size"]) // heads)
        kv_per_token = 2.0 * max(1, kv_heads // tp) * head_dim * layers * kv_bytes(kv)
    total = GPU_MEMORY_UTILIZATION * gpu_memory(system)
    return {
        "weights": weights,
        "activations": activations,
        "comm": nccl,
        "kv_cache": total - weights - activations - nccl,
        "kv_per_token": kv_per_token,
        "max_model_len": float(raw.get("max_position_embeddings") or 131072),
    }


def engine_section(dep: Any, budget: Dict[str, float], limits: Tuple[int, int], path: str) -> List[str]:
    """The [gmock_engine] lines: the deployment's limits and this profile."""
    batched, seqs = limits
    blocks = int(budget["kv_cache"] // (budget["kv_per_token"] * BLOCK_SIZE))
    return [
        "[gmock_engine]",
        f"# {dep.system}: {gpu_memory(dep.system) / GIB:.0f} GiB x {GPU_MEMORY_UTILIZATION}; per TP rank: weights "
        f"{budget['weights'] / GIB:.1f} GiB, activations of {batched} tokens {budget['activations'] / GIB:.2f} GiB, "
        f"communication {budget['comm'] / GIB:.2f} GiB;",
        f"# KV cache {budget['kv_cache'] / GIB:.1f} GiB at {budget['kv_per_token'] / 1024:.0f} KiB per token per rank",
        f"num-gpu-blocks = {blocks}",
        f"block-size = {BLOCK_SIZE}",
        f"max-model-len = {int(budget['max_model_len'])}",
        "# vLLM's OpenAI server defaults on this GPU",
        f"max-num-batched-tokens = {batched}",
        f"max-num-seqs = {seqs}",
        "# vLLM's default on GPUs: a step is scheduled while the one before runs",
        "async-scheduling = true",
        f"latency-profile = {path}",
    ]




def checkpoint_modes(model_path: str, tp: int, precision: str, kv_cache_dtype: str = "auto") -> Dict[str, str]:
    """The quant modes AIConfigurator times the deployment in, as its model
    config resolves them (`native`: the checkpoint's own, e.g. `fp8_block`
    for MiniMax-M2.5's and Qwen3-235B-A22B-FP8's 128 x 128 scaled fp8):
    `gemm` (the dense layers), `moe` (the experts) and `kv` (the cache)."""
    from aiconfigurator_core.sdk.config_builders import build_model_config
    from aiconfigurator_core.sdk.models import get_model

    gemm, kv = quant_modes(precision, kv_cache_dtype)
    config = get_model(model_path, build_model_config(tp, 1, 1, tp, 1, gemm_quant_mode=gemm, kvcache_quant_mode=kv,
                                                      moe_quant_mode=gemm), "vllm").config  # fmt: skip

    def name(mode: Any) -> str:
        return str(getattr(mode, "name", mode))

    return {"gemm": name(config.gemm_quant_mode), "moe": name(config.moe_quant_mode), "kv": name(config.kvcache_quant_mode)}
