"""Tier I/O against the hardware's limit, measured in one run on one machine.

Moves the same bytes through each of the library's copy paths and through the
limit of that medium, and prints their ratio. This machine's memory and disk
bandwidth drift by 2x within minutes (other tenants), so every path and every
limit is measured once per round, side by side, over ``--repeat`` rounds; a
ratio is taken within a round and the table shows the median across rounds:

* G1->G2 (the offload worker's device->host copy) and G2->G1 (the loader's
  layer-by-layer host->device copy) against ``memcpy`` of the same bytes, each
  way (one contiguous torch copy; on CUDA from and to pinned memory, the DMA's
  limit);
* G2->G3 (the disk writer: headers, checksums, pipelined NIXL writes) and G3->G1
  (the disk reader into host staging, verified, then the loader) against the
  disk's limit measured the way storage people do: parallel O_DIRECT at queue depth
  over the same number of bytes, with ``fio`` (from the distribution's packages)
  and with NIXL's POSIX backend keeping many large requests in flight; the limit
  is the faster of the two. G3->G1 is shown twice: the read and verification a
  load waits for (``acquire``) and, serially after it, the copy into the device
  pool, which in a server runs layer by layer under the forward instead.

The "device" is a CPU tensor pool here (no GPU needed); on a CUDA machine pass
``--device cuda`` to measure G1<->G2 over PCIe instead.

    python benchmarks/tier_io.py                      # 64 pages of a Llama-8B-shaped KV page (128 MiB)
    python benchmarks/tier_io.py --pages 512 --dir /nvme/tmp
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from common import save_plot, table, verdict
from sglang_kvbm.core.identity import chain_hashes
from sglang_kvbm.core.pages import one_page
from sglang_kvbm.core.ports import StoreRequest
from sglang_kvbm.manager.block_manager import LocalBlockManager
from sglang_kvbm.tiers.disk.nixl_io import NixlFileIO
from sglang_kvbm.tiers.disk.setup import probe
from sglang_kvbm.tiers.disk.store import DiskStore
from sglang_kvbm.transfer import copies
from sglang_kvbm.transfer.host_memory import aligned_empty
from sglang_kvbm.transfer.indexes import index
from sglang_kvbm.transfer.kv_layout import PagedKvLayout


def seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def fio_rate(path: Path, nbytes: int, rw: str) -> float | None:
    """GB/s of one fio O_DIRECT sequential ``rw`` (write or read) at queue depth 16, 1 MiB blocks."""
    if shutil.which("fio") is None:
        return None
    run = subprocess.run(
        ["fio", "--name=kvbm", f"--filename={path}", f"--rw={rw}", "--bs=1M", f"--size={nbytes}",
         "--direct=1", "--ioengine=libaio", "--iodepth=16", "--numjobs=1", "--output-format=json",
         "--end_fsync=1" if rw == "write" else "--invalidate=1"],
        capture_output=True, text=True, check=True,
    )
    return json.loads(run.stdout)["jobs"][0][rw]["bw_bytes"] / 1e9


class NixlLimit:
    """NIXL POSIX O_DIRECT transfers of ``chunk`` bytes, ``depth`` in flight, no headers or checks."""

    def __init__(self, path: Path, nbytes: int, chunk: int = 8 << 20, depth: int = 8) -> None:
        self.io = NixlFileIO("kvbm-bench-limit")
        self.buf = aligned_empty((depth, chunk))
        self.buf.random_(0, 255)
        self.io.register_memory(self.buf)
        self.path, self.chunk, self.depth, self.nbytes = path, chunk, depth, nbytes
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
        os.posix_fallocate(self.fd, 0, nbytes)
        self.reg = self.io.register_file(self.fd, nbytes, path.name)

    def rate(self, op: str) -> float:
        count, chunk, depth, buf, fd = self.nbytes // self.chunk, self.chunk, self.depth, self.buf, self.fd

        def describe(k):
            return [(buf[k % depth].data_ptr(), chunk, 0)], [(k * chunk, chunk, fd)]

        def move():
            self.io.pipeline(op, count, describe, lambda k, error: None, depth=depth)
            if op == "WRITE":
                os.fsync(fd)

        return count * chunk / seconds(move) / 1e9

    def close(self) -> None:
        self.io.deregister(self.reg)
        os.close(self.fd)
        self.path.unlink()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pages", type=int, default=64, help="pages moved per measurement")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dir", default=None, help="disk directory (default: a temp dir under /tmp)")
    parser.add_argument("--repeat", type=int, default=7, help="rounds")
    args = parser.parse_args(argv)

    dtype = getattr(torch, args.dtype)
    rows = (args.pages * 2 + 1) * args.page_size
    buffers = [torch.randn(rows, args.kv_heads, args.head_dim, device=args.device).to(dtype)
               for _ in range(2 * args.layers)]
    layout = PagedKvLayout(buffers, args.page_size, layers=[(l, args.layers + l) for l in range(args.layers)])
    n, ps = args.pages, args.page_size
    nbytes = n * layout.page_bytes
    print(f"# {n} pages of {layout.page_bytes / 2**20:.2f} MiB ({args.layers} layers x K,V x {ps} tokens x "
          f"{args.kv_heads} heads x {args.head_dim} x {args.dtype}), {nbytes / 2**20:.0f} MiB per measurement, "
          f"device={args.device}, median of {args.repeat} rounds", flush=True)
    root = Path(args.dir or tempfile.mkdtemp(prefix="kvbm-bench-"))
    tokens = list(range(n * ps))
    ids = tuple(chain_hashes(tokens, ps))
    metas = [one_page(b, tuple(tokens[k * ps : (k + 1) * ps])) for k, b in enumerate(ids)]
    slots = torch.arange(ps, (n + 1) * ps, device=args.device)  # device pages 1..n
    targets = index(range(n + 1, 2 * n + 1), args.device)

    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=args.device)
    dst = torch.ones(nbytes, dtype=torch.uint8, pin_memory=args.device == "cuda")
    manager = LocalBlockManager(layout, n, pin=args.device == "cuda")
    request = StoreRequest(ids, slots, lambda positions: [metas[p] for p in positions])

    def g1_to_g2():
        manager.reset()
        manager.store(request)
        manager.wait()
        manager.poll()

    stream = layout.new_stream()

    def g2_to_g1(batch):
        with layout.copying(stream):
            for layer in range(layout.num_layers):
                copies.load_layer(layout, batch, layer)
        if stream is not None:
            stream.synchronize()  # enqueued only: time the copy itself

    slot_bytes = DiskStore.header_bytes_for(ps) + layout.block_bytes
    found = probe(root, 2 * n * slot_bytes, zerofill_fallback=False, disable_o_direct=False)
    disk = DiskStore(probe=found, num_slots=n, block_bytes=layout.block_bytes, fingerprint=os.urandom(16), page_size=ps)
    disk_source = layout.host_slab(n, pin=args.device == "cuda")  # the same pages, in host rows 0..n-1
    layout.save(layout.pages_of(slots), disk_source, index(range(n)))
    disk.register_dram(disk_source)
    staging = layout.host_slab(n, pin=args.device == "cuda")
    headers = aligned_empty((n, disk.header_bytes))
    disk.register_dram(staging)
    disk.register_dram(headers)
    disk_bytes = n * slot_bytes
    staging_rows = index(range(n))

    def g2_to_g3():
        disk.forget()
        reserved, _ = disk.reserve(list(ids))
        disk.commit(reserved, copies.host_to_disk(disk, reserved, metas, disk_source, range(n))[0])

    def g3_to_staging(entries):
        failed, _ = copies.disk_to_staging(disk, entries, staging, headers, list(range(n)))
        assert not failed, failed

    def g3_to_g1(entries):
        g3_to_staging(entries)
        with layout.copying(stream):
            for layer in range(layout.num_layers):
                layout.load_layer(layer, staging, staging_rows, targets)
        if stream is not None:
            stream.synchronize()

    nixl = NixlLimit(root / "limit.bin", disk_bytes)
    if shutil.which("fio") is None:
        print("# fio is not installed (apt-get install fio): the disk limit is NIXL's queue-depth transfer alone")
    rounds = []  # per round: {name: GB/s}
    for _ in range(args.repeat + 1):  # the first round warms up and is dropped
        r = {"memcpy": nbytes / seconds(lambda: dst.copy_(src)) / 1e9,
             "memcpy_h2d": nbytes / seconds(lambda: src.copy_(dst)) / 1e9,
             "g1g2": nbytes / seconds(g1_to_g2) / 1e9}
        plan = manager.acquire(ids)
        batch = copies.load_batch(layout, manager.load_parts(plan, targets))
        r["g2g1"] = nbytes / seconds(lambda: g2_to_g1(batch)) / 1e9
        manager.release(plan)
        r["g2g3"] = disk_bytes / seconds(g2_to_g3) / 1e9
        entries, held = disk.begin_read(list(ids))
        r["g3g2"] = disk_bytes / seconds(lambda: g3_to_staging(entries)) / 1e9
        r["g3g1"] = disk_bytes / seconds(lambda: g3_to_g1(entries)) / 1e9
        disk.end_read(list(ids), held)
        r["nixl_w"], r["nixl_r"] = nixl.rate("WRITE"), nixl.rate("READ")
        r["fio_w"] = fio_rate(root / "fio.bin", disk_bytes, "write")
        r["fio_r"] = fio_rate(root / "fio.bin", disk_bytes, "read")
        rounds.append(r)
    rounds = rounds[1:]
    assert torch.equal(layout.read_page(n + 1), layout.read_page(1))
    assert torch.equal(layout.read_page(2 * n), layout.read_page(n))
    disk.close()
    manager.close()
    nixl.close()
    shutil.rmtree(root, ignore_errors=True)

    def limit(r, kind):  # the faster of NIXL and fio in that round
        return max(v for v in (r[f"nixl_{kind}"], r[f"fio_{kind}"]) if v is not None)

    for name in ("nixl", "fio"):
        if rounds[0][f"{name}_w"] is not None:
            w = statistics.median(r[f"{name}_w"] for r in rounds)
            rd = statistics.median(r[f"{name}_r"] for r in rounds)
            print(f"# disk limit by {name}: write {w:.3f} GB/s, read {rd:.3f} GB/s (median)")
    results = [("G1->G2 (device->host)", "g1g2", "memcpy", lambda r: r["memcpy"]),
               ("G2->G1 (host->device, per layer)", "g2g1", "memcpy h2d", lambda r: r["memcpy_h2d"]),
               ("G2->G3 (host->disk)", "g2g3", "disk write limit", lambda r: limit(r, "w")),
               ("G3->staging (read + verify: what a load waits for)", "g3g2", "disk read limit",
                lambda r: limit(r, "r")),
               ("G3->G1 (read + verify, then copied in, serially)", "g3g1", "disk read limit", lambda r: limit(r, "r"))]
    return report([(name, statistics.median(r[key] for r in rounds), base,
                    statistics.median(base_of(r) for r in rounds),
                    statistics.median(r[key] / base_of(r) for r in rounds),
                    (min(r[key] / base_of(r) for r in rounds), max(r[key] / base_of(r) for r in rounds)))
                   for name, key, base, base_of in results])


def report(results) -> int:
    printed = []
    for name, ours, base_name, base, ratio, (low, high) in results:
        target = 0.8 if base_name.startswith("memcpy") else 0.9
        printed.append([name, ours, base_name, base, ratio, f"{low:.2f}-{high:.2f}",
                        verdict(ratio, target, lower_is_better=False)])
    print(table(["path", "GB/s", "baseline", "baseline GB/s", "ratio", "ratio range", "target"], printed))
    print("(GB/s: medians across rounds; ratio: the median of each round's path / that round's baseline)")

    def draw(ax):
        names = [r[0].split(" ")[0] for r in printed]
        ax.bar([i - 0.2 for i in range(len(names))], [r[1] for r in printed], width=0.4, label="sglang-kvbm")
        ax.bar([i + 0.2 for i in range(len(names))], [r[3] for r in printed], width=0.4, label="limit")
        ax.set_xticks(range(len(names)), names)
        ax.set_ylabel("GB/s")
        ax.set_title("Tier I/O")
        ax.legend(fontsize=8)

    print(f"plot: {save_plot('tier_io', draw)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
