"""The bare reference emitter: the simplest pyzmq + msgpack engine loop.

`gmock-engine bench` runs this beside gmock_engine under the same load and
reports gmock's CPU per token as a ratio to it, so results hold on a noisy
machine. It joins the same handshake (no coordinator), answers every utility
call with nil, and emits the same output messages as gmock_engine (same
shapes, same token generator), in one thread with a blocking poll: no
gevent, no queues, no validation, no logging. It is a yardstick, not a
product: bad input crashes it.

    python -m gmock_engine.tools.reference_emitter --handshake-address tcp://127.0.0.1:29550 \\
        [--engine-count N] [--output-token-chunk-size K] [--vocab-size V] [--seed S]
"""

from __future__ import annotations

import argparse
import hashlib
import signal
import sys
import time

import msgpack
import zmq

MASK64 = (1 << 64) - 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="gmock_engine.tools.reference_emitter")
    parser.add_argument("--handshake-address", default="tcp://127.0.0.1:29550")
    parser.add_argument("--engine-count", type=int, default=1)
    parser.add_argument("--data-parallel-start-rank", type=int, default=0)
    parser.add_argument("--output-token-chunk-size", type=int, default=1)
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))

    ctx = zmq.Context()
    pack = msgpack.Packer(use_bin_type=True).pack
    chunk, vocab = args.output_token_chunk_size, args.vocab_size
    engines = []
    poller = zmq.Poller()
    for rank in range(args.data_parallel_start_rank, args.data_parallel_start_rank + args.engine_count):
        identity = rank.to_bytes(2, "little")
        hs = ctx.socket(zmq.DEALER)
        hs.setsockopt(zmq.IDENTITY, identity)
        hs.connect(args.handshake_address)
        hs.send(pack({"status": "HELLO", "local": False, "headless": True}))
        addresses = msgpack.unpackb(hs.recv())["addresses"]
        ready = {
            "max_model_len": 1048576, "num_gpu_blocks": 65536, "block_size": 16, "dp_stats_address": None,
            "dtype": "bfloat16", "vllm_version": "0.33.0", "world_size": 1, "data_parallel_size": args.engine_count,
            "tensor_parallel_size": 1, "pipeline_parallel_size": 1, "decode_context_parallel_size": 1,
            "data_parallel_rank": rank, "max_num_seqs": 256, "max_num_batched_tokens": 8192,
            "instance_id": f"reference-{rank}", "supports_lora": False, "max_loras": 0,
        }  # fmt: skip
        engine = {"rank": rank, "inputs": [], "outputs": [], "active": {}}
        for address in addresses["inputs"]:
            dealer = ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.IDENTITY, identity)
            dealer.connect(address)
            dealer.send(pack(ready))
            poller.register(dealer, zmq.POLLIN)
            engine["inputs"].append(dealer)
        for address in addresses["outputs"]:
            push = ctx.socket(zmq.PUSH)
            push.connect(address)
            engine["outputs"].append(push)
        hs.send(pack({"status": "READY", "local": False, "headless": True, "num_gpu_blocks": 65536}))
        engines.append(engine)
    owner = {sock: e for e in engines for sock in e["inputs"]}

    while True:
        busy = any(e["active"] for e in engines)
        for sock, _ in poller.poll(0 if busy else None):
            engine = owner[sock]
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                kind, body = frames[0], msgpack.unpackb(frames[1], strict_map_key=False)
                if kind == b"\x00":
                    rid, sp = body[0], body[3]
                    seed = int.from_bytes(
                        hashlib.blake2b(f"{args.seed}\0{engine['rank']}\0{rid}".encode(), digest_size=8).digest(), "little"
                    )
                    # [client, remaining, rng state]
                    engine["active"][rid] = [body[11], sp.get("max_tokens", 16), seed]
                elif kind == b"\x01":
                    for rid in body:
                        entry = engine["active"].pop(rid, None)
                        if entry is not None:
                            out = [engine["rank"], [[rid, [], None, None, None, 2]], None, time.monotonic(), None, [rid]]
                            engine["outputs"][entry[0]].send(pack(out))
                elif kind == b"\x03":
                    client, call_id = body[0], body[1]
                    reply = [engine["rank"], [], None, time.monotonic(), [call_id, None, [None, None]]]
                    engine["outputs"][client].send(pack(reply))
        for engine in engines:
            active = engine["active"]
            if not active:
                continue
            batches = {}
            done = []
            for rid, entry in active.items():
                client, remaining, state = entry
                n = chunk if chunk < remaining else remaining
                tokens = []
                for _ in range(n):
                    state = (state * 6364136223846793005 + 1442695040888963407) & MASK64
                    tokens.append(((state >> 32) * vocab) >> 32)
                entry[1], entry[2] = remaining - n, state
                batch = batches.get(client)
                if batch is None:
                    batch = batches[client] = ([], [])
                if n == remaining:
                    batch[0].append([rid, tokens, None, None, None, 1])
                    batch[1].append(rid)
                    done.append(rid)
                else:
                    batch[0].append([rid, tokens])
            for rid in done:
                del active[rid]
            now = time.monotonic()
            for client, (outputs, finished) in batches.items():
                message = [engine["rank"], outputs, None, now]
                if finished:
                    message += [None, finished]
                engine["outputs"][client].send(pack(message))


if __name__ == "__main__":
    sys.exit(main())
