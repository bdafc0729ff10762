"""KvbmRadixCache on real SGLang pools and allocators on CPU (no server).

Bytes are random and checked page by page; the scheduler's own ``match_kv_cache``
drives the matches, as in a running server.
"""

from __future__ import annotations

import random
from array import array

import pytest
import torch
from sglang.srt.disaggregation.kv_events import BlockRemoved, BlockStored
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InitLoadBackParams, InsertParams
from sglang.srt.mem_cache.common import match_kv_cache
from sglang.srt.mem_cache.radix_cache import RadixKey

from conftest import chain_links, make_req


def insert(stack, tokens, *, seed, cache_salt=None, priority=0):
    """Allocate device pages for ``tokens``, write random KV into them, insert them in the tree."""
    slots = stack.allocator.alloc(len(tokens))
    assert slots is not None, "test pool too small"
    written = stack.write_random(slots, seed)
    key = RadixKey(array("q", tokens), cache_salt=cache_salt)
    result = stack.cache.insert(InsertParams(key=key, value=slots.to(torch.int64), priority=priority))
    assert result.prefix_len == 0
    return written


def load_back(stack, req):
    return stack.cache.init_load_back(
        InitLoadBackParams(best_match_node=req.best_match_node, host_hit_length=req.host_hit_length, req=req)
    )


def evict_all(stack):
    stack.cache.evict(EvictParams(num_tokens=stack.size))


