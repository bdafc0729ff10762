"""One rank of ``mla_tp.py`` (run by it as ``mla_tp.py --worker RANK``): SGLang's real MLA pool, tree and
linker in this process, and the peer linker and per-layer broadcast of the ``rank-0`` design."""

from __future__ import annotations

import datetime
import json
import os
import statistics
import time
from array import array
from collections import deque

from common import scratch_dir

KV_LORA_RANK, ROPE_DIM = 512, 64  # DeepSeek-V2/V3/R1, Kimi-K2
LATENT_BYTES = (KV_LORA_RANK + ROPE_DIM) * 2  # bf16, per token per layer


# -- one rank -------------------------------------------------------------------------------------------------------


def _peer_linker_class():
    import torch
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.mem_cache.unified_cache.unified_cache_linker import LayerWiseLoadCounter, UnifiedCacheLinker

    class PeerLinker(UnifiedCacheLinker):
        """A TP rank that holds no tiers: rank 0 stores, this rank receives loads by broadcast.

        Keeps every rank on the same branch: its lookup claims every length (the wrapper's MIN over a 0/1
        mask then equals rank 0's set), its load joins rank 0's verdict reduction (``KvbmLinker.load``), and
        ``finish_loads``' MIN carries rank 0's failure to it.
        """

        def __init__(self, kvcache, num_layers: int) -> None:
            self.pools = {PoolName.KV: kvcache}
            self.layer_done_counter = LayerWiseLoadCounter(num_layers)
            self.num_layers = num_layers
            self.cache = None
            self._queued: dict[str, object] = {}
            self._acks: deque = deque()

        def attach_kvbm(self, cache) -> None:  # sglang-kvbm's hook hands every linker that has it its tree
            self.cache = cache

        def lookup(self, rid, transfers):
            keys = next(t for t in transfers if t.name == PoolName.KV).keys or []
            return list(range(1, len(keys) + 1))

        def load(self, rid, transfers):
            flag = torch.tensor([1], dtype=torch.int)
            self.cache._all_reduce_attn_groups(flag, torch.distributed.ReduceOp.MIN)  # pairs rank 0's verdict
            if not flag[0]:
                return False
            self._queued[rid] = transfers
            return True

        def start_layer_wise_loading(self) -> int:
            if not self._queued:
                return -1
            self._queued = {}
            index = self.layer_done_counter.update_producer()
            for layer in range(self.num_layers):  # the bytes come by broadcast, on the forward's side of the wait
                self.layer_done_counter.complete(index, layer)
            return index

        def finish_layer_wise_loading(self, counter_index: int) -> bool:
            return self.layer_done_counter.finish(counter_index)

        def cancel_queued_load(self, rid) -> bool:
            return self._queued.pop(rid, None) is not None

        def offload(self, transfers, session_id=None) -> bool:
            self._acks.append(True)  # rank 0 stores it
            return True

        def num_completed_offloads(self) -> int:
            return len(self._acks)

        def pop_completed_offload(self) -> bool:
            return self._acks.popleft()

        def reset(self) -> None:
            self._queued.clear()
            self._acks.clear()
            self.layer_done_counter.reset()

        def close(self) -> None:
            self.reset()

    return PeerLinker


