"""An ADD's `mm_features` (§3.2 index 2), read for wire/inputs.py.

Every era from 0.11 sends a list of `MultiModalFeatureSpec` maps (msgspec
encodes the dataclass by field name): `data` (a `MultiModalKwargsItem`: key
-> {"data": nested tensors, "field": [factory, kwargs]}; nil when the
frontend's processor cache holds the item and strips it), `modality`,
`identifier` (the encoder cache's key, with a LoRA prefix), `mm_position` (a
`PlaceholderRange` map: offset, length, is_embed) and, in newer eras, `mm_hash`
(the processor cache's key). A tensor is `[dtype, shape, data]` as vLLM's
`MsgpackEncoder` writes it (vllm/v1/serial_utils.py): `data` is msgpack ext 3
(raw bytes inline, under VLLM_MSGPACK_ZERO_COPY_THRESHOLD, 256 bytes) or the
index of a frame of the message counted from the payload (its aux_buffers:
1 is the frame after the payload). An ndarray's dtype is
numpy's (`<f4`), a torch tensor's torch's (`bfloat16`).

The engine keeps no pixels: it checks every tensor's size against its dtype
and shape and keeps what a real engine's scheduler reads: the placeholder
range, how many of its positions the encoder fills (is_embed's true count),
the keys and the item's size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

import msgpack

from gmock_engine.wire.types import BadValue

#: msgpack ext type of vLLM's inline raw tensor bytes (CUSTOM_TYPE_RAW_VIEW).
RAW_VIEW_EXT = 3
#: Bytes per element of torch's dtype names (numpy's carry it in their last digits: "<f4").
TORCH_ITEMSIZE = {
    "bool": 1, "uint8": 1, "int8": 1, "int16": 2, "uint16": 2, "int32": 4, "uint32": 4, "int64": 8, "uint64": 8,
    "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "complex64": 8, "complex128": 16,
}  # fmt: skip
#: The most items one ADD may carry (a frontend applies --limit-mm-per-prompt first).
MAX_MM_ITEMS = 4096
#: The deepest nesting of tensor lists accepted (vLLM's NestedTensors: a few levels).
MAX_NESTING = 8
MAX_KEY_CHARS = 1024


@dataclass(frozen=True)
class MultiModalFeature:
    """One multimodal item of a request, as the engine's caches and
    scheduler see it (vLLM's MultiModalFeatureSpec without its tensors)."""

    modality: str
    #: The encoder cache's key (mm_hash with a LoRA prefix, if any).
    identifier: str
    #: The processor cache's key; nil or absent in older eras (then `identifier` is the key).
    mm_hash: Optional[str]
    #: The item's placeholder tokens in the prompt: [offset, offset + length).
    offset: int
    length: int
    #: Positions of the range the encoder's output fills (is_embed's true
    #: count; the whole range when is_embed is nil): the encoder's tokens.
    num_embeds: int
    #: The bytes of the item's tensors; None when the frontend stripped its data (cached).
    data_bytes: Optional[int]

    @property
    def cache_key(self) -> str:
        """The receiver cache's key: mm_hash, else identifier (vLLM's get_and_update_features)."""
        return self.mm_hash or self.identifier


def _cut(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _itemsize(dtype: Any, where: str) -> int:
    if type(dtype) is not str:
        raise BadValue(f"{where}: dtype {_cut(dtype)} is not a string")
    size = TORCH_ITEMSIZE.get(dtype)
    if size is None and len(dtype) >= 3 and dtype[0] in "<>|=" and dtype[2:].isdigit() and dtype[1] in "biufcV":
        size = int(dtype[2:])  # numpy's dtype.str: byte order, kind, item size
    if not size:
        raise BadValue(f"{where}: dtype {_cut(dtype)} is not a tensor type the frontend sends")
    return size


def _buffer(data: Any, aux: Sequence[bytes], where: str) -> Any:
    if type(data) is int:
        if not 1 <= data < len(aux):  # aux[0] is the payload itself
            raise BadValue(f"{where}: names buffer {data}, but the message has buffers 1..{len(aux) - 1} after its payload")
        return aux[data]
    if isinstance(data, msgpack.ExtType) and data.code == RAW_VIEW_EXT:
        return data.data
    if type(data) is dict:
        raise BadValue(f"{where}: an out-of-band tensor (a GPU IPC handle) cannot reach an engine on another host")
    raise BadValue(f"{where}: tensor data {_cut(data)} is neither inline bytes (ext 3) nor an extra frame's index")


def _tensor(value: List[Any], aux: Sequence[bytes], where: str) -> Tuple[str, List[int], Any]:
    """A checked `[dtype, shape, data]` -> (dtype, shape, its buffer)."""
    if len(value) != 3:
        raise BadValue(f"{where}: a tensor is [dtype, shape, data], not {len(value)} elements")
    dtype, shape, data = value
    size = _itemsize(dtype, where)
    if type(shape) is not list or not all(type(n) is int and n >= 0 for n in shape):
        raise BadValue(f"{where}: shape {_cut(shape)} is not a list of non-negative ints")
    buffer = _buffer(data, aux, where)
    count = 1
    for n in shape:
        count *= n
    if count * size != len(buffer):
        raise BadValue(f"{where}: a {dtype} tensor of shape {shape} is {count * size} bytes, but its data has {len(buffer)}")
    return dtype, shape, buffer


def _nested_bytes(value: Any, aux: Sequence[bytes], where: str, depth: int = 0) -> int:
    """The bytes of NestedTensors: a tensor, a number, or a list of them."""
    if type(value) in (int, float):
        return 0
    if type(value) is not list:
        raise BadValue(f"{where}: {type(value).__name__} is not a tensor, a number or a list of them")
    if value and type(value[0]) is str:
        return len(_tensor(value, aux, where)[2])
    if depth >= MAX_NESTING:
        raise BadValue(f"{where}: tensors nested deeper than {MAX_NESTING} lists")
    return sum(_nested_bytes(item, aux, where, depth + 1) for item in value)


def _item_bytes(data: Any, aux: Sequence[bytes], where: str) -> int:
    """A MultiModalKwargsItem map: key -> {"data": nested tensors or nil, "field": ...}."""
    if type(data) is not dict:
        raise BadValue(f"{where}.data is {type(data).__name__}, not a map or nil")
    total = 0
    for key, elem in data.items():
        at = f"{where}.data[{_cut(key, 40)}]"
        if type(elem) is not dict or "data" not in elem:
            raise BadValue(f"{at} is not a {{data, field}} map")
        if elem["data"] is not None:
            total += _nested_bytes(elem["data"], aux, at)
    return total


def _key(feature: dict, name: str, where: str, required: bool = True) -> Optional[str]:
    value = feature.get(name)
    if value is None and not required:
        return None
    if type(value) is not str or not value or len(value) > MAX_KEY_CHARS:
        raise BadValue(f"{where}.{name} {_cut(value)} is not a non-empty string of at most {MAX_KEY_CHARS} characters")
    return value


def _feature(feature: Any, aux: Sequence[bytes], prompt_len: int, where: str) -> MultiModalFeature:
    if type(feature) is not dict:
        raise BadValue(f"{where} is {type(feature).__name__}, not a MultiModalFeatureSpec map")
    position = feature.get("mm_position")
    if type(position) is not dict:
        raise BadValue(f"{where}.mm_position is {type(position).__name__}, not a PlaceholderRange map")
    offset, length = position.get("offset"), position.get("length")
    if type(offset) is not int or type(length) is not int or offset < 0 or length < 1 or offset + length > prompt_len:
        raise BadValue(f"{where}.mm_position offset {_cut(offset)} length {_cut(length)} is not a range of the "
                       f"prompt's {prompt_len} tokens")  # fmt: skip
    num_embeds = length
    is_embed = position.get("is_embed")
    if is_embed is not None:
        if type(is_embed) is not list or not is_embed or type(is_embed[0]) is not str:
            raise BadValue(f"{where}.mm_position.is_embed is not a tensor or nil")
        dtype, shape, buffer = _tensor(is_embed, aux, f"{where}.mm_position.is_embed")
        if _itemsize(dtype, where) != 1 or shape != [length]:
            raise BadValue(f"{where}.mm_position.is_embed is a {dtype} tensor of shape {shape}, not bool of [{length}]")
        num_embeds = length - bytes(buffer).count(0)
    data = feature.get("data")
    return MultiModalFeature(
        modality=_key(feature, "modality", where),
        identifier=_key(feature, "identifier", where),
        mm_hash=_key(feature, "mm_hash", where, required=False),
        offset=offset,
        length=length,
        num_embeds=num_embeds,
        data_bytes=None if data is None else _item_bytes(data, aux, where),
    )


def decode_mm_features(value: Any, aux: Sequence[bytes], prompt_len: int) -> Tuple[MultiModalFeature, ...]:
    """An ADD's mm_features -> its items, in prompt order; BadValue naming
    the item and the key for anything the frontends never send."""
    if value is None:
        return ()
    if type(value) is not list:
        raise BadValue(f"mm_features is {type(value).__name__}, not a list of MultiModalFeatureSpec or nil")
    if len(value) > MAX_MM_ITEMS:
        raise BadValue(f"mm_features has {len(value)} items, more than the {MAX_MM_ITEMS} one request may carry")
    return tuple(_feature(feature, aux, prompt_len, f"mm_features[{index}]") for index, feature in enumerate(value))
