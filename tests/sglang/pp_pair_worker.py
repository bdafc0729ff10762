"""One stage of a pipeline-parallel pair, for tests/sglang/test_pp_pair.py (run by ``rank_pair.py``, two processes).

SGLang does not start a PP=2 server on CPU (its model-parallel set-up builds pynccl
on CUDA torch builds), so this drives what every PP stage's scheduler does for
real: two processes, a gloo group as the PP group (``pp_cache_group``, as SGLang
passes its PP group's CPU group), no TP, each stage its own layers' pool
(``start_layer`` 0 and 2), tree, KvbmLinker, tiers and disk directory. Each stage
runs the same admissions in the same order, as SGLang's PP schedulers do.

SGLang reduces linker answers over the attention TP/CP groups only, so nothing
but the linker can make the stages agree.
"""

import os
import sys
from pathlib import Path

import torch

sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)), os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]  # its folder, tests/

from tp_pair_worker import admit, disagree_on, race_on  # noqa: E402

from conftest import GatedExecutor, Stack  # noqa: E402

SIZE, PAGE, LAYERS = 64, 4, 2


def build(stage: int, group, disk_dir: str, executor=None) -> Stack:
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

    from sglang_kvbm.config import KvbmConfig
    from sglang_kvbm.integration.sglang.custom import build_cache

    first = stage * LAYERS  # this stage's layers, as SGLang's PP model runner sizes its pool
    kvcache = MHATokenToKVPool(SIZE, PAGE, torch.float32, 2, 8, LAYERS, "cpu", False,
                               start_layer=first, end_layer=first + LAYERS - 1)
    allocator = PagedTokenToKVPoolAllocator(SIZE, PAGE, kvcache.dtype, "cpu", kvcache, need_sort=False)
    params = CacheInitParams(
        disable=False,
        req_to_token_pool=ReqToTokenPool(size=8, max_context_len=4096, device="cpu", enable_memory_saver=False),
        token_to_kv_pool_allocator=allocator, page_size=PAGE, pp_cache_group=group, pp_rank=stage, pp_size=2,
        enable_kv_cache_events=stage == 0,  # as SGLang's scheduler sets it: PP rank 0 publishes
    )
    config = KvbmConfig(cpu_cache_blocks=64, disk_cache_blocks=64, disk_cache_dir=disk_dir,
                        disable_disk_offload_filter=True)
    return Stack(build_cache(params, config, offload_executor=executor), allocator, kvcache, executor, PAGE, SIZE)


def disagree(stage, group, root):
    """Stage 1's tiers lost the last 3 of 8 pages: both stages must load the 5 both hold, or neither."""
    stack = build(stage, group, f"{root}/disagree")
    return disagree_on(stack, stage, start_layer=stack.kvcache.start_layer)


def staging_race(stage, group, root):
    """Between stage 1's lookup and its load, its staged and disk copies of page 1 go: both recompute."""
    return race_on(build(stage, group, f"{root}/race"), stage)


def failed_landing(stage, group, root):
    """Stage 1's copy of layer 1 fails after both stages queued the load: both drop the request, not stage 1 alone."""
    stack = build(stage, group, f"{root}/landing")
    tokens = list(range(600, 616))
    written = stack.insert(tokens, seed=1 + 1000 * stage)
    stack.settle()
    stack.evict_all()

    def copy_fails(index, layer):  # the loader's own hook, run on its thread before each layer
        if layer == 1:
            raise RuntimeError("test: a layer's copy failed")

    stack.linker.loader.before_layer = copy_fails if stage == 1 else None
    first = admit(stack, tokens + [7], "first")
    stack.linker.loader.before_layer = None
    second = admit(stack, tokens + [7], "second")
    stack.cache.close()
    return {"first": first, "second": second, "written": [w.tolist() for w in written]}


def swa_window(stage, group, root):
    """A sliding-window hybrid: stage 1 lost the window page of the last boundary; both serve the one before it."""
    from sglang.test.kits.unified_radix_cache import fixtures

    from harness import hybrid

    kit = fixtures.build_fixture

    def as_stage(*args, **kwargs):  # SGLang's test kit knows no PP: give its params what kv_cache_builder passes
        cache, allocator, r2t = kit(*args, **kwargs)
        params = cache.cache_init_params
        params.pp_cache_group, params.pp_rank, params.pp_size = group, stage, 2
        return cache, allocator, r2t

    fixtures.build_fixture = as_stage
    try:
        h = hybrid.build("swa", Path(root) / f"swa{stage}", window=3, host_blocks=0, disk_blocks=256)
    finally:
        fixtures.build_fixture = kit
    tokens = list(range(1000, 1007))  # 6 pages of one token, and the one computed
    slots = hybrid.admit(h, tokens).slots
    kv, swa = hybrid.kv_bytes(h, slots), hybrid.swa_bytes(h, slots)
    h.evict_device()
    if stage == 1:
        h.linker.sidecars.managers["swa"].tiers["disk"].store.invalidate([_page_keys(tokens[:6])[-1]], reason="test")
    again = hybrid.admit(h, tokens, compute=False)
    served = again.loaded_tokens
    window = slice(served - 3, served)  # the sliding window of the boundary served
    same = served > 0 and hybrid.equal(hybrid.kv_bytes(h, again.loaded_slots), [b[:served] for b in kv]) and (
        hybrid.equal(hybrid.swa_bytes(h, again.loaded_slots[window]), [b[window] for b in swa]))
    h.linker.close()
    return {"hit": again.tier_tokens, "loaded": served, "failed": again.failed, "bytes_equal": same}


def _page_keys(tokens) -> list:
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    return get_storage_hash_str(tokens, None, page_size=1)


def slow_offload(stage, group, root):
    """Stage 1's copy of a node is still running when stage 0's has ended: neither tree unlocks it yet."""
    executor = GatedExecutor() if stage == 1 else None
    stack = build(stage, group, f"{root}/offload", executor)
    stack.insert(list(range(500, 516)), seed=1 + 1000 * stage)
    if stage == 0:
        assert stack.linker.connector.flush(timeout=60)  # this stage's copy ended (nothing handed to the tree)
    local = stack.linker.connector.completed_offloads()
    stack.tree.check_hicache_events()  # the scheduler's per-step poll, on both stages
    held = len(stack.tree.linker.pending_offloads)
    if executor is not None:
        executor.gate.set()
    stack.settle()
    after = len(stack.tree.linker.pending_offloads)
    stack.cache.close()
    return {"local_done": local, "pending_while_one_copies": held, "pending_after": after}


SCENARIOS = (disagree, staging_race, failed_landing, swa_window, slow_offload)
