"""The handshake (§2): HELLO, INIT, the registration map each input
socket sends (§2.5) and READY, as plain maps. Pure: the sockets are
transport.py's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

from .eras import WireLayout
from .inputs import unpack
from .types import ProtocolError

def hello_message(local: bool = False, headless: bool = True) -> Dict[str, Any]:
    """HELLO map (§2.2)."""
    return {"status": "HELLO", "local": local, "headless": headless}


@dataclass
class InitMessage:
    """The addresses from INIT (§2.3) that an engine connects to."""

    inputs: List[str]
    outputs: List[str]
    coordinator_input: Optional[str] = None
    coordinator_output: Optional[str] = None
    frontend_stats_publish_address: Optional[str] = None

    @property
    def has_coordinator(self) -> bool:
        return self.coordinator_input is not None


def decode_init(frames: Sequence[bytes]) -> InitMessage:
    """Decode and check INIT (§2.3, checklist item 3)."""
    if len(frames) != 1:
        raise ProtocolError(f"INIT must be exactly one frame, got {len(frames)}")
    message = unpack(frames[0])
    if not isinstance(message, dict) or not isinstance(message.get("addresses"), dict):
        raise ProtocolError("INIT is not a map with an `addresses` map")
    addresses = message["addresses"]
    inputs, outputs = addresses.get("inputs"), addresses.get("outputs")
    for name, value in (("inputs", inputs), ("outputs", outputs)):
        if not isinstance(value, list) or not value or not all(isinstance(a, str) for a in value):
            raise ProtocolError(f"INIT addresses.{name} is not a non-empty list of strings")
    if len(inputs) != len(outputs):
        raise ProtocolError(f"INIT has {len(inputs)} inputs but {len(outputs)} outputs")
    coord_in = addresses.get("coordinator_input")
    coord_out = addresses.get("coordinator_output")
    if (coord_in is None) != (coord_out is None):
        raise ProtocolError("INIT has only one of coordinator_input / coordinator_output")
    stats = addresses.get("frontend_stats_publish_address")
    return InitMessage(list(inputs), list(outputs), coord_in, coord_out, stats if isinstance(stats, str) else None)


def ready_message(
    num_gpu_blocks: int,
    dp_stats_address: Optional[str] = None,
    parallel_config_hash: Optional[str] = None,
    local: bool = False,
    headless: bool = True,
) -> Dict[str, Any]:
    """READY map sent on the handshake socket (§2.7).

    `num_gpu_blocks` and `dp_stats_address` are required by frontends ≤ 0.19
    and harmless later; `parallel_config_hash` only when configured (MoE).
    """
    message = {
        "status": "READY",
        "local": local,
        "headless": headless,
        "num_gpu_blocks": num_gpu_blocks,
        "dp_stats_address": dp_stats_address,
    }
    if parallel_config_hash is not None:
        message["parallel_config_hash"] = parallel_config_hash
    return message


def ready_response(values: Dict[str, Any], layout: WireLayout) -> Dict[str, Any]:
    """The input-socket registration map, every key of the layout (§2.5).

    Raises KeyError naming a missing key, so a gap in the caller's values is
    a bug found at startup, not a frontend that refuses to start.
    """
    return {key: values[key] for key in layout.ready_response_keys}


def engine_ready_response(
    config: Any, init: InitMessage, layout: WireLayout, rank: int, instance_id: str, kv_events_config: Optional[Dict[str, Any]]
) -> Dict[str, Any]:
    """The registration map of engine `rank` (§2.5): full 0.33 key set,
    correct types, from its configuration (`config.Config`), the INIT it
    got and what only the running process knows (its instance id, the KV
    event endpoints' `ready_map()` or None)."""
    c = config
    values = {
        "max_model_len": c.max_model_len,
        "num_gpu_blocks": c.num_gpu_blocks,
        "block_size": c.block_size,
        # Echo the frontend's own stats address (Py-FE asserts equality).
        "dp_stats_address": init.frontend_stats_publish_address,
        "dtype": c.dtype,
        "vllm_version": c.vllm_version,
        "world_size": 1,
        "data_parallel_size": c.data_parallel_size,
        "tensor_parallel_size": 1,
        "pipeline_parallel_size": 1,
        "decode_context_parallel_size": 1,
        "data_parallel_rank": rank,
        "max_num_seqs": c.max_num_seqs,
        "max_num_batched_tokens": c.max_num_batched_tokens,
        "instance_id": instance_id,
        # vLLM: supports_lora = lora_config is not None, max_loras 0 without it (core.py)
        "supports_lora": c.enable_lora,
        "max_loras": c.max_loras if c.enable_lora else 0,
        "mamba_block_size": None,
        "kv_cache_size_tokens": c.num_gpu_blocks * c.block_size,
        "kv_cache_max_concurrency": None,
        "kv_events_config": kv_events_config,
        "weight_transfer_backend": None,
        "enable_sleep_mode": False,
        "supports_draft_weight_updates": False,
        "effective_attention_block_size": c.block_size,
        "coord_store_port": 0,
        "coordinator_input_address": init.coordinator_input,
        "coordinator_output_address": init.coordinator_output,
    }
    return ready_response(values, layout)


def engine_ready_message(config: Any, init: InitMessage) -> Dict[str, Any]:
    """The READY map of an engine with configuration `config` (§2.7)."""
    return ready_message(
        num_gpu_blocks=config.num_gpu_blocks,
        dp_stats_address=init.frontend_stats_publish_address,
        parallel_config_hash=config.parallel_config_hash,
    )
