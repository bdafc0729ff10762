"""KvbmLinker on SGLang's default tree (UnifiedRadixCache, Rust core) over real pools on CPU (no server).

Each test drives the tree the way SGLang's scheduler does: insert (the write-through
offloads new nodes), ``check_hicache_events`` (finished offloads unlock their nodes),
``match_prefix`` with a request (lookup), ``init_load_back`` (load), then the
layer-wise load and its finish around the forward. Bytes are random and checked
page by page.
"""

from __future__ import annotations

import time
from array import array

import pytest
import torch
from sglang.srt.disaggregation.kv_events import BlockRemoved, BlockStored

from conftest import chain_links, needs, needs_refusable_loads
from sglang_kvbm.integration.sglang.compat import device_prefix_len, event_lora_name, lora_name_table


def medium(event) -> str:
    value = getattr(event, "medium", None)
    return getattr(value, "value", value) or "GPU"


def stores(events, tier: str):
    return [e for e in events if isinstance(e, BlockStored) and medium(e) == tier]


@pytest.mark.parametrize("pool", ["mha", "mla", "fp8", "fp4", "nvfp4"])
def test_bytes_come_back_after_device_eviction(stack_factory, pool):
    """Every buffer of a page comes back: K and V (or MLA's latent), and a quantized pool's per-token scales."""
    stack = stack_factory(pool=pool)
    tokens = list(range(100, 132))  # 8 pages
    written = stack.insert(tokens, seed=1)
    stack.settle()
    assert stack.host_blocks() == 8
    assert stack.evict_all() == 32
    stack.scramble_pool()

    req, match, loaded, slots, index = stack.admit(tokens + [7])
    assert (device_prefix_len(match), match.host_hit_length, loaded) == (0, 32, 32)
    assert index >= 0
    assert stack.finish(req)
    for got, want in zip(stack.read_pages(slots), written):
        assert torch.equal(got, want)
    assert stack.linker.connector.stats.onboard_blocks_h2d == 8


def test_host_hit_extends_a_partial_device_match(stack_factory):
    stack = stack_factory()
    prefix, tail = list(range(16)), list(range(500, 516))
    written = stack.insert(prefix + tail, seed=2)
    stack.settle()
    stack.insert_tail(prefix, list(range(900, 904)), seed=3)  # another leaf under the same prefix, used later
    stack.settle()
    assert stack.evict(16) == 16  # the least recently used leaf: the original tail
    req, match, loaded, slots, _ = stack.admit(prefix + tail + [1])
    assert (device_prefix_len(match), match.host_hit_length, loaded) == (16, 16, 16)
    assert stack.finish(req)
    for got, want in zip(stack.read_pages(slots), written[4:]):
        assert torch.equal(got, want)


def test_a_node_is_locked_while_its_copy_reads_it(stack_factory):
    stack = stack_factory(gated=True)
    tokens = list(range(32))
    written = stack.insert(tokens, seed=4)
    stack.cache.poll()
    assert stack.tree.protected_size() == 32  # the write-through holds the node until its copy completes
    assert stack.evict_all() == 0

    stack.executor.gate.set()
    stack.settle()
    assert stack.tree.protected_size() == 0
    assert stack.evict_all() == 32
    stack.scramble_pool()
    req, _, loaded, slots, _ = stack.admit(tokens + [1])
    assert loaded == 32 and stack.finish(req)
    assert all(torch.equal(g, w) for g, w in zip(stack.read_pages(slots), written))


def test_blocks_are_invisible_and_unannounced_until_their_copy_completes(stack_factory):
    stack = stack_factory(gated=True, events=True)
    tokens = list(range(16))
    stack.insert(tokens, seed=5)
    stack.cache.poll()
    assert stack.linker.connector.peek(stack.block_ids(tokens)) == (0, 0)
    assert not stores(stack.tree.take_events(), "CPU_PINNED")
    stack.executor.gate.set()
    stack.settle()
    assert stack.linker.connector.peek(stack.block_ids(tokens)) == (4, 4)
    assert sum(len(e.block_hashes) for e in stores(stack.tree.take_events(), "CPU_PINNED")) == 4


