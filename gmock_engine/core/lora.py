"""LoRA adapters: the wire's LoRARequest and the engine's adapter registry,
pure (vLLM: `vllm/lora/request.py`, `vllm/lora/worker_manager.py`
`LRUCacheWorkerLoRAManager`, `vllm/lora/model_manager.py`
`LRUCacheLoRAModelManager`, `vllm/utils/cache.py` `LRUCache`).

A real engine keeps two LRU caches of adapters: the registered ones ("CPU",
capacity `max_cpu_loras`) and the active ones ("GPU" slots, capacity
`max_loras`); an adapter evicted from the CPU cache leaves the GPU too, and a
pinned adapter is never evicted from either. `add_lora` loads an adapter
(reading `adapter_config.json` from its path), evicting the least recently
used unpinned one when the CPU cache is full, and activates it; a request
naming an adapter does the same when it is scheduled. The mock holds no
weights: "loading" is checking the adapter directory as vLLM's PEFTHelper
does (optional, `--lora-check-adapter-dir`) and, in the latency model,
`--lora-load-ms` on the first token of the request that loaded it.
"""

from __future__ import annotations

import json
import os
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Set

from gmock_engine.core.request import Request, RequestStatus
from gmock_engine.wire.outputs import request_error
from gmock_engine.wire.types import BadValue

#: LoRARequest fields in msgspec array order (vllm/lora/request.py, 0.32/0.33:
#: array_like=True, omit_defaults=True, so trailing defaults are absent).
LORA_REQUEST_FIELDS = ("lora_name", "lora_int_id", "lora_path", "base_model_name", "load_inplace", "is_3d_lora_weight")
#: PEFTHelper's required adapter_config.json keys (vllm/lora/peft_helper.py).
_PEFT_REQUIRED = ("r", "lora_alpha", "target_modules")
_INT64_MAX = (1 << 63) - 1


class LoRAError(Exception):
    """An adapter that cannot be loaded, activated or pinned; the message is
    the one vLLM raises in the same case."""


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's LoRARequest as it arrives in an ADD (index 6, docs/protocol.md §3.2)
    or as the argument of `add_lora` (§5)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: Optional[str] = None
    load_inplace: bool = False
    is_3d_lora_weight: bool = False


def decode_lora_request(value: Any) -> Optional[LoRARequest]:
    """A LoRARequest from the wire: nil, the msgspec array both frontends
    send, or a map with the field names (lenient). BadValue for anything
    else, with vLLM's own `__post_init__` checks (id > 0, a path)."""
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        if len(value) < 2:
            raise BadValue(f"lora_request has {len(value)} elements, not at least lora_name and lora_int_id")
        # fields a later vLLM appends are ignored, as decode_add does (§3.2)
        fields = dict(zip(LORA_REQUEST_FIELDS, value))
    elif isinstance(value, dict):
        unknown = [k for k in value if k not in LORA_REQUEST_FIELDS]
        if unknown:
            raise BadValue(f"lora_request has unknown key {_cut(unknown[0])}")
        fields = dict(value)
    else:
        raise BadValue(f"lora_request is {type(value).__name__}, not a LoRARequest array, map or nil")
    name, lora_id, path = fields.get("lora_name"), fields.get("lora_int_id"), fields.get("lora_path", "")
    if not isinstance(name, str) or not name:
        raise BadValue(f"lora_request lora_name {_cut(name)} is not a non-empty string")
    if isinstance(lora_id, bool) or not isinstance(lora_id, int) or lora_id > _INT64_MAX:
        raise BadValue(f"lora_request lora_int_id {_cut(lora_id)} is not an int")
    if lora_id < 1:
        raise BadValue(f"lora_request: id must be > 0, got {lora_id}")  # LoRARequest.__post_init__
    if not isinstance(path, str) or not path:
        raise BadValue("lora_request: lora_path cannot be empty")
    base = fields.get("base_model_name")
    if base is not None and not isinstance(base, str):
        raise BadValue(f"lora_request base_model_name {_cut(base)} is not a string or nil")
    for key in ("load_inplace", "is_3d_lora_weight"):
        if not isinstance(fields.get(key, False), bool):
            raise BadValue(f"lora_request {key} {_cut(fields[key])} is not a bool")
    return LoRARequest(name, lora_id, path, base, fields.get("load_inplace", False), fields.get("is_3d_lora_weight", False))


