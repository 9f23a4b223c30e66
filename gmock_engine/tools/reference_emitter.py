"""The reference emitter: the floor of a Python engine, in pyzmq + msgpack.

`gmock-engine bench` runs this beside gmock_engine under the same load and
reports gmock's CPU per token as a ratio to it. It is meant as the floor,
the least a Python engine has to spend to send the messages gmock sends
(issue 17), so the ratio says how far gmock is from it:

* the same wire messages: the same token ids (tokens.py's pool, at the
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
* one thread, a blocking poll, no gevent, no queues, no validation, no
  logging, no token budget, KV cache or latency model. Bad input crashes it.

It answers get_supported_tasks with ["generate"], every other utility call
with nil, and an ABORT with an ABORT output.

    python -m gmock_engine.tools.reference_emitter --handshake-address tcp://127.0.0.1:29550 \\
        [--engine-count N] [--output-token-chunk-size K] [--vocab-size V] [--seed S]
"""

from __future__ import annotations

import argparse
import gc
import signal
import sys
import time
from typing import Any, Dict, List

import msgpack
import zmq

from .. import protocol
from ..cli import GC_THRESHOLD
from ..logprobs import LogprobModel
from ..outbox import STATS_INTERVAL_S
from ..protocol import EngineCoreEventType, FinishReason
from ..tokens import POOL_PAD, RandomTokens

#: EngineCoreRequest fields read here (the 0.33 layout the bench driver sends).
_PROMPT, _SAMPLING, _CLIENT = 1, 3, 11