class Side:
    """One rank's stack for one mode: pool, allocator, tree, linker (KvbmLinker or PeerLinker)."""

    def __init__(self, rank: int, group, args, *, tiers: bool, host_blocks: int) -> None:
        import torch
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool, ReqToTokenPool
        from sglang.srt.mem_cache.unified_cache.components import ComponentType
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

        from sglang_kvbm import KvbmConfig
        from sglang_kvbm.integration.sglang.custom import build_cache

        self.size = args.pages * args.page_size + 4 * args.page_size
        self.layers = args.layers
        self.kvcache = MLATokenToKVPool(self.size, args.page_size, torch.bfloat16, KV_LORA_RANK, ROPE_DIM,
                                        args.layers, "cpu", False)
        self.allocator = PagedTokenToKVPoolAllocator(self.size, args.page_size, self.kvcache.dtype, "cpu",
                                                     self.kvcache, need_sort=False)
        params = CacheInitParams(
            disable=False,
            req_to_token_pool=ReqToTokenPool(size=8, max_context_len=self.size + 64, device="cpu",
                                             enable_memory_saver=False),
            token_to_kv_pool_allocator=self.allocator, page_size=args.page_size, tp_cache_group=group,
            attn_tp_cache_group=group, enable_kv_cache_events=False,
        )
        self.tiers = tiers
        if tiers:
            self.disk_dir = scratch_dir(f"kvbm-mla-tp{rank}-")
            config = KvbmConfig(cpu_cache_blocks=host_blocks, disk_cache_dir=self.disk_dir)
            self.cache = build_cache(params, config)
            self.tree, self.linker = self.cache.tree, self.cache.linker
        else:
            params.tree_components = (ComponentType.FULL,)
            self.tree = UnifiedRadixCache(params)
            self.linker = _peer_linker_class()(self.kvcache, args.layers)
            self.tree.init_cache_linker(self.linker)
            self.linker.cache = self.tree
            self.kvcache.register_layer_transfer_counter(self.linker.layer_done_counter)

    def host_bytes(self) -> int:
        if not self.tiers or self.linker.manager.host is None:
            return 0
        return len(self.linker.manager.host) * self.linker.layout.page_bytes

    def settle(self) -> None:
        """Every offload copied down (rank 0 / own tiers), then the tree's per-step poll (a collective)."""
        if self.tiers:
            assert self.linker.connector.flush(60), "offloads did not finish"
        self.tree.check_hicache_events()

    def close(self) -> None:
        if self.tiers:
            self.cache.close()  # flushes, then the tree's poll: a collective the peer pairs below
        else:
            self.tree.check_hicache_events()
            self.tree.release_host_resources()


def _latent(n_tokens: int, layers: int, seed: int):
    import torch

    gen = torch.Generator().manual_seed(seed)  # the same on every rank: MLA's latent is replicated
    return [torch.randn((n_tokens, 1, KV_LORA_RANK + ROPE_DIM), generator=gen).to(torch.bfloat16)
            for _ in range(layers)]


