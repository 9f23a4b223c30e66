"""Prefix caching as vLLM's block pool: hashes, hits, LRU eviction, the KV
events it records, and hits in PrefillStats and SchedulerStats.

§N: section N of docs/protocol.md."""

import pytest

from gmock_engine.core.engine import EngineCore, EngineSettings
from gmock_engine.core.kv_cache_manager import KVCacheManager
from gmock_engine.core.prefix_cache import CLEARED, REMOVED, STORED, PrefixCache, block_hashes
from gmock_engine.core.request import Request
from gmock_engine.wire.inputs import EngineCoreRequest, UtilityCall


def test_chained_hashes_cover_full_blocks_and_their_prefix():
    a = block_hashes(list(range(40)), 16)
    assert len(a) == 2  # 8 trailing tokens are not a full block
    b = block_hashes(list(range(32)) + [99] * 8, 16)
    assert a == b
    c = block_hashes([7] + list(range(1, 40)), 16)
    assert c[0] != a[0] and c[1] != a[1]  # a different first block changes every later hash
    assert all(0 <= h < 1 << 64 for h in a + c)  # unsigned 64-bit, as vLLM's int hashes
    assert block_hashes(list(range(16, 32)), 16, previous=a[0]) == a[1:]  # chaining continues


def _request(rid, tokens, output=0):
    r = Request(rid, 0, 10, None, len(tokens), 0.0)
    r.num_output_tokens = output
    return r


def _run(kv, request, tokens, outputs=()):
    """Admit `request` (prompt `tokens`), prefill it whole, emit `outputs` one per step."""
    kv.track(request, tokens)
    cached = kv.admit(request)
    kv.computed(request, request.num_tokens)
    for token in outputs:
        kv.on_output(request, [token])
        request.num_output_tokens += 1
    return cached


def test_hits_are_whole_blocks_and_never_the_whole_prompt():
    kv = KVCacheManager(100, 4, None, True)
    prompt = list(range(12))
    a = _request("a", prompt)
    assert _run(kv, a, prompt) == 0
    kv.free(a)
    b = _request("b", prompt)
    assert _run(kv, b, prompt) == 8  # vLLM: at most num_tokens - 1, in whole blocks
    kv.free(b)
    c = _request("c", prompt[:8] + [50, 51, 52, 53])
    assert _run(kv, c, prompt[:8] + [50, 51, 52, 53]) == 8
    assert kv.take_prefix_cache_stats() == {
        "reset": False, "requests": 3, "queries": 36, "hits": 16,
        "preempted_requests": 0, "preempted_queries": 0, "preempted_hits": 0,
    }  # fmt: skip
    assert kv.take_prefix_cache_stats()["requests"] == 0


def test_events_say_what_is_stored_chained_with_the_generated_tokens():
    kv = KVCacheManager(100, 4, None, True, kv_events=True)
    prompt = list(range(10))
    a = _request("a", prompt)
    _run(kv, a, prompt, outputs=[70, 71, 72])
    hashes = block_hashes(prompt[:8] + [8, 9, 70, 71], 4)
    # the prompt's two full blocks at its prefill; the third once 70 and 71
    # are computed (72 is sampled, its KV not computed yet)
    assert kv.take_events() == [
        (STORED, list(hashes[:2]), None, prompt[:8]),
        (STORED, [hashes[2]], hashes[1], [8, 9, 70, 71]),
    ]
    assert kv.take_events() == []
    assert sorted(kv.prefix_cache.cached_hashes()) == sorted(hashes)


def test_a_hit_stores_only_the_new_blocks_with_the_last_hit_as_parent():
    kv = KVCacheManager(100, 4, None, True, kv_events=True)
    a = _request("a", list(range(8)))
    _run(kv, a, list(range(8)))
    kv.free(a)
    kv.take_events()
    prompt = list(range(8)) + [40, 41, 42, 43, 44]
    b = _request("b", prompt)
    assert _run(kv, b, prompt) == 8
    first = block_hashes(prompt, 4)
    assert kv.take_events() == [(STORED, [first[2]], first[1], [40, 41, 42, 43])]