class Engine:
    """One DP rank: its sockets, its requests by client, its finish buckets."""

    def __init__(self, rank: int, chunk: int, tokens: RandomTokens, layout: protocol.WireLayout) -> None:
        self.rank = rank
        self.chunk = chunk
        self.tokens = tokens
        self.layout = layout
        self.inputs: List[Any] = []
        self.outputs: List[Any] = []
        self.step = 0
        #: client -> request id -> [reused output list, generator state, tokens of its last output]
        self.running: Dict[int, Dict[str, List[Any]]] = {}
        #: the same for requests with logprobs: [reused [id, tokens, LogprobsLists], state, last, RowPool]
        self.running_logprobs: Dict[int, Dict[str, List[Any]]] = {}
        #: requests added since the last step: (client, id, max_tokens, state, events, prompt length, RowPool)
        self.fresh: List[Any] = []
        self.logprob_model = LogprobModel(low=tokens.low, span=tokens.span)
        #: step -> [(client, id)] whose last chunk goes out in that step
        self.finish_at: Dict[int, List[Any]] = {}
        self.count = 0
        self._stats_counts = (0, 0)
        self._stats_at = float("-inf")

    @property
    def busy(self) -> bool:
        return self.count > 0

    def add(self, body: List[Any]) -> None:
        """ADD: its generator state, its QUEUED event; its finish step is fixed at its first step."""
        rid, client, sampling = body[0], body[_CLIENT], body[_SAMPLING]
        n = sampling.get("max_tokens", 16)
        events = [protocol.engine_core_event(EngineCoreEventType.QUEUED, time.monotonic())]
        state = self.tokens.initial_state(rid)
        pool = None
        k = sampling.get("logprobs")
        if k is not None:
            pool = self.logprob_model.pooled(self.tokens, k)
            assert pool is not None and self.chunk <= POOL_PAD, "the floor makes logprobs for k <= 20 and chunks <= 64 only"
            # the rows of every position it will read, drawn now
            end = state + n
            pool.ensure(state, min(end, len(pool.ids)))
            if end > pool.size:
                pool.ensure(0, min(end - pool.size, pool.size))
        self.fresh.append((client, rid, n, state, events, len(body[_PROMPT] or ()), pool))
        self.count += 1

    def abort(self, rid: str) -> None:
        for client, requests in [*self.running.items(), *self.running_logprobs.items()]:
            if requests.pop(rid, None) is not None:
                break
        else:
            for i, entry in enumerate(self.fresh):
                if entry[1] == rid:
                    client = entry[0]
                    del self.fresh[i]
                    break
            else:
                return
        self.count -= 1
        out = protocol.engine_core_output(rid, [], FinishReason.ABORT, None, self.layout)
        self.outputs[client].send(pack([self.rank, [out], None, time.monotonic(), None, [rid]]))

    def run_step(self) -> None:
        """One step: last outputs, one draw per running request, then first outputs."""
        step = self.step = self.step + 1
        chunk = self.chunk
        batches: Dict[int, Any] = {}
        now = time.monotonic()
        ending = self.finish_at.pop(step, None)
        if ending:
            for client, rid in ending:
                entry = self.running.get(client, {}).pop(rid, None) or self.running_logprobs.get(client, {}).pop(rid, None)
                if entry is None:
                    continue  # aborted
                position = entry[1]
                tokens, entry[1] = self.tokens.draw(position, entry[2])
                logprobs = _logprobs(entry[3], position, len(tokens), self.layout) if len(entry) > 3 else None
                batch = batches.get(client) or batches.setdefault(client, ([], []))
                batch[0].append([rid, tokens, logprobs, None, None, 1])
                batch[1].append(rid)
                self.count -= 1
        ids, size = self.tokens.ids, self.tokens.size
        for client, requests in self.running.items():
            batch = batches.get(client) or batches.setdefault(client, ([], []))
            append = batch[0].append
            if chunk == 1:  # as below, one index instead of a slice
                for entry in requests.values():
                    position = entry[1]
                    out = entry[0]
                    out[1] = [ids[position]]
                    position += 1
                    entry[1] = position if position < size else 0
                    append(out)
            elif chunk <= POOL_PAD:
                # The per-token work and nothing else: the next ids of the
                # request's pool position (tokens.py's TokenPool.draw, inline:
                # one slice) swapped into its reused [request_id, tokens] list.
                for entry in requests.values():
                    end = entry[1] + chunk
                    out = entry[0]
                    out[1] = ids[entry[1] : end]
                    entry[1] = end if end < size else end % size
                    append(out)
            else:
                for entry in requests.values():
                    out = entry[0]
                    out[1], entry[1] = self.tokens.draw(entry[1], chunk)
                    append(out)
        ext = msgpack.ExtType
        for client, requests in self.running_logprobs.items():
            batch = batches.get(client) or batches.setdefault(client, ([], []))
            append = batch[0].append
            # as the loops above, and the rows of the same positions: three
            # slices of the RowPool's buffers swapped into the reused lists
            for entry in requests.values():
                position, out, pool = entry[1], entry[0], entry[3]
                end = position + chunk
                out[1] = ids[position:end]
                id_row, lp_row, rank_row = out[2][0], out[2][1], out[2][2]
                stride = pool.stride
                id_row[2] = tuple.__new__(ext, (3, pool.row_ids[position * stride : end * stride]))
                lp_row[2] = tuple.__new__(ext, (3, pool.row_lps[position * stride : end * stride]))
                rank_row[2] = tuple.__new__(ext, (3, pool.row_ranks[position * 8 : end * 8]))
                entry[1] = end if end < size else end % size
                append(out)
        if self.fresh:  # after the draw loop: their next tokens are for the next step
            scheduled = protocol.engine_core_event(EngineCoreEventType.SCHEDULED, now)
            for client, rid, n, state, events, prompt_len, pool in self.fresh:
                events.append(scheduled)
                first_n = chunk if chunk < n else n
                position = state
                tokens, state = self.tokens.draw(state, first_n)
                left = n - first_n
                first = protocol.engine_core_output(
                    rid, tokens, None if left else FinishReason.LENGTH, None, self.layout,
                    events=events, prefill_stats=protocol.prefill_stats(prompt_len),
                    new_logprobs=None if pool is None else _logprobs(pool, position, first_n, self.layout),
                )  # fmt: skip
                batch = batches.get(client) or batches.setdefault(client, ([], []))
                batch[0].append(first)
                if not left:
                    batch[1].append(rid)
                    self.count -= 1
                    continue
                # the finish step, bucketed now: the running loop never checks a length
                steps = -(-left // chunk)
                last = left - (steps - 1) * chunk
                if pool is None:
                    self.running.setdefault(client, {})[rid] = [[rid, None], state, last]
                else:
                    reused = _logprobs(pool, 0, chunk, self.layout)  # its arrays are swapped in every step
                    self.running_logprobs.setdefault(client, {})[rid] = [[rid, None, reused], state, last, pool]
                self.finish_at.setdefault(step + steps, []).append((client, rid))
            self.fresh = []
        stats = self._stats_if_due(now)
        for client, (outputs, finished) in batches.items():
            if not outputs and not finished:
                continue
            message = [self.rank, outputs, stats, now]
            if finished:
                message += [None, finished]
            self.outputs[client].send(pack(message))
            stats = None

    def _stats_if_due(self, now: float) -> Any:
        """outbox.StatsCadence's rule (no waiting queue, no KV usage here)."""
        running = self.count
        if running and now - self._stats_at < STATS_INTERVAL_S:
            return None
        counts = (running, 0)
        if counts == self._stats_counts:
            return None
        self._stats_counts, self._stats_at = counts, now
        return protocol.scheduler_stats(running, 0, 0.0, self.step)


def _logprobs(pool: Any, position: int, n: int, layout: protocol.WireLayout) -> List[Any]:
    """new_logprobs of the n tokens from pool position `position` on."""
    stride, end = pool.stride, position + n
    ids, lps, ranks = pool.row_ids[position * stride : end * stride], pool.row_lps[position * stride : end * stride], pool.row_ranks[position * 8 : end * 8]
    return protocol.logprobs_lists(n, pool.k + 1, ids, lps, ranks, layout)


pack = msgpack.Packer(use_bin_type=True).pack


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
    # As gmock's entry point (cli.py): the cyclic GC runs rarely. A step's
    # lists are acyclic and freed by reference counting; with the default
    # thresholds the collector walks every live request and block again and
    # again, which no engine needs to pay.
    gc.freeze()
    gc.set_threshold(GC_THRESHOLD, 50, 100)

    ctx = zmq.Context()
    layout = protocol.layout_for_version(protocol.DEFAULT_PROTOCOL_VERSION)
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
            "max_model_len": 1048576, "num_gpu_blocks": 65536, "block_size": 16, "dp_stats_address": None,
            "dtype": "bfloat16", "vllm_version": "0.33.0", "world_size": 1, "data_parallel_size": args.engine_count,
            "tensor_parallel_size": 1, "pipeline_parallel_size": 1, "decode_context_parallel_size": 1,
            "data_parallel_rank": rank, "max_num_seqs": 256, "max_num_batched_tokens": 8192,
            "instance_id": f"reference-{rank}", "supports_lora": False, "max_loras": 0,
        }  # fmt: skip
        engine = Engine(rank, args.output_token_chunk_size, RandomTokens(args.vocab_size, args.seed, rank), layout)
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
        hs.send(pack({"status": "READY", "local": False, "headless": True, "num_gpu_blocks": 65536}))
        engines.append(engine)
    owner = {sock: e for e in engines for sock in e.inputs}

    while True:
        busy = any(e.busy for e in engines)
        for sock, _ in poller.poll(0 if busy else None):
            engine = owner[sock]
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                kind, body = frames[0], msgpack.unpackb(frames[1], strict_map_key=False)
                if kind == b"\x00":
                    engine.add(body)
                elif kind == b"\x01":
                    for rid in body:
                        engine.abort(rid)
                elif kind == b"\x03":
                    client, call_id, method = body[0], body[1], body[2]
                    # get_supported_tasks is the one answer a real frontend cannot do without
                    result = ["generate"] if method == "get_supported_tasks" else None
                    reply = [engine.rank, [], None, time.monotonic(), [call_id, None, [None, result]]]
                    engine.outputs[client].send(pack(reply))
        for engine in engines:
            if engine.busy:
                engine.run_step()


if __name__ == "__main__":
    sys.exit(main())