def not_found_message(request: LoRARequest) -> str:
    """vllm/exceptions.py LoRAAdapterNotFoundError: the frontends match this
    text to answer 404 instead of 500."""
    return f"Loading lora {request.lora_name} failed: No adapter found for {request.lora_path}"


def check_adapter_dir(request: LoRARequest, max_lora_rank: int) -> None:
    """What vLLM's worker reads before loading weights (PEFTHelper.from_local_dir
    and validate_legal): `<path>/adapter_config.json`, a JSON object checked
    by `check_adapter_config`. The weights file is not read (the mock has no
    weights)."""
    config_path = os.path.join(request.lora_path, "adapter_config.json")
    try:
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    except FileNotFoundError:
        raise LoRAError(not_found_message(request)) from None
    except (OSError, ValueError) as exc:
        raise LoRAError(f"Loading lora {request.lora_name} failed: {config_path}: {type(exc).__name__}: {str(exc):.200}") from None
    if not isinstance(config, dict):
        raise LoRAError(f"Loading lora {request.lora_name} failed: {config_path} is not a JSON object")
    check_adapter_config(config, max_lora_rank)


def check_adapter_config(config: Dict[str, Any], max_lora_rank: int) -> None:
    """PEFTHelper.from_dict, __post_init__ and validate_legal on a parsed
    adapter_config.json, with vLLM's messages. PEFTHelper is a dataclass
    that does not enforce its annotations (a `target_modules` of 5 loads, a
    string `lora_alpha` fails later with a TypeError); the mock checks the
    annotated types first, so a malformed config fails here, by name."""
    missing = {k for k in _PEFT_REQUIRED if k not in config}
    if missing:
        raise LoRAError(f"Missing required configuration fields: {missing}")
    r = config["r"]
    if not _is_int(r) or r <= 0:
        raise LoRAError(f"LoRA rank `r` must be a positive integer, got {_cut(r)}.")
    for key, (what, ok) in _PEFT_TYPES.items():
        if key in config and not ok(config[key]):
            raise LoRAError(f"LoRA adapter_config.json `{key}` must be {what}, got {_cut(config[key])}.")
    rank_pattern = config.get("rank_pattern") or {}
    for key, rank in rank_pattern.items():
        if not _is_int(rank) or rank <= 0:
            raise LoRAError(f"LoRA rank for `{key}` in `rank_pattern` must be a positive integer, got {_cut(rank)}.")
    errors = _unsupported_features(config)
    max_rank = max([r, *rank_pattern.values()])
    if max_rank > max_lora_rank:
        errors.append(f"LoRA rank {max_rank} is greater than max_lora_rank {max_lora_rank}.")
    if config.get("bias", "none") != "none":
        errors.append("Adapter bias is not supported.")
    if errors:
        raise LoRAError(" ".join(errors))


def _unsupported_features(config: Dict[str, Any]) -> List[str]:
    # PEFTHelper._validate_features, in its order and words
    errors = []
    unsupported = [m for m in config.get("modules_to_save") or () if m not in ("classifier", "score")]
    if unsupported:
        errors.append(
            "vLLM only supports modules_to_save being either None "
            'or ["classifier", "score"] for classification models. '
            f"Unsupported modules_to_save: {unsupported}"
        )
    if config.get("use_dora"):
        errors.append("vLLM does not yet support DoRA.")
    if config.get("lora_bias"):
        errors.append("vLLM does not support LoRA bias (lora_bias).")
    init = config.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower() not in _PLAIN_INITS:
        errors.append(
            f"vLLM does not support init_lora_weights={init!r}."
            " Inits such as PiSSA, OLoRA, CorDA and LoftQ modify the base model"
            " weights when PEFT loads the adapter. Convert it to a regular LoRA"
            " adapter with PEFT's path_initial_model_for_weight_conversion, or"
            " set init_lora_weights to true if the served base model already"
            " contains the modified weights."
        )
    for key, message in _UNSUPPORTED.items():
        if config.get(key):
            errors.append(message)
    return errors


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _list_of(value: Any, ok: Any) -> bool:
    return isinstance(value, list) and all(ok(v) for v in value)


