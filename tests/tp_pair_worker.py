"""One rank of a tensor-parallel pair, for tests/test_tp_pair.py (run as a script, two processes).

SGLang does not start a TP=2 server on CPU (its model-parallel set-up builds pynccl
on CUDA torch builds), so this drives what SGLang's wrapper does across ranks for
real: two processes, a gloo group as the attention-TP group, each rank's own pools,
tree and KvbmLinker, each rank's own KV shard (different bytes per rank).
"""

import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))

from conftest import Stack  # noqa: E402


def main(rank: int, port: int, out: str, disk_root: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    group = dist.group.WORLD
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

    from sglang_kvbm.config import KvbmConfig
    from sglang_kvbm.integration.sglang.custom import build_cache

    size, ps = 64, 4
    kvcache = MHATokenToKVPool(size, ps, torch.float32, 2, 8, 2, "cpu", False)  # this rank's 2 heads
    allocator = PagedTokenToKVPoolAllocator(size, ps, kvcache.dtype, "cpu", kvcache, need_sort=False)
    params = CacheInitParams(
        disable=False,
        req_to_token_pool=ReqToTokenPool(size=8, max_context_len=4096, device="cpu", enable_memory_saver=False),
        token_to_kv_pool_allocator=allocator, page_size=ps, tp_cache_group=group, attn_tp_cache_group=group,
        enable_kv_cache_events=rank == 0,  # as SGLang's scheduler sets it: attention-TP rank 0 publishes
    )
    config = KvbmConfig(cpu_cache_blocks=64, disk_cache_blocks=64, disk_cache_dir=disk_root,
                        disable_disk_offload_filter=True)
    stack = Stack(build_cache(params, config), allocator, kvcache, None, ps, size)
    tokens = list(range(100, 132))  # 8 pages
    written = stack.insert(tokens, seed=1 + 1000 * rank)  # each rank's own shard of the KV
    stack.settle()
    stack.evict_all()
    ids = stack.block_ids(tokens)
    if rank == 1:  # rank 1's host and disk lost the last 3 pages: the ranks now disagree
        stack.manager.host.remove(ids[5:])
        stack.manager.disk.invalidate(ids[5:], reason="test")
    local = stack.linker.connector.peek(ids)
    stack.scramble_pool()
    req, match, loaded, slots, _ = stack.admit(tokens + [7])
    landed = stack.finish(req) if loaded else False
    got = stack.read_pages(slots) if slots is not None else []
    result = {
        "rank": rank,
        "local_hit": local,
        "host_hit_length": match.host_hit_length,
        "loaded": loaded,
        "landed": landed,
        "bytes_ok": len(got) == loaded // ps and all(torch.equal(g, w) for g, w in zip(got, written)),
        "disk_dir": str(stack.manager.disk.directory),
        "events": len(stack.tree.take_events()),
    }
    with open(out, "w") as f:
        json.dump(result, f)
    stack.cache.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
