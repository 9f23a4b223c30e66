"""The engine's CPU per request with and without images, in-process.

Each request's whole life without sockets: its ADD decoded
(`wire.inputs.decode_input`, tensors in aux frames included), applied,
stepped to its end and every output packed. The ADDs are the ones captured
from vllm serve (tests/data/mm_adds.json: one image of 13 tiles, 24 MB of
pixels in two aux frames) with a fresh request id each, against the same
ADD with `mm_features` nil (the same prompt of 2 252 tokens, text only).
The first ADD sends its image's data; the others alternate between a
repeat (stripped, served from the receiver cache) and new data, as
`--mode` says.

    .venv/bin/python benchmarks/multimodal.py                      # 2000 requests each, 16 tokens
    .venv/bin/python benchmarks/multimodal.py --prefix-caching     # with prefix caching (image-keyed blocks)

Prints CPU µs per request for each kind (best of `--repeats`).
"""

from __future__ import annotations

import argparse
import base64
import json
import sys
import time
from pathlib import Path
from typing import List

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import msgpack  # noqa: E402

from gmock_engine.core.engine import EngineCore, EngineSettings  # noqa: E402
from gmock_engine.wire.eras import Wire  # noqa: E402
from gmock_engine.wire.inputs import decode_input  # noqa: E402
from gmock_engine.wire.outputs import pack  # noqa: E402

DATA = Path(__file__).resolve().parent.parent / "tests" / "data" / "mm_adds.json"


def captured(index: int) -> List[bytes]:
    add = json.loads(DATA.read_text())["adds"][index]
    aux = [bytes(x) if isinstance(x, int) else base64.b64decode(x) for x in add["aux"]]
    return [bytes.fromhex(add["type"]), base64.b64decode(add["payload"]), *aux]


def variants(frames: List[bytes], count: int, max_tokens: int, text_only: bool, stripped: bool) -> List[List[bytes]]:
    """`count` copies of the ADD, each with its own request id (and image identifier unless stripped)."""
    payload = msgpack.unpackb(frames[1], raw=False, strict_map_key=False)
    payload[3]["max_tokens"] = max_tokens
    mask_frame = frames[1 + payload[2][0]["mm_position"]["is_embed"][2]]  # aux index i is frame 1 + i
    if stripped:
        # the repeat of the image the first request sent: only its is_embed mask comes, in the one aux frame
        payload[2][0]["data"] = None
        payload[2][0]["mm_position"]["is_embed"][2] = 1
    out = []
    for i in range(count):
        payload[0] = f"req-{i}"
        if text_only:
            payload[2] = None
        elif not stripped:
            payload[2][0]["identifier"] = payload[2][0]["mm_hash"] = f"{i:064x}"
        body = msgpack.packb(payload, use_bin_type=True)
        aux = [] if text_only else [mask_frame] if stripped else frames[2:]
        out.append([frames[0], body, *aux])
    return out


def run(messages: List[List[bytes]], prefix_caching: bool, warm: List[bytes]) -> float:
    """CPU seconds per request: decode, apply, step to the end, pack."""
    engine = EngineCore(EngineSettings(rank=0, num_clients=1, prefix_caching=prefix_caching, max_model_len=1 << 20))
    wire = Wire()
    engine.apply(decode_input(warm, wire))  # the image the stripped repeats name, and the era settled
    while engine.has_work:
        for _, message in engine.step():
            pack(message)
    started = time.process_time()
    for frames in messages:
        message = decode_input(frames, wire)
        assert type(message).__name__ == "EngineCoreRequest", message
        engine.apply(message)
        for _, message in engine.step():
            pack(message)
    while engine.has_work:
        for _, message in engine.step():
            pack(message)
    return (time.process_time() - started) / len(messages)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prefix-caching", action="store_true")
    args = parser.parse_args()
    frames = captured(0)
    kinds = {
        "text only (2252-token prompt)": variants(frames, args.requests, args.max_tokens, True, False),
        "one image, new (data in 2 aux frames)": variants(frames, args.requests, args.max_tokens, False, False),
        "one image, repeat (stripped, from the cache)": variants(frames, args.requests, args.max_tokens, False, True),
    }
    first = list(frames)  # the captured ADD: its image is the one the stripped repeats name
    for name, messages in kinds.items():
        best = min(run(messages, args.prefix_caching, first) for _ in range(args.repeats))
        print(f"{name:48s} {best * 1e6:8.1f} µs CPU per request ({args.requests} requests, {args.max_tokens} tokens each)")


if __name__ == "__main__":
    main()
