"""Tier I/O against the hardware's limit, measured in one run on one machine.

Moves the same bytes through each of the library's copy paths and through the
limit of that medium, and prints their ratio (median of ``--repeat`` runs each):

* G1->G2 (the offload worker's device->host copy) and G2->G1 (the loader's
  layer-by-layer host->device copy) against ``memcpy`` of the same bytes (one
  contiguous torch copy);
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
from sglang_kvbm.backends.local import copies
from sglang_kvbm.backends.local.disk.nixl_io import NixlFileIO
from sglang_kvbm.backends.local.disk.setup import probe
from sglang_kvbm.backends.local.disk.store import DiskStore
from sglang_kvbm.backends.local.manager import LocalBlockManager
from sglang_kvbm.core.identity import chain_hashes
from sglang_kvbm.core.ports import BlockMeta, StoreRequest
from sglang_kvbm.kv_layout import PagedKvLayout, aligned_empty, index


def median_of(fn, repeat):
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def fio_limit(path: Path, nbytes: int, repeat: int) -> tuple[float, float] | None:
    """Median GB/s of fio's O_DIRECT sequential write and read at queue depth 16, 1 MiB blocks."""
    if shutil.which("fio") is None:
        return None
    out = []
    for rw in ("write", "read"):
        rates = []
        for _ in range(repeat):
            run = subprocess.run(
                ["fio", "--name=kvbm", f"--filename={path}", f"--rw={rw}", "--bs=1M", f"--size={nbytes}",
                 "--direct=1", "--ioengine=libaio", "--iodepth=16", "--numjobs=1", "--output-format=json",
                 "--end_fsync=1" if rw == "write" else "--invalidate=1"],
                capture_output=True, text=True, check=True,
            )
            job = json.loads(run.stdout)["jobs"][0][rw]
            rates.append(job["bw_bytes"] / 1e9)
        out.append(statistics.median(rates))
    path.unlink(missing_ok=True)
    return out[0], out[1]


