"""BlockPool and KVCacheManager bookkeeping, without a model."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from batchprompt.engine.block_pool import BlockPool, NoFreeBlocks
from batchprompt.engine.kv_cache import KVCacheManager
from batchprompt.engine.request import Request
from batchprompt.engine.sampling_params import SamplingParams


def req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams())


def test_pool_grows_on_demand_up_to_budget():
    pool = BlockPool(max_blocks=5)
    assert pool.num_blocks == 0 and pool.num_free == 5
    a = pool.allocate(3)
    assert pool.num_blocks == 3 and pool.num_free == 2
    with pytest.raises(NoFreeBlocks):
        pool.allocate(3)
    pool.release(a)
    assert pool.num_free == 5 and pool.num_used == 0
    pool.allocate(5)
    assert pool.num_blocks == 5  # freed blocks were reused before new ones were made


def test_cached_blocks_stay_findable_until_reused_lru():
    pool = BlockPool(max_blocks=2)
    a, b = pool.allocate(2)
    pool.cache(a, 11, (0, (1,)))
    pool.cache(b, 22, (0, (2,)))
    pool.release([a])
    pool.release([b])
    assert pool.lookup(11, (0, (1,))) is a  # freed, still findable
    assert pool.lookup(11, (0, (9,))) is None  # same hash, other tokens: no hit
    (c,) = pool.allocate(1)
    assert c is a and pool.lookup(11, (0, (1,))) is None  # least recently freed evicted first
    assert pool.lookup(22, (0, (2,))) is b


def test_shared_prefix_blocks_are_shared():
    kv = KVCacheManager(BlockPool(100), block_size=4)
    system = list(range(100, 112))  # three full blocks
    a, b = req("a", system + [1, 2, 3]), req("b", system + [7, 8])
    assert kv.allocate(a, a.num_tokens)
    kv.cache_full_blocks(a, a.num_tokens)
    hits = kv.find_cached_prefix(b)
    assert len(hits) == 3
    assert kv.allocate(b, b.num_tokens, hits)
    assert kv.block_ids("a")[:3] == kv.block_ids("b")[:3]
    assert kv.block_ids("a")[3] != kv.block_ids("b")[3]
    assert all(blk.ref_count == 2 for blk in hits)
    assert kv.pool.num_used == 4 + 1


def test_last_prompt_token_is_never_a_hit():
    kv = KVCacheManager(BlockPool(100), block_size=4)
    a = req("a", list(range(8)))
    kv.allocate(a, 8)
    kv.cache_full_blocks(a, 8)
    kv.free(a)
    same = req("b", list(range(8)))
    assert len(kv.find_cached_prefix(same)) == 1  # 2 full blocks cached, only 1 usable


def test_a_pin_keeps_a_prefix_cached_after_its_request_ends():
    kv = KVCacheManager(BlockPool(6), block_size=4)
    a = req("a", list(range(10)))
    kv.allocate(a, 10)
    kv.cache_full_blocks(a, 10)
    assert kv.pin("session", a) == 8
    kv.free(a)
    assert kv.pool.num_used == 2  # the two pinned blocks
    filler = req("f", list(range(100, 116)))
    assert kv.allocate(filler, 16)  # takes every unpinned block, evicts nothing pinned
    assert len(kv.find_cached_prefix(req("b", list(range(10))))) == 2
    kv.free(filler)
    kv.unpin("session")
    assert kv.pool.num_used == 0


def test_allocation_failure_changes_nothing():
    kv = KVCacheManager(BlockPool(3), block_size=4)
    a = req("a", list(range(20)))
    assert not kv.allocate(a, 20)
    assert kv.pool.num_used == 0 and kv.block_ids("a") == []


ops = st.lists(st.tuples(st.sampled_from(["add", "grow", "free"]), st.integers(0, 7),
                         st.integers(1, 30)), max_size=80)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_no_block_leaks_after_any_sequence(seq):
    """Random add / grow / free over shared prefixes: ref counts always equal the holders,
    and everything is free once every request is gone."""
    kv = KVCacheManager(BlockPool(40), block_size=4)
    live: dict[str, Request] = {}
    for op, k, n in seq:
        rid = f"r{k}"
        if op == "add" and rid not in live:
            r = req(rid, [k % 3] * 8 + list(range(n)))  # three families of shared prefixes
            hits = kv.find_cached_prefix(r)
            if kv.allocate(r, r.num_tokens, hits):
                kv.cache_full_blocks(r, r.num_tokens)
                live[rid] = r
        elif op == "grow" and rid in live:
            r = live[rid]
            r.append_token(5, None)
            if kv.allocate(r, r.num_tokens):
                kv.cache_full_blocks(r, r.num_tokens)
        elif op == "free" and rid in live:
            kv.free(live.pop(rid))
        holders: dict[int, int] = {}
        for r in live.values():
            for b in kv.block_ids(r.request_id):
                holders[b] = holders.get(b, 0) + 1
        for block in kv.pool.blocks:
            assert block.ref_count == holders.get(block.block_id, 0)
    for r in list(live.values()):
        kv.free(r)
    assert kv.pool.num_used == 0
    assert kv.pool.num_free == kv.pool.max_blocks
