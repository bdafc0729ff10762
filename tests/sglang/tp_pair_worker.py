"""One rank of a tensor-parallel pair, for tests/sglang/test_tp_pair.py (run by ``rank_pair.py``, two processes).

SGLang does not start a TP=2 server on CPU (its model-parallel set-up builds pynccl
on CUDA torch builds), so this drives what SGLang's wrapper does across ranks for
real: two processes, a gloo group as the attention-TP group, each rank's own pools,
tree and KvbmLinker, each rank's own KV shard (different bytes per rank).

Each scenario gets a fresh stack and disk directory; what it found goes to the
rank's JSON file.
"""

import os
import sys
from array import array

import torch

from sglang_kvbm.manager import lookups

sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)), os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]  # its folder, tests/

from conftest import GatedLanes, Stack, make_req  # noqa: E402
from harness.disk import data_offset, flip_bit, segment_path  # noqa: E402

SIZE, PAGE = 64, 4


def build(rank: int, group, disk_dir: str, reader=None) -> Stack:
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

    from sglang_kvbm.config import KvbmConfig
    from sglang_kvbm.integration.sglang.custom import build_cache

    kvcache = MHATokenToKVPool(SIZE, PAGE, torch.float32, 2, 8, 2, "cpu", False)  # this rank's 2 heads
    allocator = PagedTokenToKVPoolAllocator(SIZE, PAGE, kvcache.dtype, "cpu", kvcache, need_sort=False)
    params = CacheInitParams(
        disable=False,
        req_to_token_pool=ReqToTokenPool(size=8, max_context_len=4096, device="cpu", enable_memory_saver=False),
        token_to_kv_pool_allocator=allocator, page_size=PAGE, tp_cache_group=group, attn_tp_cache_group=group,
        enable_kv_cache_events=rank == 0,  # as SGLang's scheduler sets it: attention-TP rank 0 publishes
    )
    config = KvbmConfig(cpu_cache_blocks=64, disk_cache_blocks=64, disk_cache_dir=disk_dir,
                        disable_disk_offload_filter=True)
    return Stack(build_cache(params, config, disk_reader=reader), allocator, kvcache, None, PAGE, SIZE)


def admit(stack: Stack, tokens, rid: str, between=None) -> dict:
    """The scheduler's admission (match, then load back), the forward's wait, and what landed."""
    from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    stack.scramble_pool()
    req = make_req(tokens, rid)
    usable = (len(tokens) - 1) // PAGE * PAGE
    match = stack.tree.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens[:usable])), req=req))
    req.last_node = match.last_device_node
    if between is not None:
        between()
    loaded, landed, slots = 0, False, None
    if match.host_hit_length:
        loaded, _ = stack.tree.init_load_back(InitLoadBackParams(
            best_match_node=match.best_match_node, host_hit_length=match.host_hit_length, req=req))
        if loaded:
            slots = stack.tree.linker.private_load_indices[rid].clone()
            stack.tree.ready_to_load_host_cache()
            landed = stack.finish(req)
    return {"hit": match.host_hit_length, "loaded": loaded, "landed": landed,
            "pages": [p.tolist() for p in stack.read_pages(slots)] if slots is not None else []}


def on_disk_only(stack: Stack, tokens, rank: int) -> list:
    written = stack.insert(tokens, seed=1 + 1000 * rank)  # each rank's own shard of the KV
    stack.settle()
    stack.evict_all()
    stack.manager.host.remove(stack.block_ids(tokens))
    return [w.tolist() for w in written]


def disagree(rank, group, root):
    """Rank 1's tiers lost the last 3 pages: SGLang's intersection makes both load the 5 both hold."""
    return disagree_on(build(rank, group, f"{root}/disagree"), rank)


def disagree_on(stack, rank, **extra):
    """8 pages stored on every rank (or stage), the last 3 lost on rank 1; what each then loads."""
    tokens = list(range(100, 132))  # 8 pages
    written = stack.insert(tokens, seed=1 + 1000 * rank)  # each rank's own shard (each stage's own layers)
    stack.settle()
    stack.evict_all()
    ids = stack.block_ids(tokens)
    if rank == 1:
        stack.manager.host.remove(ids[5:])
        stack.manager.tiers["disk"].store.invalidate(ids[5:], reason="test")
    local = stack.linker.connector.peek(ids)
    got = admit(stack, tokens + [7], "r")
    result = {"local_hit": local, **got, "written": [w.tolist() for w in written],
              "disk_dir": str(stack.manager.tiers["disk"].store.directory), **extra, "events": len(stack.tree.take_events())}
    stack.cache.close()
    return result


def corrupt(rank, group, root):
    """A bit flipped in rank 1's copy of page 3: rank 1 cannot load what rank 0 can."""
    stack = build(rank, group, f"{root}/corrupt")
    tokens = list(range(200, 232))
    written = on_disk_only(stack, tokens, rank)
    if rank == 1:
        victim = stack.block_ids(tokens)[3]
        flip_bit(segment_path(stack.manager.tiers["disk"].store, victim), data_offset(stack.manager.tiers["disk"].store, victim) + 9)
    first = admit(stack, tokens + [7], "first")
    second = admit(stack, tokens + [7], "second")  # rank 1 dropped page 3: both load the 3 pages before it
    stack.cache.close()
    return {"first": first, "second": second, "written": written}


def slow_read(rank, group, root):
    """Rank 1's disk is stuck far past what its read meter expects: it gives up, so both recompute."""
    reader = GatedLanes("kvbm-test-disk-read") if rank == 1 else None
    stack = build(rank, group, f"{root}/slow", reader)
    tokens = list(range(300, 316))
    written = on_disk_only(stack, tokens, rank)
    meter = stack.linker.policy.read
    meter.keep_since(meter.recorded)  # only this estimate counts
    meter.record(1 << 20, 1e-3)
    if reader is not None:
        reader.submit(lambda: None)
        reader.wait_held()
    floor, lookups.WAIT_FLOOR_S = lookups.WAIT_FLOOR_S, 0.05  # the live budget (rank_pair.main raised it)
    try:
        first = admit(stack, tokens + [7], "first")
    finally:
        lookups.WAIT_FLOOR_S = floor
    if reader is not None:
        reader.open()
    stack.settle()
    second = admit(stack, tokens + [7], "second")
    stack.cache.close()
    return {"first": first, "second": second, "written": written}


def staging_race(rank, group, root):
    """Between rank 1's lookup and its load, its staged copy and its disk copy of page 1 go."""
    return race_on(build(rank, group, f"{root}/race"), rank)


def race_on(stack, rank):
    """Page 1 goes from rank (or stage) 1's staging and disk between its lookup and its load: both recompute."""
    tokens = list(range(400, 416))
    written = on_disk_only(stack, tokens, rank)
    victim = stack.block_ids(tokens)[1]

    def lose_page_1():
        if rank == 1:
            stack.manager.wait(timeout=30)
            stack.linker.connector.poll()  # the lookup's read staged it (no collective: rank 1 only)
            stack.manager.staging.pool.remove([victim])
            stack.manager.tiers["disk"].store.invalidate([victim], reason="test")

    first = admit(stack, tokens + [7], "first", between=lose_page_1)
    second = admit(stack, tokens + [7], "second")
    stack.cache.close()
    return {"first": first, "second": second, "written": written}


SCENARIOS = (disagree, corrupt, slow_read, staging_race)
