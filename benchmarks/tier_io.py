"""Tier I/O against the hardware's limit, measured in one run on one machine.

Moves the same bytes through each of the library's copy paths and through the
baseline for that medium, and prints their ratio:

* G1->G2 (device pages -> host rows) and G2->G1 against ``memcpy`` of the same bytes
  (a contiguous torch copy),
* G2->G3 and G3->G1 (NIXL POSIX, O_DIRECT, with header and checksum) against a
  raw O_DIRECT sequential write/read of the same bytes (``os.pwritev``/``os.preadv``).

The "device" is a CPU tensor pool here (no GPU needed); on a CUDA machine pass
``--device cuda`` to measure G1<->G2 over PCIe instead.

    python benchmarks/tier_io.py                      # ~64 pages of a Llama-8B-shaped KV page
    python benchmarks/tier_io.py --pages 512 --dir /nvme/tmp
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from common import save_plot, table, verdict
from sglang_kvbm.backends.local.disk_setup import probe
from sglang_kvbm.backends.local.disk_store import DiskStore
from sglang_kvbm.backends.local.manager import LocalBlockManager
from sglang_kvbm.core.connector import KvbmConnector
from sglang_kvbm.core.identity import chain_hashes
from sglang_kvbm.core.ports import BlockMeta, PageStore
from sglang_kvbm.kv_layout import PagedKvLayout


class NullSink:
    def stored(self, tier, blocks):
        pass

    def removed(self, tier, blocks):
        pass


def best_of(fn, repeat):
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times), statistics.median(times)


def raw_o_direct(path: Path, nbytes: int, chunk: int, repeat: int):
    buf = mmap.mmap(-1, chunk)
    buf.write(os.urandom(4096) * (chunk // 4096))
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    os.posix_fallocate(fd, 0, nbytes)

    def write():
        for off in range(0, nbytes, chunk):
            os.pwritev(fd, [buf], off)
        os.fsync(fd)

    def read():
        for off in range(0, nbytes, chunk):
            os.preadv(fd, [buf], off)

    try:
        return best_of(write, repeat), best_of(read, repeat)
    finally:
        os.close(fd)
        path.unlink()
        buf.close()


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
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)

    dtype = getattr(torch, args.dtype)
    rows = (args.pages * 2 + 1) * args.page_size
    buffers = [
        torch.randn(rows, args.kv_heads, args.head_dim, device=args.device).to(dtype) for _ in range(2 * args.layers)
    ]
    layout = PagedKvLayout(buffers, args.page_size)
    n = args.pages
    nbytes = n * layout.page_bytes
    print(
        f"# {n} pages of {layout.page_bytes / 2**20:.2f} MiB ({args.layers} layers x K,V x {args.page_size} tokens x "
        f"{args.kv_heads} heads x {args.head_dim} x {args.dtype}), {nbytes / 2**20:.0f} MiB per measurement, "
        f"device={args.device}, best of {args.repeat}",
        flush=True,
    )
    root = Path(args.dir or tempfile.mkdtemp(prefix="kvbm-bench-"))
    tokens = list(range(n * args.page_size))
    ids = chain_hashes(tokens, args.page_size)
    pages = list(range(1, n + 1))
    targets = list(range(n + 1, 2 * n + 1))

    # memcpy baseline: the same bytes, contiguous to contiguous.
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=args.device)  # touched, not zero pages
    dst = torch.ones(nbytes, dtype=torch.uint8, pin_memory=args.device == "cuda")
    memcpy = best_of(lambda: dst.copy_(src), args.repeat)

    # G1 -> G2 and G2 -> G1 through the manager's real paths.
    host = LocalBlockManager(layout, n, pin=args.device == "cuda")
    conn = KvbmConnector(host, NullSink())
    metas = [PageStore(BlockMeta(i, tuple(tokens[k * args.page_size : (k + 1) * args.page_size])), p)
             for k, (i, p) in enumerate(zip(ids, pages))]

    def g1_to_g2():
        conn.reset()
        conn.store(metas, on_offloaded=lambda: None)
        conn.flush()

    g1g2 = best_of(g1_to_g2, args.repeat)
    def g2_to_g1():
        conn.load(ids, targets)
        if args.device == "cuda":
            torch.cuda.synchronize()

    g2g1 = best_of(g2_to_g1, args.repeat)
    assert torch.equal(layout.read_page(targets[0]), layout.read_page(pages[0]))

    try:
        import nixl  # noqa: F401
    except ImportError:
        nixl = None
    if nixl is None:
        print("# NIXL is not installed here: the disk rows are skipped")
        rows_out = [
            ("G1->G2 (device->host)", nbytes, g1g2, "memcpy", memcpy, nbytes),
            ("G2->G1 (host->device)", nbytes, g2g1, "memcpy", memcpy, nbytes),
        ]
        return report(rows_out)
    # G2 -> G3 and G3 -> G1: the disk worker's write job and the verified read, on real files.
    found = probe(root, n * (layout.block_bytes + DiskStore.header_bytes_for(args.page_size)) * 2,
                  zerofill_fallback=False, disable_o_direct=False)
    disk = DiskStore(probe=found, num_slots=n, block_bytes=layout.block_bytes, fingerprint=os.urandom(16),
                     page_size=args.page_size)
    disk.register_dram(host.host.slab)
    host_rows = host.host.rows_of(ids)
    slab = host.host.slab
    block_metas = [m.meta for m in metas]

    def g2_to_g3():
        disk.forget()
        reserved, _ = disk.reserve(block_metas)
        headers = disk.write(reserved, [slab[r] for r in host_rows])
        disk.commit(reserved, headers)

    g2g3 = best_of(g2_to_g3, args.repeat)
    entries = disk.entries(ids)
    g3g1 = best_of(lambda: disk.read(entries, lambda data, first, count: layout.load(
        list(range(count)), data, targets[first:first + count])), args.repeat)
    assert torch.equal(layout.read_page(targets[-1]), layout.read_page(pages[-1]))
    disk_bytes = n * disk.slot_bytes
    raw_w, raw_r = raw_o_direct(root / "raw.bin", disk_bytes, 16 << 20, args.repeat)
    disk.close()
    conn.close()

    rows_out = [
        ("G1->G2 (device->host)", nbytes, g1g2, "memcpy", memcpy, nbytes),
        ("G2->G1 (host->device)", nbytes, g2g1, "memcpy", memcpy, nbytes),
        ("G2->G3 (host->disk)", disk_bytes, g2g3, "raw O_DIRECT write", raw_w, disk_bytes),
        ("G3->G1 (disk->device, verified)", disk_bytes, g3g1, "raw O_DIRECT read", raw_r, disk_bytes),
    ]
    return report(rows_out)


def gbps(nb, t):
    return nb / t[0] / 1e9


def report(rows_out) -> int:
    printed = []
    for name, nb, t, base_name, base_t, base_nb in rows_out:
        ours, base = gbps(nb, t), gbps(base_nb, base_t)
        target = 0.8 if base_name == "memcpy" else 0.9
        printed.append([name, ours, base_name, base, ours / base, verdict(ours / base, target, lower_is_better=False)])
    print(table(["path", "GB/s", "baseline", "baseline GB/s", "ratio", "target"], printed))

    def draw(ax):
        names = [r[0].split(" ")[0] for r in printed]
        ax.bar([i - 0.2 for i in range(len(names))], [r[1] for r in printed], width=0.4, label="sglang-kvbm")
        ax.bar([i + 0.2 for i in range(len(names))], [r[3] for r in printed], width=0.4, label="baseline (memcpy / raw O_DIRECT)")
        ax.set_xticks(range(len(names)), names)
        ax.set_ylabel("GB/s")
        ax.set_title("Tier I/O")
        ax.legend(fontsize=8)

    print(f"plot: {save_plot('tier_io', draw)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