def _strings(value: Any) -> bool:
    return _list_of(value, lambda v: isinstance(v, str))


#: PEFTHelper's annotated field types (vllm/lora/peft_helper.py); null is
#: accepted where the field has a default, as PEFT writes null for unset ones.
#: `r` and `bias` are checked with vLLM's own messages instead.
_PEFT_TYPES = {
    "lora_alpha": ("a number", _is_number),
    "target_modules": ("a list of strings or a string", lambda v: isinstance(v, str) or _strings(v)),
    "modules_to_save": ("a list of strings or null", lambda v: v is None or _strings(v)),
    "use_rslora": ("a bool", lambda v: v is None or isinstance(v, bool)),
    "use_dora": ("a bool", lambda v: v is None or isinstance(v, bool)),
    "lora_bias": ("a bool", lambda v: v is None or isinstance(v, bool)),
    "use_qalora": ("a bool", lambda v: v is None or isinstance(v, bool)),
    "init_lora_weights": ("a bool or a string", lambda v: v is None or isinstance(v, (bool, str))),
    "rank_pattern": ("an object", lambda v: v is None or isinstance(v, dict)),
    "alpha_pattern": (
        "an object of numbers",
        lambda v: v is None or (isinstance(v, dict) and all(_is_number(a) for a in v.values())),
    ),
    "alora_invocation_tokens": ("a list of ints or null", lambda v: v is None or _list_of(v, _is_int)),
    "layer_replication": (
        "a list of [start, end] lists or null",
        lambda v: v is None or _list_of(v, lambda p: isinstance(p, list)),
    ),
    "use_bdlora": ("an object or null", lambda v: v is None or isinstance(v, dict)),
}
#: init_lora_weights values that only set the initial weights (PEFTHelper._init_is_supported)
_PLAIN_INITS = ("gaussian", "eva", "orthogonal", "mica", "lora_ga")
_UNSUPPORTED = {
    "alora_invocation_tokens": "vLLM does not support Activated LoRA (aLoRA).",
    "layer_replication": "vLLM does not support layer_replication.",
    "use_bdlora": "vLLM does not support block-diagonal LoRA (BD-LoRA).",
    "use_qalora": "vLLM does not support QALoRA.",
}


