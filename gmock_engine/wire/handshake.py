"""The handshake (§2): HELLO, INIT, the registration map each input
socket sends (§2.5) and READY, as plain maps. Pure: the sockets are
runtime/transport.py's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

from gmock_engine.wire.eras import WireLayout
from gmock_engine.wire.inputs import unpack
from gmock_engine.wire.types import ProtocolError

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


# -- reaching the frontend from another host -------------------------------------

#: Host names that mean "this host" wherever they are used: an INIT address
#: with one reaches the frontend only from the frontend's own host.
_SELF_NAMES = frozenset({"localhost", "0.0.0.0", "::", "*", "::1", "ip6-localhost"})

#: The frontend flag that sets the address it binds and advertises, per kind.
FRONTEND_ADDRESS_FLAGS = (
    "vllm serve: --data-parallel-address IP --data-parallel-rpc-port PORT; "
    "vllm-rs serve: --data-parallel-address IP (alias --handshake-host) --handshake-port PORT"
)


def tcp_host_port(address: str) -> Optional["tuple[str, int]"]:
    """(host, port) of a `tcp://HOST:PORT` address (IPv6 brackets removed), else None."""
    if not address.startswith("tcp://"):
        return None
    host, sep, port = address[len("tcp://"):].rpartition(":")
    if not sep or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def names_this_host(host: str) -> bool:
    """Does `host` mean the host it is used on (loopback or "any address")?"""
    return host.lower() in _SELF_NAMES or host.startswith("127.")


def init_address_problem(handshake_address: str, init: InitMessage) -> Optional[str]:
    """What is wrong when the engine reached the frontend at a non-local
    `handshake_address` but INIT names loopback or 0.0.0.0 addresses, or None.

    Such an INIT comes from a frontend started with `--data-parallel-address`
    127.0.0.1, localhost or 0.0.0.0: it advertises what it bound, and on the
    engine's host those addresses are the engine's own host, so the input and
    output sockets never reach the frontend, which then waits for its engines
    (no error on either side). Same host (a local handshake address): fine.
    """
    reached = tcp_host_port(handshake_address)
    if reached is None or names_this_host(reached[0]):
        return None
    named = [init.inputs, init.outputs, [init.coordinator_input, init.coordinator_output]]
    local = []
    for address in (a for group in named for a in group if a):
        parsed = tcp_host_port(address)
        if parsed is not None and names_this_host(parsed[0]):
            local.append(address)
    if not local:
        return None
    host = tcp_host_port(local[0])[0]  # type: ignore[index]
    return (
        f"the frontend at {handshake_address} sent INIT naming {', '.join(local)}: on this host {host} is this "
        "host itself, not the frontend's, so these sockets never reach the frontend and it keeps waiting for its "
        f"engines. The frontend was started with --data-parallel-address {host}: restart it with "
        f"--data-parallel-address <the frontend host's IP as the engine hosts reach it> (here perhaps {reached[0]}) "
        f"- {FRONTEND_ADDRESS_FLAGS}"
    )


def reach_hint(address: str, outcome: str, ranks: str, dp: int, last_rank: int) -> str:
    """What a plain TCP connect to the handshake `address` tells an engine that
    got no INIT, and what to check. `outcome`: "open" (something accepts
    there), "refused", "timeout", "unreachable" or another error's text; `ranks` names the
    waiting engines ("engines 0..3"), `last_rank` the highest rank of this
    process, `dp` its --data-parallel-size."""
    parsed = tcp_host_port(address)
    where = f"{parsed[0]}:{parsed[1]}" if parsed else address
    if outcome == "open":
        return (
            f"{where} accepts connections, but sent no INIT to {ranks}: if it is the frontend's handshake port, "
            f"the frontend does not expect these ranks. Its --data-parallel-size must be {dp} like this process's "
            f"(these are ranks up to {last_rank}; every engine host's slice together covers 0..{dp - 1} exactly once); "
            "or another engine process already joined with these ranks; or the frontend already has all its engines"
        )
    if outcome == "refused":
        return (
            f"nothing listens at {where} (connection refused): the frontend is not running there yet, has exited "
            "(see its log), already has all its engines (both frontends close the handshake then: is its "
            f"--data-parallel-size {dp} like this process's?), or listens on another address or port. "
            "A frontend started with --data-parallel-address "
            "127.0.0.1 or localhost listens on its loopback only, out of reach from other hosts: give it the IP the "
            f"engine hosts reach it at - {FRONTEND_ADDRESS_FLAGS}"
        )
    if outcome in ("timeout", "unreachable"):
        why = "TCP connect timed out" if outcome == "timeout" else "no route to host"
        return (
            f"{where} is not reachable from this host ({why}: the host is down or cut off, a route is missing, or a "
            "firewall drops the packets): check that this host reaches the frontend host on the handshake port and "
            "on its ephemeral ports (docs/operations.md, Engines on several hosts)"
        )
    return f"connecting to {where} failed ({outcome}): check the address of --handshake-address"


#: Why an engine that got INIT from the Python frontend may wait for its DP
#: coordinator's READY: the coordinator sends it only once every engine of
#: the frontend's DP size subscribed.
COORDINATOR_WAIT_HINT = (
    "the coordinator sends READY once all the engines of the frontend's --data-parallel-size joined: "
    "are ranks missing (an engine host not started, or the frontend's --data-parallel-size larger than the "
    "engines' --data-parallel-size)?"
)