def device_pages_of(stack, node):
    return (stack.cache.path_device_indices(node)[:: stack.page_size] // stack.page_size).tolist()


@pytest.mark.parametrize("pool", ["mha", "mla"])
def test_bytes_come_back_after_device_eviction(stack_factory, pool):
    stack = stack_factory(pool=pool)
    tokens = list(range(100, 132))  # 8 pages
    written = insert(stack, tokens, seed=1)
    assert stack.cache.connector.flush(timeout=30)
    assert stack.manager.counts()[0].blocks == 8

    evict_all(stack)
    assert stack.allocator.available_size() == stack.size
    stack.scramble_pool()

    req = make_req(tokens + [7])
    match_kv_cache(req, stack.cache)
    assert (req.prefix_len, req.host_hit_length) == (0, 32)
    loaded, node = load_back(stack, req)
    assert loaded == 32
    pages = device_pages_of(stack, node)
    assert len(pages) == 8
    for page, expected in zip(pages, written):
        assert torch.equal(stack.layout.read_page(page), expected)

    # The loaded prefix is an ordinary device prefix now.
    again = make_req(tokens + [7], rid="again")
    match_kv_cache(again, stack.cache)
    assert (again.prefix_len, again.host_hit_length) == (32, 0)


def test_host_hit_extends_a_partial_device_match(stack_factory):
    stack = stack_factory()
    prefix, tail = list(range(16)), list(range(500, 516))
    written = insert(stack, prefix + tail, seed=2)
    stack.cache.connector.flush(timeout=30)
    # Evict only the tail: a second insert sharing the prefix makes it a separate leaf.
    other = insert_shared(stack, prefix, list(range(900, 904)), seed=3)
    stack.cache.connector.flush(timeout=30)
    stack.cache.evict(EvictParams(num_tokens=16))  # the least recently used leaf: the original tail
    req = make_req(prefix + tail + [1])
    match_kv_cache(req, stack.cache)
    assert req.prefix_len == 16 and req.host_hit_length == 16
    loaded, node = load_back(stack, req)
    assert loaded == 16
    pages = device_pages_of(stack, node)
    for page, want in zip(pages[4:], written[4:]):
        assert torch.equal(stack.layout.read_page(page), want)
    assert other  # the other leaf kept its own pages


def insert_shared(stack, prefix, tail, *, seed):
    """Insert ``prefix + tail`` where ``prefix`` is already cached: only the tail gets new pages."""
    req = make_req(prefix + tail, rid=f"shared{seed}")
    match_kv_cache(req, stack.cache)
    assert req.prefix_len == len(prefix)
    slots = stack.allocator.alloc(len(tail))
    written = stack.write_random(slots, seed)
    values = torch.cat([stack.cache.path_device_indices(req.last_node), slots.to(torch.int64)])
    stack.cache.insert(InsertParams(key=RadixKey(array("q", prefix + tail)), value=values))
    return written


def test_eviction_skips_pages_a_copy_is_reading(stack_factory):
    stack = stack_factory(gated=True)
    tokens = list(range(32))
    written = insert(stack, tokens, seed=4)
    assert stack.cache.protected_size() == 32  # locked while the copy is queued

    evicted = stack.cache.evict(EvictParams(num_tokens=stack.size)).num_tokens_evicted
    assert evicted == 0
    assert stack.allocator.available_size() == stack.size - 32

    stack.executor.gate.set()
    assert stack.cache.connector.flush(timeout=30)
    assert stack.cache.protected_size() == 0
    assert stack.cache.evict(EvictParams(num_tokens=stack.size)).num_tokens_evicted == 32

    stack.scramble_pool()
    req = make_req(tokens + [1])
    match_kv_cache(req, stack.cache)
    loaded, node = load_back(stack, req)
    assert loaded == 32
    for page, want in zip(device_pages_of(stack, node), written):
        assert torch.equal(stack.layout.read_page(page), want)


def test_blocks_are_invisible_until_their_copy_completes(stack_factory):
    stack = stack_factory(gated=True, events=True)
    tokens = list(range(16))
    insert(stack, tokens, seed=5)
    assert stack.manager.lookup(stack.cache.root_node.children[tuple(tokens[:4])].hash_value) == 0
    assert not [e for e in stack.cache.take_events() if getattr(e, "medium", None) == "CPU_PINNED"]
    stack.executor.gate.set()
    stack.cache.connector.flush(timeout=30)
    stores = [e for e in stack.cache.take_events() if isinstance(e, BlockStored) and e.medium == "CPU_PINNED"]
    assert sum(len(e.block_hashes) for e in stores) == 4


def test_host_events_reuse_gpu_block_ids_and_parent_chain(stack_factory):
    stack = stack_factory(events=True, host_blocks=8)
    first, second = list(range(32)), list(range(1000, 1032))
    insert(stack, first, seed=6)
    stack.cache.connector.flush(timeout=30)
    insert(stack, second, seed=7)  # 8 more blocks: the host tier (8) evicts all of `first`
    stack.cache.connector.flush(timeout=30)
    events = stack.cache.take_events()

    gpu = [e for e in events if isinstance(e, BlockStored) and e.medium == "GPU"]
    cpu = [e for e in events if isinstance(e, BlockStored) and e.medium == "CPU_PINNED"]
    removed = [e for e in events if isinstance(e, BlockRemoved) and e.medium == "CPU_PINNED"]

    assert chain_links(cpu) == chain_links(gpu)  # same ids, same parents, same order
    assert all(e.block_size == 4 and len(e.token_ids) == 4 * len(e.block_hashes) for e in cpu)
    first_ids = [h for _, h in chain_links(gpu)[:8]]
    assert sorted(h for e in removed for h in e.block_hashes) == sorted(first_ids)
    # Every host store comes after a store (in some tier) of its parent.
    seen = set()
    for event in events:
        if isinstance(event, BlockStored):
            assert event.parent_block_hash is None or event.parent_block_hash in seen
            seen.update(event.block_hashes)


def test_cache_salt_never_shares_blocks(stack_factory):
    stack = stack_factory()
    tokens = list(range(64, 96))
    insert(stack, tokens, seed=8, cache_salt="tenant-a")
    stack.cache.connector.flush(timeout=30)
    evict_all(stack)
    other = make_req(tokens + [1], rid="b", cache_salt="tenant-b")
    match_kv_cache(other, stack.cache)
    assert (other.prefix_len, other.host_hit_length) == (0, 0)
    plain = make_req(tokens + [1], rid="plain")
    match_kv_cache(plain, stack.cache)
    assert plain.host_hit_length == 0
    same = make_req(tokens + [1], rid="a", cache_salt="tenant-a")
    match_kv_cache(same, stack.cache)
    assert same.host_hit_length == 32


def test_load_is_all_or_nothing_when_host_lost_blocks(stack_factory):
    stack = stack_factory(host_blocks=8)
    tokens = list(range(32))
    insert(stack, tokens, seed=9)
    stack.cache.connector.flush(timeout=30)
    evict_all(stack)
    req = make_req(tokens + [1])
    match_kv_cache(req, stack.cache)
    assert req.host_hit_length == 32
    # Between match and load, other work pushes half of the prefix out of the host tier.
    insert(stack, list(range(2000, 2016)), seed=10)
    stack.cache.connector.flush(timeout=30)
    free_before = stack.allocator.available_size()
    assert load_back(stack, req) == (0, req.best_match_node)
    assert stack.allocator.available_size() == free_before  # nothing leaked


def test_priority_below_threshold_is_not_offloaded(stack_factory):
    stack = stack_factory(min_offload_priority=50)
    insert(stack, list(range(16)), seed=11, priority=10)
    insert(stack, list(range(100, 116)), seed=12, priority=60)
    stack.cache.connector.flush(timeout=30)
    assert stack.manager.counts()[0].blocks == 4


def test_reset_discards_copies_in_flight(stack_factory):
    stack = stack_factory(gated=True, events=True)
    insert(stack, list(range(32)), seed=13)
    stack.cache.reset()
    stack.allocator.clear()
    stack.executor.gate.set()
    stack.cache.connector.flush(timeout=30)
    assert stack.manager.counts()[0].blocks == 0
    assert stack.manager.host.free_rows() == stack.manager.host.capacity
    events = stack.cache.take_events()
    assert not [e for e in events if getattr(e, "medium", None) == "CPU_PINNED"]
    assert stack.cache.protected_size() == 0


def test_random_workload_accounts_for_every_page(stack_factory):
    """After many inserts, evictions, host hits and loads, nothing is leaked in either tier."""
    rng = random.Random(0)
    stack = stack_factory(size=128, host_blocks=48)
    prompts = [[rng.randrange(0, 4000) for _ in range(rng.choice([8, 16, 24, 40]))] for _ in range(12)]
    loads = 0
    for step in range(120):
        tokens = rng.choice(prompts)
        req = make_req(tokens + [1], rid=f"w{step}")
        match_kv_cache(req, stack.cache)
        prefix = stack.cache.path_device_indices(req.last_node)[: req.prefix_len]
        lock = stack.cache.lock(req.last_node)
        if req.host_hit_length:
            result = load_back(stack, req)
            if result is not None and result[0]:
                loads += 1
                stack.cache.unlock(lock)
                lock = stack.cache.lock(result[1])
                prefix = stack.cache.path_device_indices(result[1])
        need = len(tokens) - len(prefix)
        need -= need % stack.page_size
        if need and stack.allocator.available_size() < need:
            stack.cache.evict(EvictParams(num_tokens=need))
        fresh = stack.allocator.alloc(need) if need else torch.empty(0, dtype=torch.int64)
        if fresh is None:
            stack.cache.unlock(lock)
            continue
        stack.write_random(fresh, step)
        key_len = len(prefix) + need
        values = torch.cat([prefix.to(torch.int64), fresh.to(torch.int64)])
        stack.cache.insert(InsertParams(key=RadixKey(array("q", tokens[:key_len])), value=values))
        stack.cache.unlock(lock)
        if rng.random() < 0.3:
            stack.cache.evict(EvictParams(num_tokens=rng.choice([8, 32, 64])))
    assert loads > 0

    assert stack.cache.connector.flush(timeout=30)
    assert stack.cache.protected_size() == 0
    evict_all(stack)
    assert stack.allocator.available_size() == stack.size
    host = stack.manager.host
    assert len(host) + host.free_rows() == host.capacity
    assert stack.cache.connector.counts()[0].blocks == 0  # no device block outlives its page