def nixl_limit(path: Path, nbytes: int, repeat: int, chunk: int = 8 << 20, depth: int = 8) -> tuple[float, float]:
    """Median GB/s of NIXL POSIX O_DIRECT transfers of ``chunk`` bytes, ``depth`` in flight, no headers or checks."""
    io = NixlFileIO("kvbm-bench-limit")
    buf = aligned_empty((depth, chunk))
    buf.random_(0, 255)
    io.register_memory(buf)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    os.posix_fallocate(fd, 0, nbytes)
    reg = io.register_file(fd, nbytes, path.name)
    count = nbytes // chunk

    def move(op):
        def describe(k):
            return [(buf[k % depth].data_ptr(), chunk, 0)], [(k * chunk, chunk, fd)]

        io.pipeline(op, count, describe, lambda k, error: None, depth=depth)
        if op == "WRITE":
            os.fsync(fd)

    try:
        return tuple(count * chunk / median_of(lambda: move(op), repeat) / 1e9 for op in ("WRITE", "READ"))
    finally:
        io.deregister(reg)
        os.close(fd)
        path.unlink()


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
    parser.add_argument("--repeat", type=int, default=5)
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
          f"device={args.device}, median of {args.repeat}", flush=True)
    root = Path(args.dir or tempfile.mkdtemp(prefix="kvbm-bench-"))
    tokens = list(range(n * ps))
    ids = tuple(chain_hashes(tokens, ps))
    metas = [BlockMeta(b, tuple(tokens[k * ps : (k + 1) * ps])) for k, b in enumerate(ids)]
    slots = torch.arange(ps, (n + 1) * ps, device=args.device)  # device pages 1..n
    targets = index(range(n + 1, 2 * n + 1), args.device)

    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=args.device)
    dst = torch.ones(nbytes, dtype=torch.uint8, pin_memory=args.device == "cuda")
    memcpy = nbytes / median_of(lambda: dst.copy_(src), args.repeat) / 1e9

    manager = LocalBlockManager(layout, n, pin=args.device == "cuda")
    request = StoreRequest(ids, slots, lambda positions: [metas[p] for p in positions])

    def g1_to_g2():
        manager.reset()
        manager.store(request)
        manager.wait()
        manager.poll()

    g1g2 = nbytes / median_of(g1_to_g2, args.repeat) / 1e9
    plan = manager.acquire(ids)
    batch = copies.load_batch(layout, manager.load_parts(plan, targets))
    stream = layout.new_stream()

    def g2_to_g1():
        for layer in range(layout.num_layers):
            copies.load_layer(layout, stream, batch, layer)

    g2g1 = nbytes / median_of(g2_to_g1, args.repeat) / 1e9
    assert torch.equal(layout.read_page(n + 1), layout.read_page(1))
    results = [("G1->G2 (device->host)", g1g2, "memcpy", memcpy), ("G2->G1 (host->device, per layer)", g2g1,
                                                                      "memcpy", memcpy)]

    slot_bytes = DiskStore.header_bytes_for(ps) + layout.block_bytes
    found = probe(root, 2 * n * slot_bytes, zerofill_fallback=False, disable_o_direct=False)
    disk = DiskStore(probe=found, num_slots=n, block_bytes=layout.block_bytes, fingerprint=os.urandom(16), page_size=ps)
    host = manager.host
    disk.register_dram(host.slab)
    host_rows = host.pin(list(ids))
    staging = layout.host_slab(n, pin=args.device == "cuda")
    headers = aligned_empty((n, disk.header_bytes))
    disk.register_dram(staging)
    disk.register_dram(headers)
    disk_bytes = n * slot_bytes

    def g2_to_g3():
        disk.forget()
        reserved, _ = disk.reserve(list(ids))
        disk.commit(reserved, copies.host_to_disk(disk, reserved, metas, host.slab, host_rows)[0])

    g2g3 = disk_bytes / median_of(g2_to_g3, args.repeat) / 1e9
    read = disk.begin_read(list(ids))
    entries = read[0]

    def g3_to_staging():
        failed, _ = copies.disk_to_staging(disk, entries, staging, headers, list(range(n)))
        assert not failed, failed

    def g3_to_g1():
        g3_to_staging()
        for layer in range(layout.num_layers):
            layout.load_layer(layer, staging, index(range(n)), targets, stream=stream)

    g3g2 = disk_bytes / median_of(g3_to_staging, args.repeat) / 1e9
    g3g1 = disk_bytes / median_of(g3_to_g1, args.repeat) / 1e9
    assert torch.equal(layout.read_page(2 * n), layout.read_page(n))
    disk.end_read(list(ids), read[1])
    disk.close()
    manager.close()
    limits = {"nixl": nixl_limit(root / "limit.bin", disk_bytes, args.repeat)}
    fio = fio_limit(root / "fio.bin", disk_bytes, args.repeat)
    if fio is not None:
        limits["fio"] = fio
    else:
        print("# fio is not installed (apt-get install fio): the disk limit is NIXL's queue-depth transfer alone")
    for name, (w, r) in limits.items():
        print(f"# disk limit by {name}: write {w:.3f} GB/s, read {r:.3f} GB/s")
    limit_w = max(limits.values(), key=lambda wr: wr[0])
    limit_r = max(limits.values(), key=lambda wr: wr[1])
    write_by = next(k for k, v in limits.items() if v is limit_w)
    read_by = next(k for k, v in limits.items() if v is limit_r)
    results += [("G2->G3 (host->disk)", g2g3, f"disk write limit ({write_by})", limit_w[0]),
                ("G3->staging (read + verify: what a load waits for)", g3g2, f"disk read limit ({read_by})",
                 limit_r[1]),
                ("G3->G1 (read + verify, then copied in, serially)", g3g1, f"disk read limit ({read_by})", limit_r[1])]
    shutil.rmtree(root, ignore_errors=True)
    return report(results)


def report(results) -> int:
    printed = []
    for name, ours, base_name, base in results:
        target = 0.8 if base_name == "memcpy" else 0.9
        printed.append([name, ours, base_name, base, ours / base, verdict(ours / base, target, lower_is_better=False)])
    print(table(["path", "GB/s", "baseline", "baseline GB/s", "ratio", "target"], printed))

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
