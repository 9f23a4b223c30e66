"""The reference emitter: the floor of a Python engine, in pyzmq + msgpack.

`gmock-engine bench` runs this beside gmock_engine under the same load and
reports gmock's CPU per token as a ratio to it. It is meant as the floor,
the least a Python engine has to spend to send the messages gmock sends,
so the ratio says how far gmock is from it. A yardstick, not a user
command: it lives beside the benchmarks, outside the package, and bench.py
runs it by path from the checkout (gmock_engine must be importable). It
sends:

* the same wire messages: the same token ids (content/tokens.py's pool, at the
  position gmock seeds per request), a first output carrying the QUEUED and
  SCHEDULED events and the prefill stats, a final output with
  finish_reason LENGTH and its id in finished_requests, SchedulerStats on the
  first message of a step when the counts moved (at most every 50 ms while
  requests run, at once when the engine goes idle), one EngineCoreOutputs
  per client per step. Only the order of the outputs inside one message
  differs (ended requests first);
* no more work than that: a request's finish step is known at its first
  step and bucketed, so the running loop never checks a length; each request
  keeps one `[request_id, tokens]` list, reused for every running output. A
  step is one loop that slices each request's next ids out of the pool
  (inline) and swaps them into each of those lists, then one `pack` and one
  `send` per client.
* logprobs (SamplingParams `logprobs`, k <= logprobs.ROW_POOL_MAX_K) the
  cheapest way there is to make them valid: the rows of the pool's
  positions drawn once (logprobs.RowPool, the blocks a request will read
  drawn at its ADD), and per token the three slices of them swapped into
  the request's reused LogprobsLists;
* prefix caching and KV events (`--prefix-caching`, `--kv-events-config`,
  as gmock's flags) the cheapest way there is to send the same events: a
  request's blocks are touched only when one of them becomes full or a new
  one is needed, at steps computed when it starts (bucketed as its finish
  step), so nothing is kept per token; a full block's tokens are sliced
  out of the prompt and the token pool, hashed once, and the step's events
  packed as vLLM's KVEventBatch and sent on a PUB (`FloorKV`);
* one thread, a blocking poll, no gevent, no queues, no validation, no
  logging, no token budget, KV blocks enforced or latency model, no replay
  of KV events. Bad input crashes it.

Paced (`--itl-ms`, as gmock's flag) every engine steps at that interval,
counted from the actual start of the step before (a step that starts late
does not make the next one come sooner), the first step after idle at once;
it sleeps in its poll until then, woken by a timerfd at the deadline (as
gmock's runtime/steptimer.py), and keeps the step lateness for `gmock_stats`.

It answers get_supported_tasks with ["generate"], gmock_stats with the step
lateness (`step_lateness_us`, the window restarted by gmock_stats(True), as
gmock's), every other utility call with nil, and an ABORT with an ABORT
output.

    python benchmarks/reference_emitter.py --handshake-address tcp://127.0.0.1:29550 \\
        [--engine-count N] [--output-token-chunk-size K] [--vocab-size V] [--seed S] \\
        [--itl-ms MS] [--prefix-caching] [--kv-events-config JSON] [--num-gpu-blocks B] [--block-size S]

In three files beside each other: this one (options, handshake, sockets and
the loop), reference_emitter_engine.py (`Engine`: one rank's requests and
steps) and reference_emitter_kv.py (`FloorKV`: prefix caching, KV events).

§N: section N of docs/protocol.md.
"""

from __future__ import annotations

import argparse
import gc
import math
import signal
import sys
import time
from typing import Any, Callable, Dict, List, Optional

import msgpack
import zmq

from gmock_engine.content.tokens import RandomTokens
from gmock_engine.kv import events as kv_events
from gmock_engine.runtime.steptimer import TimerFD
from gmock_engine.utils.stats import Samples
from gmock_engine.wire.eras import DEFAULT_PROTOCOL_VERSION, layout_for_version

# beside this file (benchmarks/): the script's directory is on sys.path
from reference_emitter_engine import Engine, pack
from reference_emitter_kv import FloorKV

#: The young-generation threshold of gmock's entry point (cli.GC_THRESHOLD, a
#: test holds them equal; not imported: cli imports gevent, which the floor
#: does without).
GC_THRESHOLD = 100_000


