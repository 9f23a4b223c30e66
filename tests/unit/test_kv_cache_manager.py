"""core/kv_cache_manager.py: block arithmetic, allocation and release, and the
usage the frontends show, with blocks enforced or only reported (the prefix
cache behind it is in test_prefix_cache.py)."""

import pytest

from gmock_engine.core.kv_cache_manager import KVCacheManager
from gmock_engine.core.request import Request


def _request(rid="r", prompt=10, output=0):
    request = Request(rid, 0, 100, None, prompt, 0.0)
    request.num_output_tokens = output
    return request


@pytest.mark.parametrize("tokens,blocks", [(0, 0), (1, 1), (15, 1), (16, 1), (17, 2), (32, 2), (33, 3)])
def test_blocks_for_is_the_ceiling(tokens, blocks):
    assert KVCacheManager(100, 16, None, False).blocks_for(tokens) == blocks


def test_admission_counts_prompt_and_output():
    kv = KVCacheManager(100, 4, 10, False)
    assert kv.blocks_to_admit(_request(prompt=8)) == 2  # the first decode's slot comes at its step, as vLLM's
    assert kv.blocks_to_admit(_request(prompt=9)) == 3
    assert kv.blocks_to_admit(_request(prompt=5, output=4)) == 3  # a preempted one recomputes its output too


def test_growth_is_only_the_blocks_not_yet_held():
    kv = KVCacheManager(100, 4, 10, False)
    request = _request(prompt=7)
    kv.allocate(request, kv.blocks_to_admit(request))  # 7 tokens: 2 blocks
    assert request.blocks == 2 and kv.blocks_to_grow(request, 1) == 0
    request.num_output_tokens = 1
    assert kv.blocks_to_grow(request, 1) == 1  # token 9 opens a third block
    assert kv.blocks_to_grow(request, 5) == 2  # 13 tokens: 4 blocks


def test_enforced_blocks_fit_up_to_the_last_one():
    kv = KVCacheManager(1000, 4, 5, False)
    assert kv.enforced and kv.num_blocks == 5
    assert kv.fits(5) and not kv.fits(6)
    kv.allocate(_request("a"), 3)
    assert kv.used_blocks == 3 and kv.fits(2) and not kv.fits(3)


def test_reported_blocks_always_fit():
    kv = KVCacheManager(2, 4, None, False)
    assert not kv.enforced and kv.num_blocks is None
    kv.allocate(_request("a"), 50)
    assert kv.fits(10**9) and kv.used_blocks == 50


def test_allocate_free_and_free_all_keep_the_books():
    kv = KVCacheManager(100, 4, 20, False)
    a, b, c = _request("a", 8), _request("b", 4, output=2), _request("c", 3)
    for request, blocks in ((a, 3), (b, 2), (c, 1)):
        kv.admit(request)
        kv.allocate(request, blocks)
    kv.allocate(a, 2)  # grows
    assert (a.blocks, b.blocks, c.blocks, kv.used_blocks) == (5, 2, 1, 8)
    assert kv.tokens == 8 + 6 + 3
    kv.free(b)
    assert (b.blocks, kv.used_blocks, kv.tokens) == (0, 6, 11)
    kv.free_all([a, c])
    assert (a.blocks, c.blocks, kv.used_blocks, kv.tokens) == (0, 0, 0, 0)
    assert kv.usage == 0.0 and kv.fits(20)


def test_usage_is_blocks_over_blocks_when_enforced():
    kv = KVCacheManager(1000, 16, 8, False)
    request = _request(prompt=1000)  # its tokens do not matter here, only its blocks
    kv.admit(request)
    kv.allocate(request, 2)
    assert kv.usage == 0.25
    kv.allocate(request, 6)
    assert kv.usage == 1.0
    kv.free(request)
    assert kv.usage == 0.0


def test_usage_is_tokens_over_the_reported_capacity_and_at_most_one():
    kv = KVCacheManager(10, 16, None, False)  # 160 tokens reported
    a, b = _request("a", 40), _request("b", 40, output=40)
    kv.admit(a)
    assert kv.usage == 0.25
    kv.admit(b)
    assert kv.usage == 0.75
    kv.admit(_request("c", 100))
    assert kv.usage == 1.0  # over capacity: shown full, not above
    kv.free(b)
    assert kv.usage == 100 / 160 + 0.25


def test_zero_reported_blocks_do_not_divide_by_zero():
    kv = KVCacheManager(0, 16, None, False)
    assert kv.usage == 0.0
    kv.admit(_request(prompt=1))
    assert kv.usage == 1.0


def test_without_prefix_caching_there_is_nothing_to_cache_report_or_reset():
    kv = KVCacheManager(100, 4, None, False, kv_events=True)
    request = _request(prompt=8)
    kv.track(request, list(range(8)))
    assert kv.admit(request) == 0 and request.kv_blocks is None and request.block_hashes == []
    assert not kv.caching and kv.prefix_cache is None
    assert kv.take_events() == [] and kv.take_prefix_cache_stats() is None and not kv.stats_pending
    assert kv.reset_prefix_cache() is True


def test_free_all_releases_the_prefix_cache_blocks_so_a_reset_is_allowed():
    kv = KVCacheManager(100, 4, 100, True)
    a, b = _request("a", 8), _request("b", 8)
    for request, start in ((a, 0), (b, 100)):
        kv.track(request, list(range(start, start + 8)))
        kv.admit(request)
        kv.allocate(request, 2)
        kv.computed(request, 8)
    assert kv.caching and kv.reset_prefix_cache() is False  # running requests hold blocks
    kv.free_all([a, b])
    assert a.kv_blocks is None and b.kv_blocks is None and (a.blocks, b.blocks) == (0, 0)
    assert kv.reset_prefix_cache() is True