def test_host_events_reuse_gpu_block_ids_and_parent_chain(stack_factory):
    stack = stack_factory(events=True, host_blocks=8)
    first, second = list(range(32)), list(range(1000, 1032))
    stack.insert(first, seed=6)
    stack.settle()
    stack.insert(second, seed=7)  # 8 more blocks: the host tier (8) evicts all of `first`
    stack.settle()
    events = stack.tree.take_events()
    gpu, cpu = stores(events, "GPU"), stores(events, "CPU_PINNED")
    removed = [e for e in events if isinstance(e, BlockRemoved) and medium(e) == "CPU_PINNED"]
    assert chain_links(cpu) == chain_links(gpu)  # same ids, same parents, same order
    assert all(e.block_size == 4 and len(e.token_ids) == 4 * len(e.block_hashes) for e in cpu)
    assert [t for e in cpu for t in e.token_ids] == first + second
    first_ids = [h for _, h in chain_links(gpu)[:8]]
    assert sorted(h for e in removed for h in e.block_hashes) == sorted(first_ids)
    seen = set()
    for event in events:  # every store comes after a store (in some tier) of its parent
        if isinstance(event, BlockStored):
            assert event.parent_block_hash is None or event.parent_block_hash in seen
            seen.update(event.block_hashes)


LORA_ID = "a" * 32


@pytest.mark.parametrize("dynamo_format", [False, pytest.param(True, marks=needs("event_dynamo_format"))])
@pytest.mark.parametrize(
    "cache_salt,extra_key",
    [(None, None), ("tenant-a", None), (None, "user-key"), (None, "x" + LORA_ID), ("tenant-a", "x" + LORA_ID)],
)
def test_lower_tier_events_match_the_trees_own_for_every_namespace(stack_factory, dynamo_format, cache_salt, extra_key):
    names = lora_name_table()  # None where events carry no adapter names (0.5.21): the rest is compared all the same
    if names is not None:
        names.register(lora_id=LORA_ID, lora_name="adapter-a")
    stack = stack_factory(events=True, dynamo_format=dynamo_format, lora_names=names)
    prefix, tail = list(range(300, 316)), list(range(700, 712))
    stack.insert(prefix, seed=8, cache_salt=cache_salt, extra_key=extra_key)
    stack.settle()
    hit = stack.cache.prefix(prefix + tail + [1], cache_salt=cache_salt, extra_key=extra_key)
    assert hit.device_tokens == 16
    slots = stack.allocator.alloc(len(tail))
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    key = RadixKey(array("q", prefix + tail), extra_key, cache_salt=cache_salt)
    stack.tree.insert(InsertParams(key=key, value=torch.cat([hit.indices, slots.to(torch.int64)]),
                                   prev_prefix_len=len(hit.indices)))
    stack.cache.release(hit)
    stack.settle()
    events = stack.tree.take_events()
    gpu, cpu = stores(events, "GPU"), stores(events, "CPU_PINNED")
    assert chain_links(cpu) == chain_links(gpu) and len(chain_links(cpu)) == 7
    assert [(e.cache_salt, event_lora_name(e)) for e in cpu] == [(e.cache_salt, event_lora_name(e)) for e in gpu]


def test_cache_salt_never_shares_blocks(stack_factory):
    stack = stack_factory()
    tokens = list(range(64, 96))
    stack.insert(tokens, seed=8, cache_salt="tenant-a")
    stack.settle()
    stack.evict_all()
    assert stack.admit(tokens + [1], "b", cache_salt="tenant-b")[1].host_hit_length == 0
    assert stack.admit(tokens + [1], "plain")[1].host_hit_length == 0
    req, match, loaded, _, _ = stack.admit(tokens + [1], "a", cache_salt="tenant-a")
    assert match.host_hit_length == 32 and loaded == 32 and stack.finish(req)


@needs_refusable_loads  # on SGLang 0.5.21 the lookup pins instead: test_lookup_pins.py
def test_load_is_refused_when_host_lost_blocks_between_lookup_and_load(stack_factory):
    from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    from conftest import make_req

    stack = stack_factory(host_blocks=8)
    tokens = list(range(32))
    stack.insert(tokens, seed=9)
    stack.settle()
    stack.evict_all()
    req = make_req(tokens + [1])
    match = stack.tree.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens)), req=req))
    assert match.host_hit_length == 32
    stack.insert(list(range(2000, 2016)), seed=10)  # other work pushes half of the prefix out of the host tier
    stack.settle()
    free_before = stack.allocator.available_size()
    req.last_node = match.last_device_node
    loaded, _ = stack.tree.init_load_back(
        InitLoadBackParams(best_match_node=match.best_match_node, host_hit_length=32, req=req))
    assert loaded == 0  # the request recomputes
    assert stack.allocator.available_size() == free_before  # nothing leaked
    assert stack.linker.connector.stats.failed_loads == 1


def test_low_priority_prefix_then_high_priority_extension_are_both_reachable(stack_factory):
    stack = stack_factory(min_offload_priority=50)
    prefix, tail = list(range(16)), list(range(400, 416))
    stack.insert(prefix, seed=11, priority=10)  # below the threshold: not offloaded
    stack.settle()
    assert stack.host_blocks() == 0
    stack.insert_tail(prefix, tail, seed=12)  # the extension's insert carries priority 0 here ...
    stack.settle()
    assert stack.host_blocks() == 0  # ... still below: neither is stored
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    hit = stack.cache.prefix(prefix + tail + [1])
    stack.tree.insert(InsertParams(key=RadixKey(array("q", prefix + tail)), value=hit.indices, priority=60,
                                   prev_prefix_len=len(hit.indices)))
    stack.cache.release(hit)
    stack.settle()
    assert stack.linker.connector.peek(stack.block_ids(prefix + tail)) == (8, 8)  # both, reachable


