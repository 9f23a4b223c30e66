"""Multimodal ADDs: mm_features decoded from ADDs captured from vllm serve
(tests/data/mm_adds.json), the engine's receiver cache (a stripped repeat
image served from it, a miss an ERROR for that request only), the encoder
cache and its cost, and the prefix cache's block keys (docs/multimodal.md)."""

import base64
import copy
import json
from pathlib import Path

import msgpack
import pytest

from gmock_engine.core import prefix_cache
from gmock_engine.timing.latency import LatencyModel
from gmock_engine.core.mm_cache import EncoderCache, ReceiverCache
from gmock_engine.wire.eras import WIRE_LAYOUTS, Wire
from gmock_engine.wire.inputs import EngineCoreRequest, InvalidRequest, UtilityCall, decode_input
from gmock_engine.wire.mm_features import MultiModalFeature
from gmock_engine.wire.types import FinishReason
from engine_steps import TickClock, engine_with, outputs_of, run

DATA = json.loads((Path(__file__).parent.parent / "data" / "mm_adds.json").read_text())
#: The ADDs' images as the frontend computed them: 333x217 -> 13 tiles of 169
#: image tokens (2228 placeholder tokens with the markup), 1000x300 -> 9 tiles.
FIRST = "ade30d0158c929bf63c199d99a1c3d6a03b48fba44edeb9ba9833ce8876d4adf"
SECOND = "6a05b8ec1068a6266a85bb7788207c33d204a6da1b97d9bb5b290e6c510a9ded"


def frames(index):
    """The captured message: type, payload, then the aux frames (the pixel
    tensors, stored as their length, are zeros of that length)."""
    add = DATA["adds"][index]
    aux = [bytes(x) if isinstance(x, int) else base64.b64decode(x) for x in add["aux"]]
    return [bytes.fromhex(add["type"]), base64.b64decode(add["payload"]), *aux]


def decoded(index, wire=None):
    return decode_input(frames(index), wire or Wire())


def with_payload(index, change):
    """The captured message with its payload changed by `change(payload array)`."""
    parts = frames(index)
    payload = msgpack.unpackb(parts[1], raw=False, strict_map_key=False)
    change(payload)
    parts[1] = msgpack.packb(payload, use_bin_type=True)
    return parts


def test_captured_adds_decode_with_their_placeholders():
    one = decoded(0)
    assert isinstance(one, EngineCoreRequest) and one.prompt_len == 2252
    (image,) = one.mm_features
    assert (image.modality, image.identifier, image.mm_hash) == ("image", FIRST, FIRST)
    assert (image.offset, image.length) == (15, 2228)
    assert image.num_embeds == 13 * 169  # is_embed (an aux frame): the <image> positions, not the markup
    assert image.data_bytes == 13 * 364 * 364 * 8 + 13 * 3 * 364 * 364 * 2 + 8  # mask int64, pixels bf16, num_patches
    # the placeholders are prompt tokens already: the prompt holds them
    assert image.offset + image.length <= one.prompt_len
    two = decoded(1)
    assert [f.identifier for f in two.mm_features] == [FIRST, SECOND]
    assert two.mm_features[0].data_bytes is None  # the repeat: stripped by the frontend's processor cache
    assert two.mm_features[1].data_bytes == image.data_bytes and two.mm_features[1].offset == 2243
    wide = decoded(2)
    assert wide.mm_features[0].num_embeds == 9 * 169 and wide.mm_features[0].length == 1543


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda p: p[2][0]["mm_position"].update(offset=2000), "not a range of the prompt's 2252 tokens"),
        (lambda p: p[2][0]["data"]["pixel_values"]["data"].__setitem__(2, 9), "names buffer 9"),
        (lambda p: p[2][0]["data"]["pixel_values"]["data"].__setitem__(1, [13, 3, 364, 365]), "but its data has"),
        (lambda p: p[2][0]["data"]["pixel_values"]["data"].__setitem__(0, "float128x"), "not a tensor type"),
        (lambda p: p[2][0]["data"]["pixel_values"]["data"].__setitem__(2, {"handle": 1}), "out-of-band"),
        (lambda p: p[2][0].update(identifier=""), "identifier"),
        (lambda p: p[2][0].update(modality=7), "modality"),
        (lambda p: p.__setitem__(2, "image"), "not a list of MultiModalFeatureSpec"),
        (lambda p: p.__setitem__(2, [copy.deepcopy(p[2][0]) for _ in range(5000)]), "more than the 4096"),
        (lambda p: p[2][0]["mm_position"].update(is_embed=["bool", [3], p[2][0]["mm_position"]["is_embed"][2]]), "is_embed"),
    ],
)
def test_hostile_features_are_an_error_for_that_request(change, match):
    message = decode_input(with_payload(0, change), Wire())
    assert isinstance(message, InvalidRequest) and match in message.reason
    assert message.request_id.startswith("chatcmpl-")


