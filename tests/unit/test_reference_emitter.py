"""The reference emitter is the floor gmock is measured against (bench.py):
it must send what gmock sends, or the ratio means nothing."""

import sys

import msgpack
import pytest

from gmock_engine.content.tokens import RandomTokens
from gmock_engine.tools.bench import REFERENCE_EMITTER
from gmock_engine.wire.eras import Wire, layout_for_version
from gmock_engine.wire.inputs import EngineCoreRequest

sys.path.insert(0, str(REFERENCE_EMITTER.parent))  # benchmarks/: the floor is a script of the checkout
import reference_emitter  # noqa: E402

from test_engine import add, make, run


class Socket:
    def __init__(self):
        self.messages = []

    def send(self, data):
        self.messages.append(msgpack.unpackb(data, strict_map_key=False))


def without_times(output):
    """An output with its event timestamps taken out (the clocks differ)."""
    output = list(output)
    if len(output) > 7 and output[7]:
        output[7] = [event["type"] for event in output[7]]
    return output


@pytest.mark.parametrize("chunk,logprobs", [(1, None), (3, None), (4, None), (1, 5), (4, 2)])
def test_the_floor_sends_what_gmock_sends(chunk, logprobs):
    lengths = {"a": 1, "b": 4, "c": 7, "d": 12}
    asking = {"b", "d"} if logprobs is not None else set()  # with logprobs: the same rows too
    engine = make(chunk=chunk, clients=1)
    for rid, n in lengths.items():
        engine.apply(add(rid, max_tokens=n, logprobs=logprobs if rid in asking else None))
    # through the wire, as the frontend sees both (the rows are buffers of either type before)
    gmock = [msgpack.unpackb(msgpack.packb(m, use_bin_type=True), strict_map_key=False) for _, m in run(engine)]

    floor = reference_emitter.Engine(0, chunk, RandomTokens(32000, 0, 0), layout_for_version("0.33"))
    sock = Socket()
    floor.outputs.append(sock)
    for rid, n in lengths.items():
        body = [None] * 22
        body[0], body[1], body[3], body[11] = rid, [1, 2, 3], {"max_tokens": n}, 0
        if rid in asking:
            body[3]["logprobs"] = logprobs
        floor.add(body)
    while floor.busy:
        floor.run_step()

    for messages in (gmock, sock.messages):
        assert all(len(m) in (4, 6) for m in messages)
    # the same outputs per request, step by step (only their order within a message may differ)
    for rid in lengths:
        ours = [[without_times(o) for o in m[1] if o[0] == rid] for m in gmock]
        theirs = [[without_times(o) for o in m[1] if o[0] == rid] for m in sock.messages]
        assert ours == theirs, rid
        with_rows = [o for m in theirs for o in m if len(o) > 2 and o[2] is not None]
        assert len(with_rows) == (len([o for m in theirs for o in m]) if rid in asking else 0)
    assert [sorted(m[5]) for m in gmock if len(m) > 5] == [sorted(m[5]) for m in sock.messages if len(m) > 5]
    # SchedulerStats on the first message and on the one that leaves the engine idle, as gmock's
    # (in between, gmock's also follow its KV usage, which the floor does not keep)
    for messages in (gmock, sock.messages):
        assert messages[0][2] is not None and messages[-1][2] is not None
        assert messages[-1][2]["num_running_reqs"] == 0


