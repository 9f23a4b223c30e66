"""Prefill/decode disaggregation: `kv_transfer_params`, pure (vLLM: the KV
connector's scheduler side, `vllm/distributed/kv_transfer/kv_connector/v1/`).

A P/D router (vLLM's disaggregated-serving proxy, llm-d's sidecar, Dynamo)
sends each request twice. First to a prefill server with `max_tokens=1` and
`kv_transfer_params = {"do_remote_decode": true, ...}`; that engine (a
*producer*) prefills, ends the request after its first token and answers
with the `kv_transfer_params` the decode side needs (NIXL's
`request_finished`: `do_remote_prefill`, `remote_engine_id`, `remote_host`,
`remote_port`, `remote_block_ids`, `remote_request_id`, `tp_size`, ...).
Then the router sends the original request with those params to a decode
server; that engine (a *consumer*) loads the KV from the prefill side
instead of prefilling (vLLM's WAITING_FOR_REMOTE_KVS) and decodes. The mock
moves no KV: the consumer waits the configured transfer time and then
decodes, and a transfer can fail (the request ends with ERROR, vLLM's
default `kv_load_failure_policy` "fail") or be slow (fault injection).

The params reach the engine in `SamplingParams.extra_args["kv_transfer_params"]`
(docs/protocol.md §3.3; both frontends put the HTTP body's `kv_transfer_params`
there) and leave in EngineCoreOutput index 8 (§4.3, the same index in every
era), on the request's terminal output.

This module: the `--kv-transfer-config` JSON and `--kv-role` (`KVTransferSettings`),
the plan of a request's params (`plan`, which has wire.checks check them,
raising BadValue: an ERROR output for that request only), the producer's response params and the consumer's
transfer time. The scheduler asks it at admission and at a request's end.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from gmock_engine.wire.checks import Xargs, check_kv_transfer_params

#: Roles as `--kv-role` spells them, and vLLM's `kv_role` values (config/kv_transfer.py).
ROLES = ("producer", "consumer", "both")
VLLM_ROLES = {"kv_producer": "producer", "kv_consumer": "consumer", "kv_both": "both"}
#: What a failed KV load does (vLLM's KVTransferConfig.kv_load_failure_policy; "fail" is its default).
LOAD_FAILURE_POLICIES = ("fail", "recompute")
#: Keys of vLLM's KVTransferConfig (0.32, and kv_ip/kv_rank/kv_parallel_size/kv_buffer_size
#: of older releases): a JSON a vLLM user wrote is accepted as it is; any other key is a typo.
KV_TRANSFER_CONFIG_KEYS = (
    "kv_connector",
    "engine_id",
    "kv_buffer_device",
    "kv_buffer_size",
    "kv_role",
    "kv_rank",
    "kv_parallel_size",
    "kv_ip",
    "kv_port",
    "kv_connector_extra_config",
    "kv_connector_module_path",
    "enable_permute_local_kv",
    "kv_load_failure_policy",
)
#: NIXL's side channel defaults (vllm/envs.py VLLM_NIXL_SIDE_CHANNEL_HOST/PORT);
#: the port is offset by the DP rank, as NIXL's.
DEFAULT_HOST = "localhost"
DEFAULT_PORT = 5600
#: The error of a failed KV load (vLLM ends it with FinishReason.ERROR, scheduler.py).
KV_LOAD_FAILURE_MESSAGE = "KV transfer from the prefill engine failed (mock: vllm_xargs mock_kv_load or --fault-kv-transfer-fail)"


@dataclass(frozen=True)
class KVTransferSettings:
    """An engine's P/D role and its transfer model (from `--kv-role`,
    `--kv-transfer-config` and `--kv-transfer-ms-per-*`)."""

    role: str = "both"
    engine_id: str = "gmock"
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    load_failure_policy: str = "fail"
    ms_per_token: float = 0.0
    ms_per_block: float = 0.0
    #: vLLM names the engine of DP rank r `<engine_id>_dp<r>` when DP > 1.
    data_parallel_size: int = 1

    @property
    def produces(self) -> bool:
        """Serves `do_remote_decode` requests (the prefill side)."""
        return self.role in ("producer", "both")

    @property
    def consumes(self) -> bool:
        """Serves `do_remote_prefill` requests (the decode side)."""
        return self.role in ("consumer", "both")

    def engine_id_of(self, rank: int) -> str:
        """remote_engine_id of this engine (NIXL: one id per DP rank)."""
        return f"{self.engine_id}_dp{rank}" if self.data_parallel_size > 1 else self.engine_id

    def transfer_seconds(self, tokens: int, block_size: int) -> float:
        """How long loading `tokens` prompt tokens takes: per token plus per block."""
        blocks = -(-tokens // block_size) if tokens > 0 else 0
        return (tokens * self.ms_per_token + blocks * self.ms_per_block) / 1000.0


def parse_kv_transfer_config(text: str) -> Dict[str, Any]:
    """`--kv-transfer-config`: vLLM's JSON (`{"kv_connector": "NixlConnector",
    "kv_role": "kv_both"}`), checked key by key; ValueError names what is wrong."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ValueError(f"must be a JSON object, not {type(value).__name__}")
    for key in value:
        if key not in KV_TRANSFER_CONFIG_KEYS:
            raise ValueError(f"unknown key {key!r} (vLLM's KVTransferConfig has {', '.join(KV_TRANSFER_CONFIG_KEYS)})")
    role = value.get("kv_role")
    if role is not None and role not in VLLM_ROLES:
        raise ValueError(f"kv_role must be one of {', '.join(VLLM_ROLES)}, not {role!r}")
    if value.get("kv_connector") is not None and role is None:
        raise ValueError("kv_connector is set but kv_role is not (vLLM requires both)")
    for key in ("kv_connector", "engine_id", "kv_ip", "kv_buffer_device", "kv_connector_module_path"):
        if value.get(key) is not None and (not isinstance(value[key], str) or not value[key]):
            raise ValueError(f"{key} must be a non-empty string, not {value[key]!r}")
    port = value.get("kv_port")
    if port is not None and (isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536):
        raise ValueError(f"kv_port must be an integer in 1..65535, not {port!r}")
    policy = value.get("kv_load_failure_policy")
    if policy is not None and policy not in LOAD_FAILURE_POLICIES:
        raise ValueError(f"kv_load_failure_policy must be fail or recompute, not {policy!r}")
    extra = value.get("kv_connector_extra_config")
    if extra is not None and not isinstance(extra, dict):
        raise ValueError("kv_connector_extra_config must be a JSON object")
    return value


def settings_from(
    role: Optional[str],
    config: Optional[Dict[str, Any]],
    ms_per_token: float,
    ms_per_block: float,
    data_parallel_size: int,
) -> Optional[KVTransferSettings]:
    """The engine's P/D settings, or None when P/D is off (neither
    `--kv-role` nor a `kv_role` in `--kv-transfer-config`). The caller has
    checked that a role given both ways agrees."""
    config = config or {}
    if role is None and config.get("kv_role") is not None:
        role = VLLM_ROLES[config["kv_role"]]
    if role is None:
        return None
    return KVTransferSettings(
        role=role,
        engine_id=config.get("engine_id") or "gmock",
        host=config.get("kv_ip") or DEFAULT_HOST,
        port=config.get("kv_port") or DEFAULT_PORT,
        load_failure_policy=config.get("kv_load_failure_policy") or "fail",
        ms_per_token=ms_per_token,
        ms_per_block=ms_per_block,
        data_parallel_size=data_parallel_size,
    )


class KVPlan:
    """What P/D means for one request (`Request.kv`): it produces KV for a
    decode engine (`produce`), or loads it from a prefill engine (`consume`:
    its transfer, whether it fails, the extra delay)."""

    __slots__ = ("produce", "consume", "fail", "delay_s", "transfer_s", "loaded_tokens")

    def __init__(self, produce: bool = False, consume: bool = False, fail: bool = False, delay_s: float = 0.0) -> None:
        self.produce = produce
        self.consume = consume
        self.fail = fail
        self.delay_s = delay_s
        #: set at admission: the transfer's duration (the consumer's time to
        #: first token) and the prompt tokens it loads (PrefillStats' external ones)
        self.transfer_s = 0.0
        self.loaded_tokens = 0


class KVTransfer:
    """One engine's P/D side: checks requests' params, makes the producer's
    response params (with block ids of its own), times the consumer's load."""

    def __init__(self, settings: KVTransferSettings, rank: int, num_gpu_blocks: int) -> None:
        self.settings = settings
        self.rank = rank
        self.engine_id = settings.engine_id_of(rank)
        self.port = settings.port + rank
        self._num_blocks = max(1, num_gpu_blocks)
        self._next_block = 0

    def admitted(self, plan: KVPlan, tokens: int, block_size: int, time_scale: float = 1.0) -> float:
        """A consumer request joins the batch: the seconds its KV load of
        `tokens` prompt tokens takes (the mock's WAITING_FOR_REMOTE_KVS)."""
        plan.loaded_tokens = tokens
        plan.transfer_s = (self.settings.transfer_seconds(tokens, block_size) + plan.delay_s) * time_scale
        return plan.transfer_s

    def response(self, request_id: str, num_tokens: int, block_size: int, cached_tokens: int) -> Dict[str, Any]:
        """The kv_transfer_params a producer returns on a request's terminal
        output, as NIXL's `request_finished` (pull_scheduler.py) and the
        scheduler's `remote_prefill_cached_tokens` (core/scheduler.py): what the
        decode engine needs to pull the prompt's KV blocks from here."""
        blocks = -(-num_tokens // block_size) if num_tokens > 0 else 0
        start = self._next_block
        self._next_block = (start + blocks) % self._num_blocks
        ids = [(start + i) % self._num_blocks for i in range(blocks)]
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [ids],  # one list per KV cache group (kv_connector/utils.py BlockIds)
            "remote_engine_id": self.engine_id,
            "remote_request_id": request_id,
            "remote_host": self.settings.host,
            "remote_port": self.port,
            "tp_size": 1,
            "remote_num_tokens": num_tokens,
            "remote_prefill_cached_tokens": cached_tokens,
        }


def plan(transfer: Optional[KVTransfer], extra_args: Dict[str, Any], xargs: Xargs) -> Optional[KVPlan]:
    """A request's P/D plan from its extra_args and their checked P/D
    scenarios (`xargs`, wire.checks.check_xargs), or None (a plain request).

    Where P/D is on, kv_transfer_params are checked as strictly as the
    vllm_xargs (wire.checks.check_kv_transfer_params): a value of the wrong
    type raises BadValue naming the key (the request ends with ERROR, §3.3). With P/D off
    (`transfer` None), or a direction this engine's role does not serve, or
    consumer params NIXL could not load from, the request runs as a plain
    one, as vLLM's engine without a connector ("Got kv_transfer_params, but
    no KVConnector found", core.py) and NIXL's update_state_after_alloc do.
    A producer request gets one token (vLLM's proxy sends max_tokens=1; the
    mock ends it after its first token whatever max_tokens says)."""
    params = extra_args.get("kv_transfer_params")
    if params is None or transfer is None:
        return None
    check_kv_transfer_params(params)
    settings = transfer.settings
    if params.get("do_remote_decode") is True and settings.produces:
        return KVPlan(produce=True)
    if params.get("do_remote_prefill") is True and settings.consumes and complete(params):
        return KVPlan(consume=True, fail=xargs.kv_load_fails, delay_s=xargs.kv_delay_s)
    return None


def complete(params: Dict[str, Any]) -> bool:
    """A consumer can load from these params: block ids and the four keys
    NIXL requires (update_state_after_alloc); otherwise vLLM logs "Got
    invalid KVTransferParams" and computes the prompt itself."""
    return bool(params.get("remote_block_ids")) and all(
        params.get(key) is not None for key in ("remote_engine_id", "remote_request_id", "remote_host", "remote_port")
    )


def remote_prefill_requested(extra_args: Dict[str, Any]) -> bool:
    """The request asks to load its KV from a prefill engine (an occasion
    of the kv-transfer-* faults)."""
    params = extra_args.get("kv_transfer_params")
    return isinstance(params, dict) and params.get("do_remote_prefill") is True


def describe(params: Any, limit: int = 2000) -> str:
    """kv_transfer_params for a log line: JSON with sorted keys when it can
    be (the e2e tests compare it), else repr; at most `limit` characters."""
    try:
        text = json.dumps(params, sort_keys=True, default=repr)
    except (TypeError, ValueError):  # keys of mixed types cannot be sorted
        text = repr(params)
    return text[:limit]


__all__: List[str] = [
    "KVPlan",
    "KVTransfer",
    "KVTransferSettings",
    "KV_LOAD_FAILURE_MESSAGE",
    "ROLES",
    "describe",
    "parse_kv_transfer_config",
    "plan",
    "remote_prefill_requested",
    "settings_from",
]
