"""Prefix caching: block hashes, LRU, hits in PrefillStats and SchedulerStats."""

from gmock_engine.engine import EngineCore, EngineSettings
from gmock_engine.prefix_cache import PrefixCache, block_hashes
from gmock_engine.protocol import EngineCoreRequest, UtilityCall


def test_chained_hashes_cover_full_blocks_and_their_prefix():
    a = block_hashes(list(range(40)), 16)
    assert len(a) == 2  # 8 trailing tokens are not a full block
    b = block_hashes(list(range(32)) + [99] * 8, 16)
    assert a == b
    c = block_hashes([7] + list(range(1, 40)), 16)
    assert c[0] != a[0] and c[1] != a[1]  # a different first block changes every later hash


def test_lookup_counts_leading_hits_and_reports_deltas():
    cache = PrefixCache(capacity=10, block_size=4)
    prompt = list(range(12))
    hashes = block_hashes(prompt, 4)
    assert cache.admit(hashes, 12) == 0
    assert cache.admit(hashes, 12) == 11  # at least one token is computed
    assert cache.admit(block_hashes(prompt[:8] + [50, 51, 52, 53], 4), 12) == 8
    assert cache.take_stats() == {
        "reset": False, "requests": 3, "queries": 36, "hits": 19,
        "preempted_requests": 0, "preempted_queries": 0, "preempted_hits": 0,
    }  # fmt: skip
    assert cache.take_stats()["requests"] == 0
    cache.reset()
    assert len(cache) == 0 and cache.take_stats()["reset"] is True


def test_lru_evicts_the_least_recently_used_blocks():
    cache = PrefixCache(capacity=2, block_size=1)
    cache.admit((1, 2), 3)
    cache.admit((3,), 2)  # evicts 1
    assert cache.admit((1,), 2) == 0
    assert cache.admit((3,), 2) == 1


def test_engine_reports_cached_tokens_and_resets():
    ticks = iter(range(1, 10**6))  # a clock one second apart per call: stats are always due
    engine = EngineCore(EngineSettings(rank=0, num_clients=1, prefix_caching=True, block_size=4), clock=lambda: float(next(ticks)))
    prompt = list(range(20))

    def first_output(rid):
        engine.apply(EngineCoreRequest(rid, len(prompt), 2, True, prompt_token_ids=prompt))
        sent = []
        while engine.has_work:
            sent += engine.step()
        return [o for _, m in sent for o in m[1] if o[0] == rid][0], [m[2] for _, m in sent if m[2]]

    out, _ = first_output("a")
    assert out[11]["num_cached_tokens"] == 0 and out[11]["num_computed_tokens"] == 20
    out, stats = first_output("b")
    assert out[11]["num_cached_tokens"] == 19 and out[11]["num_computed_tokens"] == 1
    assert sum(s["prefix_cache_stats"]["hits"] for s in stats) >= 19
    engine.apply(UtilityCall(0, 1, "reset_prefix_cache", [False, False]))
    out, _ = first_output("c")
    assert out[11]["num_cached_tokens"] == 0