def test_a_block_whose_parent_is_held_nowhere_below_is_not_kept(stack_factory):
    stack = stack_factory(host_blocks=4, events=True)
    prefix, tail = list(range(16)), list(range(600, 616))
    stack.insert(prefix, seed=13)
    stack.settle()
    assert stack.linker.connector.peek(stack.block_ids(prefix)) == (4, 4)
    stack.insert_tail(prefix, tail, seed=14)  # room for the tail's 4 blocks: the prefix's 4 are evicted
    stack.settle()
    assert stack.linker.connector.peek(stack.block_ids(prefix + tail)) == (0, 0)
    assert stack.manager.offloads.stats.blocks_dropped_unreachable == 4
    assert stack.host_blocks() == 0 and stack.manager.host.accounting()["free"] == 4
    assert not stores(stack.tree.take_events(), "CPU_PINNED")[1:]  # the prefix's store only, never the tail's
    assert stack.linker.connector.stats.offloads_failed == 1  # the tree may offer the tail again


def test_reset_discards_copies_it_could_not_wait_for(stack_factory):
    stack = stack_factory(gated=True, events=True)
    stack.linker.quiesce_timeout = 0.0  # the copy outlasts the reset's wait (test_flush: the reset that waits)
    stack.insert(list(range(32)), seed=13)
    stack.tree.reset()
    stack.allocator.clear()
    stack.executor.gate.set()
    stack.settle()
    assert stack.host_blocks() == 0
    assert stack.manager.host.accounting()["free"] == stack.manager.host.capacity
    assert not stores(stack.tree.take_events(), "CPU_PINNED")
    assert stack.tree.protected_size() == 0


def test_prefix_under_pool_pressure_with_other_nodes_locked_returns_the_right_kv(stack_factory):
    """The custom-server prefix(): its load must make room by evicting while other prefixes are locked,
    and the slots it returns (device match + loaded tail) must hold this prefix's KV, nobody else's."""
    stack = stack_factory(size=64)
    mine, theirs, idle = list(range(16)), list(range(900, 932)), list(range(500, 508))
    head = stack.insert(mine[:8], seed=20)  # 2 pages stay on the device
    stack.settle()
    tail = stack.insert_tail(mine[:8], mine[8:], seed=21)
    stack.settle()
    assert stack.evict(8) == 8  # the tail leaves the device; the host holds it
    stack.insert(theirs, seed=22)  # another prefix, in use (locked) while this one loads
    stack.insert(idle, seed=23)  # an unlocked one: the only thing eviction may take
    stack.settle()
    held = stack.cache.prefix(theirs + [0])
    assert held.device_tokens == 32
    theirs_before = stack.read_pages(held.indices)
    stack.write_random(stack.allocator.alloc(stack.allocator.available_size()), seed=24)  # no free slot left
    hit = stack.cache.prefix(mine + [0])
    assert (hit.device_tokens, hit.loaded_tokens) == (8, 8)
    assert all(torch.equal(g, w) for g, w in zip(stack.read_pages(hit.indices), head + tail))
    assert all(torch.equal(g, w) for g, w in zip(stack.read_pages(held.indices), theirs_before))
    assert stack.cache.prefix(idle + [0]).device_tokens == 0  # what made the room
    stack.cache.release(hit)
    stack.cache.release(held)


def test_prefix_without_waiting_lets_the_forward_read_each_layer_as_it_lands(stack_factory):
    """``prefix(wait=False)``: the forward reads each layer through the pool (``get_key_buffer``, as SGLang's
    attention backends do), which waits for that layer alone; ``land`` then puts the pages in the tree."""
    stack = stack_factory(size=64, layers=4)
    tokens = list(range(3000, 3016))
    stack.insert(tokens[:8], seed=40)
    stack.settle()
    tail = stack.insert_tail(tokens[:8], tokens[8:], seed=41)
    stack.settle()
    assert stack.evict(8) == 8  # the tail leaves the device; the host holds it
    stack.scramble_pool()
    stack.linker.loader.before_layer = lambda index, layer: time.sleep(0.1) if layer else None  # layers land late
    hit = stack.cache.prefix(tokens + [0], wait=False)
    assert (hit.device_tokens, hit.loaded_tokens) == (8, 8) and hit.pending is not None
    loaded = hit.indices[8:]
    read = [stack.kvcache.get_key_buffer(layer)[loaded].view(torch.uint8).clone() for layer in range(4)]  # forward
    landed = stack.cache.land(hit)
    assert landed.pending is None and landed.loaded_tokens == 8
    assert all(torch.equal(g, w) for g, w in zip(stack.read_pages(landed.indices[8:]), tail))
    for layer, rows in enumerate(read):  # what each layer's read saw is what the load brought
        assert torch.equal(rows, stack.kvcache.get_key_buffer(layer)[landed.indices[8:]].view(torch.uint8)), layer
    assert stack.linker.layer_done_counter.consumer_index == -1
    stack.cache.release(landed)
    again = stack.cache.prefix(tokens + [0])  # the loaded pages are in the tree: a device hit now
    assert (again.device_tokens, again.loaded_tokens) == (16, 0)
    stack.cache.release(again)