def _publisher(pub: Any, topic: bytes, rank: int) -> Callable[[List[Any]], None]:
    """A step's KV events out on the PUB as vLLM's KVEventBatch
    [ts, events, data_parallel_rank], under the next seq (8 bytes big-endian)."""
    seq = 0

    def publish(events: List[Any]) -> None:
        nonlocal seq
        pub.send_multipart((topic, kv_events.seq_bytes(seq), pack(kv_events.batch_payload(time.time(), events, rank))), zmq.NOBLOCK)
        seq += 1

    return publish


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="reference_emitter.py")
    parser.add_argument("--handshake-address", default="tcp://127.0.0.1:29550")
    parser.add_argument("--engine-count", type=int, default=1)
    parser.add_argument("--data-parallel-start-rank", type=int, default=0)
    parser.add_argument("--output-token-chunk-size", type=int, default=1)
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--seed", type=int, default=0)
    # gmock's flags of the same names (bench.py passes them to both)
    parser.add_argument("--itl-ms", type=float, default=0.0)
    parser.add_argument("--prefix-caching", action="store_true")
    parser.add_argument("--kv-events-config", type=kv_events.parse_config, default=None, metavar="JSON")
    parser.add_argument("--num-gpu-blocks", type=int, default=65536)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args(argv)
    events = args.kv_events_config if args.kv_events_config is not None and args.kv_events_config.enabled else None
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    # As gmock's entry point (runtime/cli.py): the cyclic GC runs rarely. A step's
    # lists are acyclic and freed by reference counting; with the default
    # thresholds the collector walks every live request and block again and
    # again, which no engine needs to pay.
    gc.freeze()
    gc.set_threshold(GC_THRESHOLD, 50, 100)

    ctx = zmq.Context()
    layout = layout_for_version(DEFAULT_PROTOCOL_VERSION)
    engines: List[Engine] = []
    poller = zmq.Poller()
    for rank in range(args.data_parallel_start_rank, args.data_parallel_start_rank + args.engine_count):
        identity = rank.to_bytes(2, "little")
        hs = ctx.socket(zmq.DEALER)
        hs.setsockopt(zmq.IDENTITY, identity)
        hs.connect(args.handshake_address)
        hs.send(pack({"status": "HELLO", "local": False, "headless": True}))
        addresses = msgpack.unpackb(hs.recv())["addresses"]
        ready = {
            "max_model_len": 1048576, "num_gpu_blocks": args.num_gpu_blocks, "block_size": args.block_size, "dp_stats_address": None,
            "dtype": "bfloat16", "vllm_version": "0.33.0", "world_size": 1, "data_parallel_size": args.engine_count,
            "tensor_parallel_size": 1, "pipeline_parallel_size": 1, "decode_context_parallel_size": 1,
            "data_parallel_rank": rank, "max_num_seqs": 256, "max_num_batched_tokens": 8192,
            "instance_id": f"reference-{rank}", "supports_lora": False, "max_loras": 0,
        }  # fmt: skip
        tokens = RandomTokens(args.vocab_size, args.seed, rank)
        kv = None
        if args.prefix_caching:
            publish = None
            if events is not None:
                pub = ctx.socket(zmq.PUB)
                mine = events.for_rank(rank)  # vLLM's offset_endpoint_port: the rank's port
                pub.bind(mine.endpoint)
                publish = _publisher(pub, mine.topic.encode(), rank)
            kv = FloorKV(args.num_gpu_blocks, args.block_size, tokens, args.output_token_chunk_size, publish)
        engine = Engine(rank, args.output_token_chunk_size, tokens, layout, kv)
        for address in addresses["inputs"]:
            dealer = ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.IDENTITY, identity)
            dealer.connect(address)
            dealer.send(pack(ready))
            poller.register(dealer, zmq.POLLIN)
            engine.inputs.append(dealer)
        for address in addresses["outputs"]:
            push = ctx.socket(zmq.PUSH)
            push.connect(address)
            engine.outputs.append(push)
        hs.send(pack({"status": "READY", "local": False, "headless": True, "num_gpu_blocks": args.num_gpu_blocks}))
        engines.append(engine)
    owner = {sock: e for e in engines for sock in e.inputs}

    lateness = Samples()
    take = _input_handler(owner, lateness)
    if args.itl_ms > 0:
        _serve_paced(engines, poller, take, args.itl_ms / 1e3, lateness)
    while True:
        busy = any(e.busy for e in engines)
        for sock, _ in poller.poll(0 if busy else None):
            take(sock)
        for engine in engines:
            if engine.busy:
                engine.run_step()


def _input_handler(owner: Dict[Any, Engine], lateness: Samples) -> Callable[[Any], None]:
    """What to do with a readable input socket: every message it holds."""

    def take(sock: Any) -> None:
        engine = owner[sock]
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            kind, body = frames[0], msgpack.unpackb(frames[1], strict_map_key=False)
            if kind == b"\x00":
                engine.add(body)
            elif kind == b"\x01":
                for rid in body:
                    engine.abort(rid)
            elif kind == b"\x03":
                client, call_id, method = body[0], body[1], body[2]
                # get_supported_tasks is the one answer a real frontend cannot do without
                result: Any = None
                if method == "get_supported_tasks":
                    result = ["generate"]
                elif method == "gmock_stats":  # the bench driver's step lateness, as gmock answers it
                    result = {"step_lateness_us": lateness.summary(scale=1e6)}
                    if body[3][:1] == [True]:
                        lateness.restart()
                reply = [engine.rank, [], None, time.monotonic(), [call_id, None, [None, result]]]
                engine.outputs[client].send(pack(reply))

    return take


def _serve_paced(engines: List[Engine], poller: Any, take: Callable[[Any], None], interval: float, lateness: Samples) -> None:
    """The loop with --itl-ms: a step of every busy engine each `interval`
    from the start of the one before; none while idle (then the next work
    steps at once). Never returns."""
    timer = TimerFD.create()
    timer_fd = None
    if timer is not None:
        timer_fd = timer.fileno()
        poller.register(timer_fd, zmq.POLLIN)
    due: Optional[float] = None
    while True:
        busy = any(e.busy for e in engines)
        if not busy:
            due, timeout = None, None
        elif due is None:
            timeout = 0
        else:
            wait = due - time.monotonic()
            # the timerfd (armed at `due`) wakes the poll; without one, whole milliseconds
            timeout = 0 if wait <= 0 else (None if timer is not None else math.ceil(wait * 1e3))
        for sock, _ in poller.poll(timeout):
            if sock == timer_fd:
                timer.consume()  # type: ignore[union-attr]
            else:
                take(sock)
        started = time.monotonic()
        if due is not None and started < due:
            continue
        stepped = False
        for engine in engines:
            if engine.busy:
                if due is not None:  # each engine's own: the ones after the first wait for it, as gmock's engines of one process
                    lateness.add(time.monotonic() - due)
                engine.run_step()
                stepped = True
        if stepped:
            due = started + interval
            if timer is not None:
                timer.arm(due)


if __name__ == "__main__":
    sys.exit(main())
