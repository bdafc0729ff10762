"""MLA under tensor parallelism: per-rank copies of the replicated latent, or rank 0's tiers + a broadcast.

An MLA model's KV (DeepSeek's latent: kv_lora_rank 512 + rope 64 per token per
layer, bf16) is the same on every TP rank. With per-process tiers, every rank
offloads, stores and loads its own identical copy: TP x the host memory, the
device->host and host->device traffic and the disk. SGLang 0.5.23's answer
(``mem_cache/unified_cache/linker_mla_dedup.py``, ``--enable-linker-mla-dedup``,
wired only into its Mooncake direct linker) stores on rank 0 and, on a load,
broadcasts each loaded layer from rank 0 to the other ranks as the forward
reaches it (``MLAHostDedupBroadcaster._bcast_layer``: ``index_select`` into a
staging buffer, ``torch.distributed.broadcast``, ``index_copy_`` on the
receivers).

Two real processes over a gloo group on 127.0.0.1, each with SGLang's real
``MLATokenToKVPool``, paged allocator and default tree (``UnifiedRadixCache``),
every collective of SGLang's wrapper (the lookup intersection, the load
verdict, the offload completion counts) paired for real across them:

* ``per-rank`` (the baseline): each rank's own ``KvbmLinker`` offloads and loads
  its own copy of the (identical) latent pages;
* ``rank-0``: rank 0's ``KvbmLinker`` owns the tiers; rank 1's linker is a peer
  with no tiers (``PeerLinker`` below, what the Mooncake linker does on a
  non-owner rank): it acknowledges offloads at once, answers every lookup
  length as restorable (SGLang's MIN intersection then yields exactly rank
  0's answer), joins the load verdict's reduction, and completes its layers at
  once; its pages arrive by SGLang's own ``MLAHostDedupBroadcaster``, one
  broadcast per layer, issued right after the forward's wait for that layer
  (what ``LayerWiseLoadCounter.on_layer_ready`` does in SGLang).

Each round offloads a fresh prefix (``--pages`` pages of ``--page-size`` tokens,
``--layers`` layers), evicts it from the device pools, and loads it back with a
simulated forward that waits for each layer in turn; the loaded bytes are
checked on both ranks. Modes alternate first/second across rounds; medians are
shown, as ratios against the per-rank baseline of the same run. A second table
projects the measured structure onto GPUs (DeepSeek-V3 shape; PCIe H2D against
an NCCL broadcast over NVLink; the rates are flags, not measurements).

    python benchmarks/mla_tp.py                   # ~1.5 minutes on 2 CPU cores
    python benchmarks/mla_tp.py --pages 128 --layers 16 --rounds 7
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from array import array
from collections import deque

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

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
            self.disk_dir = tempfile.mkdtemp(prefix=f"kvbm-mla-tp{rank}-")
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _med(rounds: list, key: str, how=max) -> float:
    """Median over rounds of ``how`` over ranks (max: what a TP step waits for)."""
    return statistics.median(how(r[key] for r in per_round) for per_round in rounds)


def _gpu_projection(args) -> tuple[list, list]:
    tp, layers, tokens = args.gpu_tp, args.gpu_layers, args.gpu_prefix_tokens
    layer_bytes = tokens * LATENT_BYTES
    total = layer_bytes * layers
    dram = tp * total / (args.dram_gbps * 1e9)  # per-rank copies: TP ranks read TP copies out of host DRAM at once
    rows = []
    for bcast_gbps in args.bcast_gbps:
        bcast_layer = layer_bytes / (bcast_gbps * 1e9) + args.nccl_latency_us * 1e-6
        for pcie in args.pcie_gbps:
            h2d = total / (pcie * 1e9)
            per_rank = max(h2d, dram)
            # Rank 0 loads; layer l's broadcast (forward stream) overlaps layer l+1's copy (copy stream).
            rank0 = max(h2d, bcast_layer * layers) + bcast_layer
            rows.append([f"{bcast_gbps:g} GB/s", f"{pcie:g} GB/s", h2d * 1e3, dram * 1e3, per_rank * 1e3,
                         rank0 * 1e3, rank0 / per_rank, bcast_layer * layers * 1e3])
    mem = [["per-rank copies", tp * total / 1e9, tp * total / 1e9, 1.0],
           ["rank-0 tiers", total / 1e9, total / 1e9, 1.0 / tp]]
    return rows, mem


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--pages", type=int, default=64, help="pages per prefix (64 x 64 = a 4096-token prefix)")
    ap.add_argument("--layers", type=int, default=8, help="DeepSeek-V3 has 61; scaled down for a CPU")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--gpu-tp", type=int, default=8)
    ap.add_argument("--gpu-layers", type=int, default=61)
    ap.add_argument("--gpu-prefix-tokens", type=int, default=8192)
    ap.add_argument("--pcie-gbps", type=float, nargs="+", default=[25.0, 50.0], help="host->device per GPU")
    ap.add_argument("--bcast-gbps", type=float, nargs="+", default=[300.0, 20.0],
                    help="NCCL broadcast bus bandwidth: H100 NVLink, and GPUs without NVLink (PCIe peer to peer)")
    ap.add_argument("--nccl-latency-us", type=float, default=20.0, help="fixed cost of one broadcast")
    ap.add_argument("--dram-gbps", type=float, default=300.0, help="host DRAM read bandwidth, whole node")
    ap.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker is not None:
        worker(args)
        return

    from common import table

    started = time.perf_counter()
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="kvbm-mla-tp-") as tmp:
        outs = [os.path.join(tmp, f"rank{r}.json") for r in range(2)]
        base = [sys.executable, os.path.abspath(__file__), "--port", str(port), "--page-size", str(args.page_size),
                "--pages", str(args.pages), "--layers", str(args.layers), "--rounds", str(args.rounds)]
        procs = [subprocess.Popen(base + ["--worker", str(r), "--out", outs[r]]) for r in range(2)]
        codes = [p.wait(timeout=600) for p in procs]
        if any(codes):
            sys.exit(f"a rank failed: exit codes {codes}")
        ranks = [json.load(open(o)) for o in outs]

    n = args.pages * args.page_size
    page_bytes = args.page_size * LATENT_BYTES * args.layers
    print(f"\nMLA latent {KV_LORA_RANK}+{ROPE_DIM} bf16, page {args.page_size} tokens x {args.layers} layers = "
          f"{page_bytes / 1024:.0f} KiB/page; prefix {args.pages} pages = {n} tokens, "
          f"{n * LATENT_BYTES * args.layers / 2**20:.1f} MiB per copy; TP=2 over gloo on 127.0.0.1; "
          f"{args.rounds} rounds, medians\n")
    by_mode = {m: list(zip(ranks[0][m], ranks[1][m])) for m in ("per-rank", "rank-0")}
    base_host = _med(by_mode["per-rank"], "host_bytes", sum)
    base_off = _med(by_mode["per-rank"], "offload_s")
    base_load = _med(by_mode["per-rank"], "load_s")
    rows = []
    for mode in ("per-rank", "rank-0"):
        rounds = by_mode[mode]
        host = [statistics.median(r[i]["host_bytes"] for r in rounds) / 2**20 for i in range(2)]
        host_total = _med(rounds, "host_bytes", sum)
        off, load = _med(rounds, "offload_s"), _med(rounds, "load_s")
        rows.append([mode, host[0], host[1], host_total / base_host, off * 1e3, off / base_off,
                     _med(rounds, "load_s", lambda v: list(v)[0]) * 1e3,
                     _med(rounds, "load_s", lambda v: list(v)[1]) * 1e3, load * 1e3, load / base_load])
    print(table(["mode", "host MiB r0", "host MiB r1", "host vs per-rank", "offload ms", "offload vs per-rank",
                 "load ms r0", "load ms r1", "load ms (slowest)", "load vs per-rank"], rows))

    r0 = by_mode["rank-0"]
    bcast_only = _med(r0, "bcast_only_s")
    bcast_layer = _med(r0, "bcast_layer_s")
    in_load = _med(r0, "bcast_in_load_s", lambda v: list(v)[1])
    gloo = statistics.median([ranks[0]["gloo_layer_s"], ranks[1]["gloo_layer_s"]])
    layer_mib = n * LATENT_BYTES / 2**20
    print()
    print(table(["layer broadcast (rank 0 -> rank 1)", "value", "vs per-rank load"], [
        ["per layer, ms (SGLang's _bcast_layer, data in place)", bcast_layer * 1e3, bcast_layer / base_load],
        [f"all {args.layers} layers, ms", bcast_only * 1e3, bcast_only / base_load],
        ["rank 1's broadcast time inside its load, ms", in_load * 1e3, in_load / base_load],
        [f"gloo broadcast of one layer ({layer_mib:.1f} MiB), GB/s", n * LATENT_BYTES / gloo / 1e9, ""],
        ["per-rank load, GB/s per rank", n * LATENT_BYTES * args.layers / base_load / 1e9, ""],
    ]))

    rows, mem = _gpu_projection(args)
    total = args.gpu_prefix_tokens * LATENT_BYTES * args.gpu_layers
    print(f"\nGPU projection (not measured): DeepSeek-V3 latent, {args.gpu_layers} layers, TP={args.gpu_tp}, "
          f"a {args.gpu_prefix_tokens}-token host hit = {total / 1e6:.0f} MB per copy; NCCL broadcast "
          f"+ {args.nccl_latency_us:g} us per layer; host DRAM {args.dram_gbps:g} GB/s per node, shared")
    print(table(["broadcast", "PCIe H2D per GPU", "H2D ms", "DRAM ms (TP copies)", "per-rank load ms",
                 "rank-0 load+bcast ms", "rank-0 vs per-rank", "bcast on forward stream ms"], rows))
    print()
    print(table(["tiers", "host GB per hit (node)", "DRAM read per load GB", "host vs per-rank"], mem))
    print(f"\n({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