def test_eviction_is_lru_the_tail_blocks_first_with_one_removed_per_block():
    kv = KVCacheManager(4, 2, 4, True, kv_events=True)  # 4 blocks of 2 tokens, enforced
    a = _request("a", [1, 2, 3, 4, 5])
    kv.allocate(a, kv.blocks_to_admit(a))
    _run(kv, a, [1, 2, 3, 4, 5])
    kv.free(a)
    a_hashes = block_hashes([1, 2, 3, 4], 2)
    kv.take_events()
    b = _request("b", [9, 9, 9, 9, 9])
    # a held 3 blocks (2 cached, its partial third not): 2 free blocks were
    # never cached, so b's 3 blocks take those and evict one
    kv.allocate(b, kv.blocks_to_admit(b))
    _run(kv, b, [9, 9, 9, 9, 9])
    events = kv.take_events()
    # a's blocks were freed tail first: [3 4] is the least recently freed and goes
    assert events == [(REMOVED, [a_hashes[1]]), (STORED, list(block_hashes([9, 9, 9, 9], 2)), None, [9, 9, 9, 9])]
    assert sorted(kv.prefix_cache.cached_hashes()) == sorted([a_hashes[0], *block_hashes([9, 9, 9, 9], 2)])


def test_blocks_held_by_a_running_request_are_never_evicted():
    cache = PrefixCache(capacity=2, block_size=1, events=True)
    a = _request("a", [1, 2])
    cache.track(a, [1, 2])
    cache.admit(a)
    cache.ensure(a, 2)
    cache.cache(a, 2)
    b = _request("b", [3])
    cache.track(b, [3])
    cache.admit(b)
    cache.ensure(b, 1)  # over capacity (blocks not enforced): nothing evictable, nothing removed
    assert [e[0] for e in cache.take_events()] == [STORED]
    assert cache.held == 3


def test_reset_clears_everything_but_is_refused_while_blocks_are_held():
    kv = KVCacheManager(100, 4, None, True, kv_events=True)
    a = _request("a", list(range(8)))
    _run(kv, a, list(range(8)))
    kv.take_events()
    assert kv.reset_prefix_cache() is False and kv.take_events() == []  # vLLM refuses too
    kv.free(a)
    assert kv.reset_prefix_cache() is True
    assert kv.take_events() == [(CLEARED,)]
    assert len(kv.prefix_cache) == 0 and kv.take_prefix_cache_stats()["reset"] is True


def test_no_events_are_kept_when_they_are_off():
    kv = KVCacheManager(100, 4, None, True)
    a = _request("a", list(range(8)))
    _run(kv, a, list(range(8)), outputs=[1, 2, 3, 4])
    assert kv.prefix_cache.events is None and kv.take_events() == []


def test_engine_reports_cached_tokens_and_resets():
    ticks = iter(range(1, 10**6))  # a clock one second apart per call: stats are always due
    engine = EngineCore(
        EngineSettings(rank=0, num_clients=1, prefix_caching=True, block_size=4, kv_events=True), clock=lambda: float(next(ticks))
    )
    prompt = list(range(20))

    def first_output(rid):
        engine.apply(EngineCoreRequest(rid, len(prompt), 2, True, prompt_token_ids=prompt))
        sent = []
        while engine.has_work:
            sent += engine.step()
        return [o for _, m in sent for o in m[1] if o[0] == rid][0], [m[2] for _, m in sent if m[2]]

    out, _ = first_output("a")
    assert out[11]["num_cached_tokens"] == 0 and out[11]["num_computed_tokens"] == 20
    stored = engine.take_kv_events()
    assert stored[0] == (STORED, list(block_hashes(prompt, 4)), None, prompt)
    out, stats = first_output("b")
    assert out[11]["num_cached_tokens"] == 16 and out[11]["num_computed_tokens"] == 4
    assert sum(s["prefix_cache_stats"]["hits"] for s in stats) >= 16
    # b recomputed the last prompt block: vLLM stores it again (a second physical copy)
    assert engine.take_kv_events()[0] == (STORED, [block_hashes(prompt, 4)[4]], block_hashes(prompt, 4)[3], prompt[16:])
    engine.apply(UtilityCall(0, 1, "reset_prefix_cache", [False, False]))
    assert engine.take_kv_events() == [(CLEARED,)]
    out, _ = first_output("c")
    assert out[11]["num_cached_tokens"] == 0