def test_engine_serves_a_stripped_repeat_from_its_cache_and_a_miss_is_an_error():
    engine = engine_with(TickClock())
    assert engine.apply(decoded(0)) == []  # the image comes with its data: cached
    assert engine.apply(decoded(1)) == []  # its repeat comes stripped: served from the cache
    sent = run(engine)
    assert outputs_of(sent, decoded(1).request_id)[-1][5] == FinishReason.LENGTH
    assert set(engine.mm_cache.items) == {FIRST, SECOND} and engine.mm_cache.hits == 1
    # reset_mm_cache (the frontend clears its own at the same call): the next stripped repeat misses
    engine.apply(UtilityCall(0, 1, "reset_mm_cache", []))
    again = decoded(1)
    again.request_id = "again"
    answer = engine.apply(again)
    (output,) = [o for _, m in answer for o in m[1]]
    layout = engine.layout
    assert output[5] == FinishReason.ERROR and output[0] == "again"
    assert output[layout.output_index["mm_cache_miss_hashes"]] == [FIRST]
    assert output[layout.output_index["error"]]["code"] == "multimodal_cache_miss"
    # that request only: the engine goes on serving, and the data it sent now is cached
    assert SECOND in engine.mm_cache.items
    engine.apply(decoded(2))
    assert outputs_of(run(engine), decoded(2).request_id)[-1][5] == FinishReason.LENGTH


def test_a_miss_in_an_era_without_the_field_is_a_plain_error():
    engine = engine_with(TickClock(), wire=Wire(WIRE_LAYOUTS["0.20.1"]))
    stripped = decoded(1, Wire(WIRE_LAYOUTS["0.33"]))
    answer = engine.apply(stripped)
    (output,) = [o for _, m in answer for o in m[1]]
    assert output[5] == WIRE_LAYOUTS["0.20.1"].wire_finish_reason(FinishReason.ERROR)
    assert len(output) <= len(WIRE_LAYOUTS["0.20.1"].output_fields)


def feature(identifier, offset=0, length=10, num_embeds=8, data=100, mm_hash=None):
    return MultiModalFeature("image", identifier, mm_hash, offset, length, num_embeds, data)


def test_receiver_cache_is_an_lru_of_bytes_that_keeps_a_requests_items():
    cache = ReceiverCache(250)
    assert cache.receive([feature("a"), feature("b")]) == []
    assert cache.receive([feature("a", data=None), feature("c")]) == []  # a touched first: b is evicted, not a
    assert set(cache.items) == {"a", "c"} and cache.size == 200
    assert cache.receive([feature("b", data=None), feature("b", data=None)]) == ["b"]
    assert cache.receive([feature("x", data=1000)]) == [] and "x" not in cache.items  # larger than the cache
    # mm_hash is the key when given (LoRA-prefixed identifiers share it)
    assert cache.receive([feature("lora1:h", mm_hash="h")]) == []
    assert cache.receive([feature("lora2:h", mm_hash="h", data=None)]) == []


def test_encoder_cache_charges_each_image_once_until_reset():
    cache = EncoderCache(20)
    assert cache.encode([feature("a"), feature("b")]) == 16
    assert cache.cost([feature("a"), feature("c")]) == 8
    assert cache.encode([feature("a")]) == 0
    assert cache.encode([feature("c"), feature("d")]) == 16  # a and b evicted (20 tokens)
    assert cache.encode([feature("a")]) == 8
    cache.clear()
    assert cache.encode([feature("d")]) == 8