def run_round(side: Side, rank: int, group, broadcaster, tokens: list, latent, rid: str) -> dict:
    import torch
    import torch.distributed as dist
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InitLoadBackParams, InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.sampling.sampling_params import SamplingParams

    out = {}
    n = len(tokens)
    # A prefill wrote these pages (identical on every rank); the tree's write-through offers them to the linker.
    slots = side.allocator.alloc(n)
    assert slots is not None
    for layer in range(side.layers):
        side.kvcache.kv_buffer[layer][slots] = latent[layer]
    held = side.host_bytes()
    dist.barrier(group)
    start = time.perf_counter()
    side.tree.insert(InsertParams(key=RadixKey(array("q", tokens)), value=slots.to(torch.int64)))
    side.settle()
    out["offload_s"] = time.perf_counter() - start
    out["host_bytes"] = side.host_bytes() - held  # what this prefix added to the rank's host tier
    side.tree.evict(EvictParams(num_tokens=side.size))
    for layer in range(side.layers):  # garbage where the load will land: a load that did nothing cannot pass
        side.kvcache.kv_buffer[layer].fill_(-3.0)

    # Admission (match: lookup + SGLang's intersection; load back: our load + its verdict), then the forward.
    dist.barrier(group)
    start = time.perf_counter()
    req = Req(rid, "", array("q", tokens + [7]), SamplingParams(max_new_tokens=1))
    match = side.tree.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens)), req=req))
    req.last_node = match.last_device_node
    assert match.host_hit_length == n, f"rank {rank}: hit {match.host_hit_length} of {n}"
    loaded, _ = side.tree.init_load_back(InitLoadBackParams(
        best_match_node=match.best_match_node, host_hit_length=match.host_hit_length, req=req))
    assert loaded == n, f"rank {rank}: loaded {loaded} of {n}"
    load_slots = side.tree.linker.private_load_indices[rid].clone()
    index = side.tree.ready_to_load_host_cache()
    counter = side.linker.layer_done_counter
    counter.set_consumer(index)
    prepared = broadcaster.prepare_broadcast(load_slots, None) if broadcaster is not None else None
    waits, bcasts = [], []
    for layer in range(side.layers):  # the forward: each layer reads its KV after the wait for it
        t = time.perf_counter()
        counter.wait_until(layer)
        waits.append(time.perf_counter() - t)
        if broadcaster is not None:  # SGLang: on_layer_ready -> broadcast_loaded_layer, on the forward stream
            t = time.perf_counter()
            broadcaster.broadcast_loaded_layer(layer, prepared)
            bcasts.append(time.perf_counter() - t)
    failed = side.tree.finish_external_linker_loads([req])
    out["load_s"] = time.perf_counter() - start
    assert not failed, f"rank {rank}: load failed"
    out["wait_s"] = sum(waits)
    out["bcast_in_load_s"] = sum(bcasts)
    for layer in range(side.layers):
        got = side.kvcache.kv_buffer[layer][load_slots]
        assert torch.equal(got.view(torch.int16), latent[layer].view(torch.int16)), f"rank {rank}: layer {layer}"

    if broadcaster is not None:  # the broadcast alone, every layer, the pages already in place
        dist.barrier(group)
        per_layer = []
        for layer in range(side.layers):
            t = time.perf_counter()
            broadcaster.broadcast_loaded_layer(layer, prepared)
            per_layer.append(time.perf_counter() - t)
        out["bcast_only_s"] = sum(per_layer)
        out["bcast_layer_s"] = statistics.median(per_layer)
    side.allocator.free(load_slots)  # the request is done with its private slots
    return out


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # two ranks on a small machine: one compute thread each
    rank = args.worker
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    group = dist.group.WORLD

    from sglang_kvbm.integration.sglang.custom import ensure_runtime_context

    ensure_runtime_context("cpu")
    import sglang.srt.mem_cache.mla_host_dedup as dedup

    # No SGLang parallel state in this process: tell SGLang's broadcaster which attention-TP rank it is.
    dedup.mla_dedup_rank_and_size = lambda: (rank, 2)
    host_blocks = args.pages * (args.rounds + 2)
    per_rank = Side(rank, group, args, tiers=True, host_blocks=host_blocks)
    owner = Side(rank, group, args, tiers=rank == 0, host_blocks=host_blocks)
    # SGLang's own layer broadcast (NCCL in a server; gloo here), over the same group.
    broadcaster = dedup.MLAHostDedupBroadcaster(owner.kvcache, group, src_global_rank=0)
    n = args.pages * args.page_size
    results = {"per-rank": [], "rank-0": []}
    for r in range(-1, args.rounds):  # round -1 warms up both paths, not recorded
        tokens = [10_000 * (r + 2) + i for i in range(n)]
        latent = _latent(n, args.layers, seed=r + 2)
        modes = [("per-rank", per_rank, None), ("rank-0", owner, broadcaster)]
        for name, side, bcast in modes if r % 2 == 0 else modes[::-1]:
            got = run_round(side, rank, group, bcast, tokens, latent, f"{name}-{r}")
            if r >= 0:
                results[name].append(got)
    # Raw gloo broadcast of one layer's bytes (what the layer broadcast moves), for the bandwidth it reached.
    payload = torch.empty(n * LATENT_BYTES, dtype=torch.uint8)
    times = []
    for _ in range(5):
        dist.barrier(group)
        t = time.perf_counter()
        dist.broadcast(payload, src=0, group=group)
        times.append(time.perf_counter() - t)
    results["gloo_layer_s"] = statistics.median(times)
    with open(args.out, "w") as f:
        json.dump(results, f)
    if os.environ.get("KVBM_BENCH_RAW"):
        print(f"rank {rank}:", json.dumps(results), flush=True)
    per_rank.close()
    owner.close()
    dist.barrier(group)
    dist.destroy_process_group()


# -- the run ----------------------------------------------------------------------------------------------------------
