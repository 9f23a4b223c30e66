"""The emulated GPU's model for vLLM: a Qwen2 decoder (the model dir's, one
layer, dummy weights) whose forward computes for real and then paces the
step to the time its step function gives for the batch (pacing.py).

The batch is read from the forward context's attention metadata, which
vLLM's CPU attention backend builds per step (vllm/v1/attention/backends/
cpu_attn.py, CPUAttentionMetadata): `query_start_loc` (the tokens each
request computes in the step) and `seq_lens` (what it holds once they are
computed). Forwards without attention metadata (vLLM's dummy and profiling
runs at start) are not paced.

The step function and its options come from the model dir's config.json,
key `gmock_emulated_gpu` (written by gmock_engine/tools/model_dir.py
`--emulated-gpu`): `latency_profile` (a path) or `step_ms` (an
expression), `spread` and `seed`; the environment variables
GMOCK_EMULATED_GPU_PROFILE and GMOCK_EMULATED_GPU_STEP_MS override them.
"""

from __future__ import annotations

import atexit
import logging
import time
from typing import Any, List, Optional, Tuple

from vllm.forward_context import get_forward_context, is_forward_context_available
from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM

from . import config as emulated_config
from .pacing import Batch, Pacer, batch_from_lengths

logger = logging.getLogger("gmock_emulated_gpu")


def _lengths(attn_metadata: Any) -> Optional[Tuple[List[int], List[int]]]:
    """(query lengths, sequence lengths) of the step, from the forward
    context's attention metadata (a dict per layer, or a list of such dicts
    with micro-batching); None when there is none (a dummy run)."""
    if attn_metadata is None:
        return None
    if isinstance(attn_metadata, list):
        attn_metadata = attn_metadata[0] if attn_metadata else None
    if isinstance(attn_metadata, dict):
        attn_metadata = next(iter(attn_metadata.values()), None)
    qsl = getattr(attn_metadata, "query_start_loc", None)
    seq = getattr(attn_metadata, "seq_lens", None)
    if qsl is None or seq is None:
        return None
    starts = qsl.tolist()
    seq_lens = seq.tolist()
    queries = [b - a for a, b in zip(starts, starts[1:])]
    return queries, seq_lens[: len(queries)]


class GmockEmulatedGpuForCausalLM(Qwen2ForCausalLM):
    """Qwen2ForCausalLM whose every step takes the emulated GPU's time."""

    def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        settings = emulated_config.from_hf_config(vllm_config.model_config.hf_config)
        self._pacer = Pacer(settings.step_function())
        logger.warning("gmock emulated GPU: %s", settings.describe())
        atexit.register(self._report)

    def _report(self) -> None:
        p = self._pacer
        logger.warning("gmock emulated GPU: %d steps paced, %d took longer than their time (%.1f ms in all)",
                       p.steps, p.overruns, p.overrun_ms)

    def forward(self, input_ids: Any, positions: Any, intermediate_tensors: Any = None, inputs_embeds: Any = None,
                **kwargs: Any) -> Any:  # fmt: skip
        started = time.monotonic()
        hidden_states = super().forward(input_ids, positions, intermediate_tensors, inputs_embeds, **kwargs)
        lengths = _lengths(get_forward_context().attn_metadata) if is_forward_context_available() else None
        if lengths is not None:
            batch: Batch = batch_from_lengths(*lengths)
            if batch.batch:
                self._pacer.pace(batch, started)
        return hidden_states