def test_an_adapter_keeps_its_own_blocks_and_names_itself_in_the_events():
    """vLLM hashes a LoRA request's blocks with the adapter's name (extra keys):
    the same prompt under another adapter, or none, hits nothing; BlockStored
    carries lora_id and lora_name (Appendix D)."""
    from gmock_engine.kv.events import EventFormat, encode_events
    from gmock_engine.core.lora import LoRARequest

    kv = KVCacheManager(100, 4, None, True, kv_events=True)
    prompt = list(range(12))
    sql = _request("a", prompt)
    sql.lora_request = LoRARequest("sql", 7, "/adapters/sql")
    assert _run(kv, sql, prompt) == 0
    kv.free(sql)
    base = _request("b", prompt)
    assert _run(kv, base, prompt) == 0  # the base model does not share the adapter's KV
    kv.free(base)
    again = _request("c", prompt)
    again.lora_request = LoRARequest("sql", 7, "/adapters/sql")
    assert _run(kv, again, prompt) == 8  # the same adapter does
    stored = [e for e in kv.take_events() if e[0] == STORED]
    assert stored[0][4:] == (7, "sql") and len(stored[1]) == 4
    item = encode_events(stored[:1], 4, EventFormat())[0]
    assert (item["lora_id"], item["lora_name"], item["token_ids"]) == (7, "sql", prompt)


def _generate(chunk, reuse, plan):
    """Run `plan` ([(prompt, max_tokens, step it arrives at)]) with prefix
    caching and KV events; the events and each request's tokens."""
    settings = EngineSettings(rank=0, num_clients=1, prefix_caching=True, block_size=4, kv_events=True,
                              output_token_chunk_size=chunk, reuse_outputs=reuse)  # fmt: skip
    engine = EngineCore(settings, clock=lambda: 1.0)
    events, tokens, step = [], {}, 0
    while step == 0 or engine.has_work or any(at >= step for _, _, at in plan):
        for index, (prompt, n, at) in enumerate(plan):
            if at == step:
                engine.apply(EngineCoreRequest(f"r{index}", len(prompt), n, True, prompt_token_ids=prompt))
        for _, message in engine.step():
            for output in message[1]:
                tokens.setdefault(output[0], []).extend(output[1])  # copied now: reused lists change
        events += engine.take_kv_events()
        step += 1
    return events, tokens


@pytest.mark.parametrize("chunk", [1, 3, 4])
def test_lanes_cache_generated_blocks_as_the_full_path_does(chunk):
    # With reused outputs the lanes hand their tokens to the KV manager once
    # per lane (on_lane_outputs); without, each request's on_output: the
    # same blocks, in the same order, chained the same way.
    prompt = list(range(10))
    plan = [(prompt, 37, 0), (prompt[:6] + [99, 98], 29, 2), (prompt, 23, 5)]
    per_request, per_lane = _generate(chunk, False, plan), _generate(chunk, True, plan)
    assert per_lane == per_request
    events, tokens = per_lane
    generated = [e for e in events if e[0] == STORED and e[2] is not None and len(e[1]) == 1]
    assert len(generated) >= 12  # blocks of generated tokens were cached, one event each


def test_a_generated_block_chains_to_the_one_before_it():
    prompt = list(range(10))
    events, tokens = _generate(1, True, [(prompt, 30, 0)])
    stored = [(h, parent, ids) for e in events if e[0] == STORED for h, parent, ids in [(e[1], e[2], e[3])]]
    # what is computed: the prompt and every output but the last (sampled, not computed yet)
    expected = block_hashes(prompt + tokens["r0"][:-1], 4)
    assert [h for hashes, _, _ in stored for h in hashes] == list(expected)
    assert [parent for _, parent, _ in stored] == [None] + [hashes[-1] for hashes, _, _ in stored[:-1]]
    assert [t for _, _, ids in stored for t in ids] == (prompt + tokens["r0"][:-1])[: len(expected) * 4]