class _PinnedLRU:
    """vllm/utils/cache.py LRUCache reduced to keys: an order (oldest first),
    a capacity and pinned keys that `remove_oldest` skips."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.order: "OrderedDict[int, None]" = OrderedDict()
        self.pinned: Set[int] = set()

    def __contains__(self, key: object) -> bool:
        return key in self.order

    def __len__(self) -> int:
        return len(self.order)

    def touch(self, key: int) -> None:
        if key in self.order:
            self.order.move_to_end(key)

    def put(self, key: int) -> None:
        self.order[key] = None
        self.order.move_to_end(key)

    def pop(self, key: int) -> bool:
        # deleting a pinned key unpins it (LRUCache.__delitem__)
        self.pinned.discard(key)
        return self.order.pop(key, 0) is None

    def oldest_unpinned(self) -> int:
        for key in self.order:
            if key not in self.pinned:
                return key
        raise LoRAError("All items are pinned, cannot remove oldest from the cache.")


class AdapterRegistry:
    """One engine's adapters: registered (CPU cache, `max_cpu_loras`) and
    active (GPU slots, `max_loras`), each LRU with pins, as vLLM's
    LRUCacheWorkerLoRAManager over LRUCacheLoRAModelManager.

    `add` is `add_lora` and also what scheduling a request does (vLLM's
    model runner calls the same add_adapter for each adapter in the batch);
    it returns True, as vLLM's does on success, and raises LoRAError with
    vLLM's message otherwise. `loads` counts adapter loads (not touches).
    """

    def __init__(self, max_loras: int, max_cpu_loras: int, max_lora_rank: int = 16, check_adapter_dir: bool = True) -> None:
        if not 1 <= max_loras <= max_cpu_loras:
            raise ValueError(f"max_cpu_loras ({max_cpu_loras}) must be >= max_loras ({max_loras}) >= 1")
        self.max_loras = max_loras
        self.max_cpu_loras = max_cpu_loras
        self.max_lora_rank = max_lora_rank
        self.check_adapter_dir = check_adapter_dir
        self.cpu = _PinnedLRU(max_cpu_loras)
        self.gpu = _PinnedLRU(max_loras)
        #: lora_int_id -> the request it was registered with (name, path)
        self.adapters: Dict[int, LoRARequest] = {}
        self.loads = 0

    def add(self, request: LoRARequest) -> bool:
        """Register (load) and activate `request`'s adapter: LRUCacheWorkerLoRAManager.add_adapter."""
        lora_id = request.lora_int_id
        if lora_id not in self.cpu or request.load_inplace:
            # load first, so a bad adapter evicts nothing (worker_manager.py)
            if self.check_adapter_dir:
                check_adapter_dir(request, self.max_lora_rank)
            self.remove(lora_id)
            if len(self.cpu) + 1 > self.cpu.capacity:
                self._remove(self.cpu.oldest_unpinned())
            self.cpu.put(lora_id)
            self.adapters[lora_id] = request
            self.loads += 1
        else:
            self.cpu.touch(lora_id)
        self.activate(lora_id)
        return True

    def activate(self, lora_id: int) -> bool:
        """Into a GPU slot, evicting the oldest unpinned active one when all
        are taken (LRUCacheLoRAModelManager.activate_adapter); True if it was
        not active."""
        newly = lora_id not in self.gpu
        if newly and len(self.gpu) >= self.gpu.capacity:
            self.gpu.pop(self.gpu.oldest_unpinned())
        self.gpu.put(lora_id)
        return newly

    def remove(self, lora_id: int) -> bool:
        """remove_lora: out of both caches; False if it was not registered."""
        self.gpu.pop(lora_id)
        if lora_id not in self.cpu:
            return False
        self._remove(lora_id)
        return True

    def _remove(self, lora_id: int) -> None:
        # evicted from the CPU cache means deactivated too (AdapterLRUCache._on_remove)
        self.cpu.pop(lora_id)
        self.gpu.pop(lora_id)
        self.adapters.pop(lora_id, None)

    def pin(self, lora_id: int) -> bool:
        """pin_lora: pinned in the CPU cache and, activated first, in a GPU slot."""
        if lora_id not in self.cpu:
            raise LoRAError(f"Pinning failed. LoRA {lora_id} is not registered.")
        self.cpu.pinned.add(lora_id)
        self.activate(lora_id)
        self.gpu.pinned.add(lora_id)
        return True

    def list(self) -> List[int]:
        """list_loras: the registered ids (vLLM returns a set; msgpack sends an array)."""
        return sorted(self.cpu.order)

    def snapshot(self) -> Dict[str, Any]:
        """What is registered, active and pinned (gmock_stats, logs)."""
        return {
            "registered": list(self.cpu.order),
            "active": list(self.gpu.order),
            "pinned": sorted(self.cpu.pinned),
            "loads": self.loads,
        }


def _cut(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


class LoRAScheduling:
    """The scheduler's LoRA slots: which adapters the running batch holds,
    a request whose adapter cannot be loaded ended alone, and the requests
    per adapter SchedulerStats show. A part of `Scheduler`
    (core/scheduler.py), whose state it reads."""

    def _running_lora_ids(self) -> "set[int]":
        return {r.lora_request.lora_int_id for r in self.running.values() if r.lora_request is not None}

    def _reject_lora(self, request: Request, message: str, rejected: List[Any]) -> None:
        """An adapter that cannot be loaded or activated: where vLLM's worker
        raises (and its engine dies), this request ends with ERROR and
        vLLM's message; the engine goes on."""
        request.status = RequestStatus.FINISHED_ERROR
        rejected.append((request, request_error("lora_load_failed", message)))
        self._on_reject(request)

    def lora_adapters(self) -> "tuple[Dict[str, int], Dict[str, int]]":
        """SchedulerStats waiting_lora_adapters / running_lora_adapters:
        requests per adapter name (§7.1; vLLM's LoRARequestStates)."""
        waiting: Counter = Counter()
        running: Counter = Counter()
        if self.lora is not None:
            for request in self.running.values():
                if request.lora_request is not None:
                    running[request.lora_request.lora_name] += 1
            for request in self.waiting.requests():
                if request.lora_request is not None:
                    waiting[request.lora_request.lora_name] += 1
        return dict(waiting), dict(running)