@pytest.mark.parametrize("chunk", [1, 3, 4])
@pytest.mark.parametrize("reuse", [False, True])
def test_the_floor_caches_prefixes_and_publishes_what_gmock_does(chunk, reuse):
    """With prefix caching and KV events, the floor sends the same outputs
    (prefill stats with the same cache hits) and, step by step, the same KV
    events (their order within a step may differ, as outputs within a
    message), through prefix hits and LRU evictions of a pool of 14 blocks of
    4; the same prefix-cache counters in SchedulerStats."""
    import collections
    import json

    from gmock_engine.kv import events as kv_events
    from gmock_engine.core.engine import EngineCore, EngineSettings
    from engine_steps import TickClock

    layout = layout_for_version("0.33")
    block_size, capacity = 4, 14
    shared = [7, 8, 9, 10, 11, 12, 13, 14, 15]
    # (step it arrives at, id, prompt, max_tokens): every request joins a lane (max_tokens > 2 chunks),
    # so the ones that end in one step leave in the order both engines free them (their arrival)
    plan = [
        (0, "a", shared, 9), (0, "b", [1, 2, 3, 4, 5, 6], 14),
        (3, "c", shared + [16, 17], 11), (3, "d", list(range(40, 53)), 13),
        (9, "e", shared, 10), (12, "f", [1, 2, 3, 4, 5], 17), (12, "g", shared[:8], 12),
    ]  # fmt: skip
    settings = EngineSettings(rank=0, num_clients=1, output_token_chunk_size=chunk, prefix_caching=True, kv_events=True,
                              block_size=block_size, num_gpu_blocks=capacity, reuse_outputs=reuse, wire=Wire(layout))  # fmt: skip
    gmock = EngineCore(settings, clock=TickClock())
    published = []
    floor_kv = reference_emitter.FloorKV(capacity, block_size, RandomTokens(32000, 0, 0), chunk, published.append)
    floor = reference_emitter.Engine(0, chunk, RandomTokens(32000, 0, 0), layout, floor_kv)
    sock = Socket()
    floor.outputs.append(sock)

    def canonical(events):
        return collections.Counter(json.dumps(e, sort_keys=True) for e in events)

    ours, theirs, our_events, their_events = [], [], [], []
    step = 0
    while step == 0 or gmock.has_work or floor.busy or any(at >= step for at, *_ in plan):
        for at, rid, prompt, n in plan:
            if at == step:
                gmock.apply(EngineCoreRequest(rid, len(prompt), n, True, prompt_token_ids=list(prompt)))
                body = [None] * 22
                body[0], body[1], body[3], body[11] = rid, list(prompt), {"max_tokens": n}, 0
                floor.add(body)
        step += 1
        assert step < 200
        # through the wire, as the frontend sees both (reused outputs are rewritten by the next step)
        ours += [msgpack.unpackb(msgpack.packb(m, use_bin_type=True), strict_map_key=False) for _, m in gmock.step()] if gmock.has_work else []
        our_events.append(canonical(kv_events.encode_events(gmock.take_kv_events(), block_size, kv_events.EventFormat.of(layout))))
        count = len(sock.messages)
        if floor.busy:
            floor.run_step()
        their_events.append(canonical([e for batch in published for e in batch]))
        published.clear()
        theirs += sock.messages[count:]

    for rid, *_ in [p[1:] for p in plan]:
        assert [without_times(o) for m in ours for o in m[1] if o[0] == rid] == [without_times(o) for m in theirs for o in m[1] if o[0] == rid], rid
    hits = {o[0]: o[11]["num_cached_tokens"] for m in ours for o in m[1] if len(o) > 11 and o[11]}
    assert hits["c"] == 8 and hits["e"] == 8 and hits["g"] == 4  # prefixes were hit (a, then c's copies)
    removed = sum(c for step_events in their_events for e, c in step_events.items() if '"BlockRemoved"' in e)
    assert removed >= 5  # the pool of 14 blocks was too small: blocks were evicted
    assert our_events == their_events
    totals = [collections.Counter(), collections.Counter()]
    for total, messages in zip(totals, (ours, theirs)):
        for m in messages:
            if m[2] is not None:
                total.update({k: v for k, v in m[2]["prefix_cache_stats"].items() if k != "reset"})
    assert totals[0] == totals[1] and totals[0]["requests"] == len(plan)


def test_the_floor_imports_no_gevent_and_collects_as_rarely_as_gmock():
    """The floor is one thread on plain pyzmq: importing it pulls in neither
    gevent nor zmq.green (a subprocess: this one has them already); its GC
    threshold is gmock's entry point's (cli.GC_THRESHOLD)."""
    import subprocess
    import sys

    from gmock_engine.runtime import cli

    probe = (
        f"import sys; sys.path.insert(0, {str(REFERENCE_EMITTER.parent)!r}); import reference_emitter; "
        "print(sorted(m for m in ('gevent', 'zmq.green') if m in sys.modules))"
    )
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.strip() == "[]"
    assert reference_emitter.GC_THRESHOLD == cli.GC_THRESHOLD


def test_bench_names_the_missing_floor_outside_a_checkout(monkeypatch, tmp_path, capsys):
    """Installed without the checkout, benchmarks/ is not there: `bench` says
    so and how to go on (--target gmock) instead of failing to start it."""
    from gmock_engine.tools import bench

    monkeypatch.setattr(bench, "REFERENCE_EMITTER", tmp_path / "benchmarks" / "reference_emitter.py")
    assert bench.main(["--target", "reference", "--join-timeout", "1", "--duration", "0.1", "--warmup", "0", "--idle", "0"]) == 2
    err = capsys.readouterr().err
    assert "source checkout" in err and "--target gmock" in err
