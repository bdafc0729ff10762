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
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from mla_tp_rank import KV_LORA_RANK, LATENT_BYTES, ROPE_DIM, worker  # noqa: E402


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