def test_custom_insert_of_pages_cached_meanwhile_frees_each_duplicate_once(stack_factory):
    """SGLang's tree frees the duplicate values of an insert itself (``unified_tree_core`` ~1351): the custom
    server's insert must not free them again (a slot twice in the free list is two owners of one page)."""
    stack = stack_factory(size=64)
    tokens = list(range(700, 716))
    stack.insert(tokens, seed=30)
    available = stack.allocator.available_size()
    duplicate = stack.allocator.alloc(16)  # a second request computed the same pages meanwhile
    stack.cache.insert(tokens, duplicate)
    assert stack.allocator.available_size() == available
    free = stack.allocator.free_pages
    assert free.numel() == torch.unique(free).numel(), "a page is in the free list twice"


def test_the_cache_wrappers_reach_the_linker_through_its_methods_only():
    """``cache_wrappers`` brackets the insert, asks whether a load waits, reads the staged blocks and joins the
    events through the linker's methods, in the tree's own order, and touches nothing else of it (a linker with no other attribute serves)."""
    from types import SimpleNamespace

    from sglang_kvbm.integration.sglang.cache_wrappers import wrap_cache

    calls = []

    class PublicOnly:
        __slots__ = ()
        page_size = 4

        def begin_insert(self, key, priority):
            calls.append(("begin", key, priority))

        def end_insert(self):
            calls.append(("end",))

        def defers_load(self, rid):
            calls.append(("defers", rid))
            return rid == "waiting"

        def staged_blocks(self, rid):
            calls.append(("staged", rid))
            return 3

        def join_tier_events(self, events):
            calls.append(("join", events))
            return events + ["tier"]

    def insert(params):
        calls.append(("insert",))
        raise RuntimeError("the tree's insert failed")

    def init_load_back(params):
        calls.append(("load", params.req.rid if params.req else None))
        return "loaded"

    cache = SimpleNamespace(insert=insert, init_load_back=init_load_back, take_events=lambda: ["tree"])
    wrap_cache(PublicOnly(), cache)
    with pytest.raises(RuntimeError):
        cache.insert(SimpleNamespace(key="k", priority=None))
    req = SimpleNamespace(rid="r", storage_hit_length=0, storage_hit_start=5)
    assert cache.init_load_back(SimpleNamespace(req=req)) == "loaded"
    assert (req.storage_hit_length, req.storage_hit_start) == (12, None)
    assert cache.init_load_back(SimpleNamespace(req=None)) == "loaded"
    assert cache.init_load_back(SimpleNamespace(req=SimpleNamespace(rid="waiting"))) is None  # kept in the queue
    assert cache.take_events() == ["tree", "tier"]
    assert calls == [("begin", "k", None), ("insert",), ("end",), ("defers", "r"), ("load", "r"), ("staged", "r"),
                     ("load", None), ("defers", "waiting"), ("join", ["tree"])]


def test_a_scheduler_with_no_batch_waits_for_deferred_reads_and_other_linkers_pass_through():
    """``hooks``: before ``Scheduler.on_idle``, a KvbmLinker whose deferred requests wait for reads (SGLang 0.5.21)
    waits for the first of them; any other linker, or none, is not asked; SGLang's own idle work always runs."""
    from types import SimpleNamespace

    from sglang_kvbm.integration.sglang.hooks import _before_idle

    asked = []

    def scheduler(linker):
        return SimpleNamespace(tree_cache=SimpleNamespace(linker=SimpleNamespace(cache_linker=linker)))

    kvbm = scheduler(SimpleNamespace(wait_while_idle=lambda: asked.append("kvbm") or True))
    for s in (kvbm, scheduler(SimpleNamespace()), SimpleNamespace(tree_cache=None)):
        assert _before_idle(s) is None  # the arguments unchanged: SGLang's on_idle runs as it is
    assert asked == ["kvbm"]