def test_encoder_time_delays_the_first_token_and_the_step():
    latency = LatencyModel(encoder_ms_per_token=1.0)
    assert latency.paced and latency.encoder_seconds(2197) == pytest.approx(2.197)
    clock = TickClock()
    engine = engine_with(clock, latency=latency)
    engine.apply(decoded(0))
    engine.apply(decoded(2))
    engine.step()
    assert engine.scheduler._encoder_tokens == 13 * 169 + 9 * 169
    assert engine.scheduler.step_delay == pytest.approx((13 + 9) * 169 / 1000.0)


def test_encoder_budget_holds_a_request_to_the_next_step():
    engine = engine_with(TickClock(), encoder_cache_tokens=3000)
    engine.apply(decoded(0))
    engine.apply(decoded(2))
    engine.step()
    assert engine.scheduler._encoder_tokens == 13 * 169 and len(engine.scheduler.running) == 1


def hashes(features, tokens):
    return prefix_cache.mm_block_hashes(tokens, 16, 0, features)


def test_prefix_blocks_include_the_images_identifiers():
    tokens = list(range(100))
    image = [feature("img-a", offset=40, length=30)]
    other = [feature("img-b", offset=40, length=30)]
    plain = prefix_cache.block_hashes(tokens, 16)
    a, b = hashes(image, tokens)[0], hashes(other, tokens)[0]
    assert a[:2] == b[:2] == plain[:2]  # blocks 0-1 (tokens 0..31) hold no placeholder
    assert all(x != y for x, y in zip(a[2:], b[2:]))  # from the block holding token 40 on, they differ
    assert hashes(image, tokens)[0] == a  # the same image: the same blocks


def test_block_stored_events_carry_the_images_extra_keys():
    engine = engine_with(TickClock(), prefix_caching=True, kv_events=True)
    engine.apply(decoded(0))  # the image's placeholders: tokens 15..2242 of 2252
    run(engine)
    stored = [e for e in engine.kv.take_events() if e[0] == prefix_cache.STORED]
    keys = [k for e in stored for k in e[6]]
    hashes = [h for e in stored for h in e[1]]
    assert len(keys) == len(hashes) == 141  # 2252 prompt and 7 generated tokens
    assert keys[0] == ((FIRST, 15),) and keys[1] == ((FIRST, -1),)  # offsets from each block's start, as vLLM's
    assert keys[140] == ((FIRST, 15 - 140 * 16),)  # the image's last token, 2242, is in block 140
    from gmock_engine.kv.events import EventFormat, encode_events

    (event,) = encode_events(stored[:1], 16, EventFormat())
    assert event["extra_keys"][:2] == [[[FIRST, 15]], [[FIRST, -1]]]


@pytest.mark.parametrize("chunk", [1, 40])  # a block at a time; three blocks in one step (the general path)
def test_an_image_in_the_prompts_last_partial_block_keys_it_when_generated_tokens_fill_it(chunk):
    def last_block_hash(identifier):
        engine = engine_with(TickClock(), prefix_caching=True, kv_events=True, output_token_chunk_size=chunk)
        image = feature(identifier, offset=36, length=4, num_embeds=4)  # tokens 36..39 of 40: in block 2, not full yet
        engine.apply(EngineCoreRequest("r", prompt_len=40, max_tokens=44, has_sampling_params=True,
                                       prompt_token_ids=list(range(40)), allowed_token_ids=(5,), mm_features=(image,)))  # fmt: skip
        run(engine)
        stored = [e for e in engine.kv.take_events() if e[0] == prefix_cache.STORED]
        hashes = [h for e in stored for h in e[1]]
        keys = [k for e in stored for k in (e[6] if len(e) > 6 else [None] * len(e[1]))]
        assert len(hashes) == 5 and keys == [None, None, ((identifier, 4),), None, None]
        return hashes

    a, b = last_block_hash("img-a"), last_block_hash("img-b")
    assert a[:2] == b[:2] and a[2] != b[2]
