"""SGLang 0.5.23's HiCache (the default tree with its host tier) in this process on CPU, driven as its scheduler does.

The peer row of ``critical_path.py``: ``UnifiedRadixCache.init_hicache(server_args, params)``
builds HiCache's host pool and controller on the tree; the CPU patches are
``hicache_cpu/sitecustomize.py``'s (no page-locking, a pure-torch
``transfer_kv_direct``, no-op CPU stream sync, a dummy page without
``pin_memory``), with ``--hicache-io-backend direct --hicache-mem-layout
layer_first --hicache-write-policy write_through``. No L3, so it starts no threads.

On CPU, HiCache's copies run synchronously inside the calls that start them
(``ready_to_load_host_cache`` for loads, ``flush_pending_backups`` for write-through;
CPU events are always done), where on a GPU they are kernels on a side stream.
Their time is measured (the patched ``transfer_kv_direct``) and reported apart:
the comparable figure is the calls' time without it. The linker's copies run on
its worker threads and are not in its calls either.
"""

from __future__ import annotations

import atexit
import time
from array import array

import torch
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InitLoadBackParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.sampling.sampling_params import SamplingParams

COPIES = {"seconds": 0.0}


def _transfer_kv_direct(src_layers, dst_layers, src_indices, dst_indices, page_size=None, **_):
    started = time.perf_counter()
    src_indices = src_indices.to(device="cpu", dtype=torch.int64)
    dst_indices = dst_indices.to(device="cpu", dtype=torch.int64)
    for src, dst in zip(src_layers, dst_layers):
        dst.index_copy_(0, dst_indices, src.index_select(0, src_indices))
    COPIES["seconds"] += time.perf_counter() - started


def patch_for_cpu() -> None:
    import sglang.srt.mem_cache.pool_host.common as common
    import sglang.srt.mem_cache.pool_host.mha as mha

    common._cuda_host_register = lambda *args, **kwargs: None
    mha.transfer_kv_direct = _transfer_kv_direct
    torch.cpu.Stream.synchronize = lambda self: None
    mha.MHATokenToKVPoolHost.get_dummy_flat_data_page = lambda self: torch.zeros(
        (2, self.layer_num, self.page_size, self.head_num, self.head_dim), dtype=self.dtype, device=self.device
    ).flatten()


def build(params, pool_tokens: int, host_tokens: int):
    """HiCache on ``params`` (a ``CacheInitParams`` with the FULL component): the tree, its controller built."""
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
    from sglang.srt.runtime_context import publish
    from sglang.srt.server_args import ServerArgs

    patch_for_cpu()
    server_args = ServerArgs(model_path="dummy", device="cpu", enable_hierarchical_cache=True,
                             hicache_io_backend="direct", hicache_mem_layout="layer_first",
                             hicache_write_policy="write_through", hicache_ratio=host_tokens / pool_tokens)
    publish(server_args, role="scheduler")  # init_hicache and the host pool read get_memory(); the last publish wins
    cache = UnifiedRadixCache(params)
    cache.init_hicache(server_args, params)
    params.token_to_kv_pool_allocator.get_kvcache().register_layer_transfer_counter(
        cache.cache_controller.layer_done_counter)  # as the server does; the forward would wait on it
    return cache


def close(cache) -> None:
    from sglang.srt.runtime_context import publish
    from sglang.srt.server_args import ServerArgs

    cache.check_hicache_events()
    cache.shutdown()
    cache.release_host_resources()
    atexit.unregister(cache.shutdown)  # init_hicache's hook would keep the host pool alive
    publish(ServerArgs(model_path="dummy", device="cpu"), role="tokenizer")  # the next cache is built plainly


def steps(cache, allocator, requests, page: int, spent: dict[str, float]):
    """``critical_path.steps``' trace with HiCache's calls, a request each ``next`` (``critical_path.lockstep``);
    ``spent`` is complete when it is exhausted: ``load_wait`` is the load's finish event, ``copies`` the copies that
    ran inside the timed calls."""
    copies_before = COPIES["seconds"]

    def timed(name, fn, *args):
        start = time.perf_counter()
        result = fn(*args)
        spent[name] += time.perf_counter() - start
        return result

    hits = {"device": 0, "host": 0}
    counter = cache.cache_controller.layer_done_counter
    for i, tokens in enumerate(requests):
        yield
        timed("check_hicache_events", cache.check_hicache_events)  # writing_check, loading_check
        req = Req(f"r{i}", "", array("q", tokens), SamplingParams(max_new_tokens=1))
        result = timed("match_prefix", cache.match_prefix,
                       MatchPrefixParams(key=RadixKey(array("q", tokens), limit=len(tokens) - 1), req=req))
        node, prefix_len = result.last_device_node, result.device_prefix_len
        hits["device"] += prefix_len
        locks = [(node, timed("lock", cache.inc_lock_ref, node).to_dec_params())]
        if result.host_hit_length:
            req.last_node = node
            loaded, new_node = timed("init_load_back", cache.init_load_back, InitLoadBackParams(
                best_match_node=result.best_match_node, host_hit_length=result.host_hit_length, req=req))
            if loaded:
                consumer = timed("ready_to_load", cache.ready_to_load_host_cache)
                start = time.perf_counter()
                counter.events[consumer].finish_event.synchronize()
                spent["finish_loads_wait"] += time.perf_counter() - start
                locks.append((new_node, timed("lock", cache.inc_lock_ref, new_node).to_dec_params()))
                node, prefix_len = new_node, prefix_len + loaded  # loaded slots are the tree's already
                hits["host"] += loaded
        prefix = cache.path_device_indices(node)[:prefix_len]
        need = len(tokens) // page * page - prefix_len
        if need > 0:
            if allocator.available_size() < need:
                timed("evict", cache.evict, EvictParams(num_tokens=need - allocator.available_size()))
            fresh = allocator.alloc(need)
            if fresh is None:
                for n, lock in reversed(locks):
                    timed("unlock", cache.dec_lock_ref, n, lock)
                continue
            prefix = torch.cat([prefix.to(torch.int64), fresh.to(torch.int64)])
        timed("insert", cache.insert, InsertParams(
            key=RadixKey(array("q", tokens[: len(prefix)])), value=prefix, prev_prefix_len=prefix_len))
        timed("flush_backups", cache.flush_pending_backups)  # the scheduler submits write-through after a batch
        for n, lock in reversed(locks):
            timed("unlock", cache.dec_lock_ref, n, lock)
        timed("take_events", cache.take_events)
    spent["copies"] = COPIES["seconds"] - copies_before
    spent["total"] = sum(v for k, v in spent.items() if k not in ("finish_loads_wait", "copies")) - spent["copies"]
    spent["device_hit_tokens"] = hits["device"]
    spent["host_hit_tokens"] = hits["host"]
