"""Rebuilding a damaged disk index from the blocks (``disk/rebuild.py``), against reading the tier once.

A disk tier of ``--gb`` GiB is filled with blocks through the tier's own write path, closed
cleanly, and restarted on the same directory four ways, in one run:

* **read** (the baseline): every segment file read once, in order, O_DIRECT, 16 MiB at a time,
  nothing checked: the least a scan of the blocks can cost;
* **normal restart**: the snapshot is intact (what a clean restart pays, on the scheduler's thread);
* **rebuild**: 4 bytes of the snapshot flipped: ``DiskStore()`` returns at once (the tier misses
  meanwhile), the scan reads and verifies every slot on a thread of its own, then the scheduler
  thread registers what it kept (in memory; the scan's thread wrote the fresh snapshot);
* **restart after the rebuild**: the fresh snapshot makes it a normal restart again.

Every block written must be kept. What the benchmark writes is deleted when it exits.

    ../.venv/bin/python disk_rebuild.py                        # 1 GiB, one round
    ../.venv/bin/python disk_rebuild.py --gb 10 --repeat 3     # the 10 GB figure (needs ~11 GB free)
"""

from __future__ import annotations

import argparse
import gc
import mmap
import os
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

from common import save_plot, scratch_dir, table, verdict
from sglang_kvbm.core.pages import one_page
from sglang_kvbm.tiers.disk.setup import probe
from sglang_kvbm.tiers.disk.store import DiskStore
from sglang_kvbm.transfer.host_memory import aligned_empty

GIB = 1 << 30
READ_CHUNK = 16 << 20
WRITE_BATCH = 64


def timed(fn):
    started = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - started


def fill(store: DiskStore, page_size: int) -> int:
    """Every slot written with a block of its own (random bytes, a header with its id and checksum)."""
    rows = aligned_empty((WRITE_BATCH, store.block_bytes))
    rows.random_(0, 256)
    store.register_dram(rows)
    written = 0
    while written < store.num_slots:
        ids = [f"{i:064x}" for i in range(written, min(store.num_slots, written + WRITE_BATCH))]
        reserved, _ = store.reserve(ids)
        metas = [one_page(b, tuple(range(page_size))) for b in ids]
        rows[0, :8] = torch.frombuffer(bytearray(written.to_bytes(8, "little")), dtype=torch.uint8)  # bytes differ
        store.commit(reserved, store.write(reserved, metas, [rows[i] for i in range(len(reserved))]))
        written += len(reserved)
    store.persist(force=True)
    return written


class ScanCollections:
    """The garbage collections the scan's thread ran, and the longest (the GIL is held meanwhile)."""

    def __init__(self) -> None:
        self.count, self.longest, self._started = 0, 0.0, 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if threading.current_thread().name != "kvbm-disk-rebuild":
            return
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.count += 1
            self.longest = max(self.longest, time.perf_counter() - self._started)


def read_files(directory: Path) -> int:
    """Every segment file once, in order, as a scan would read it with nothing to check (O_DIRECT)."""
    buffer = mmap.mmap(-1, READ_CHUNK)  # page-aligned
    total = 0
    for path in sorted(directory.glob("seg-*.kv")):
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            offset = 0
            while n := os.preadv(fd, [buffer], offset):
                offset += n
            total += offset
        finally:
            os.close(fd)
    buffer.close()
    return total


def flip_snapshot(directory: Path) -> None:
    """4 bytes flipped in the middle of the snapshot: unreadable, so the next start rebuilds."""
    index = directory / "index.msgpack"
    raw = bytearray(index.read_bytes())
    middle = len(raw) // 2
    raw[middle : middle + 4] = bytes(b ^ 0xFF for b in raw[middle : middle + 4])
    index.write_bytes(bytes(raw))


def one_round(open_store, directory: Path) -> dict:
    """Each way of coming back, once, on the same files; seconds and blocks of each."""
    r: dict = {}
    r["read_bytes"], r["read"] = timed(lambda: read_files(directory))
    store, r["normal"] = timed(open_store)
    r["normal_kept"] = len(store)
    store.close()
    flip_snapshot(directory)
    collections = ScanCollections()
    gc.callbacks.append(collections)
    started = time.perf_counter()
    store = open_store()
    r["returned"] = time.perf_counter() - started
    assert store.rebuilding, "the flipped snapshot did not start a rebuild"
    scan = store._restart._rebuild
    late = 0.0  # the scheduler thread meanwhile: how late a 1 ms sleep wakes up (the GIL)
    while not scan.done():
        before = time.perf_counter()
        time.sleep(0.001)
        late = max(late, time.perf_counter() - before - 0.001)
    r["scan"] = time.perf_counter() - started
    gc.callbacks.remove(collections)
    _, r["take_in"] = timed(lambda: store.wait_rebuilt())
    r["rebuilt_kept"], r["counts"], r["late"], r["gc"] = len(store), dict(scan.counts), late, collections
    store.close()
    store, r["after"] = timed(open_store)
    r["after_kept"], r["after_rebuilding"] = len(store), store.rebuilding
    store.close()
    return r


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=1.0, help="GiB of disk tier (default 1)")
    parser.add_argument("--block-mib", type=float, default=2.0,
                        help="MiB of KV a block (default 2: a 16-token page of a Llama-8B-shaped bf16 KV)")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=1, help="rounds (medians shown; the disk's bandwidth drifts)")
    parser.add_argument("--dir", default=None, help="where the tier's files go (default: a temp dir under /tmp)")
    args = parser.parse_args()

    root = Path(args.dir) / f"kvbm-rebuild-{os.getpid()}" if args.dir else Path(scratch_dir("kvbm-rebuild-"))
    root.mkdir(parents=True, exist_ok=True)
    block_bytes = int(args.block_mib * (1 << 20)) // 4096 * 4096
    slot_bytes = DiskStore.header_bytes_for(args.page_size) + block_bytes
    slots = max(1, int(args.gb * GIB) // slot_bytes)
    found = probe(root, slots * slot_bytes, zerofill_fallback=False, disable_o_direct=False)
    fingerprint = os.urandom(16)

    def open_store() -> DiskStore:
        return DiskStore(probe=found, num_slots=slots, block_bytes=block_bytes, fingerprint=fingerprint,
                         page_size=args.page_size)

    try:
        store = open_store()
        written, fill_s = timed(lambda: fill(store, args.page_size))
        directory = store.directory
        store.close()
        size = sum(p.stat().st_size for p in directory.glob("seg-*.kv"))
        print(f"disk tier: {size / GIB:.2f} GiB, {written} blocks of {block_bytes / 2**20:.2f} MiB "
              f"(+{slot_bytes - block_bytes} header bytes), written in {fill_s:.1f} s; {os.cpu_count()} CPUs; "
              f"{found.directory}; median of {args.repeat} rounds", flush=True)
        rounds = [one_round(open_store, directory) for _ in range(args.repeat)]
    finally:
        shutil.rmtree(root, ignore_errors=True)

    def med(key: str) -> float:
        return statistics.median(r[key] for r in rounds)

    def ratio(key: str, base: str) -> float:  # within a round, then the median
        return statistics.median(r[key] / r[base] for r in rounds)

    gib = rounds[0]["read_bytes"] / GIB
    rows = [
        ["read every segment file, O_DIRECT (baseline)", f"{med('read'):.2f}", f"{gib / med('read'):.2f}", "1.00", "-"],
        ["normal restart (snapshot intact)", f"{med('normal'):.3f}", "-", f"{ratio('normal', 'read'):.3f}",
         rounds[-1]["normal_kept"]],
        ["rebuild: DiskStore() returns (start waits)", f"{med('returned'):.3f}", "-",
         f"{ratio('returned', 'read'):.3f}", "-"],
        ["rebuild: scan + verify (own thread)", f"{med('scan'):.2f}", f"{gib / med('scan'):.2f}",
         f"{ratio('scan', 'read'):.2f}", "-"],
        ["rebuild: blocks taken in (scheduler thread)", f"{med('take_in'):.3f}", "-",
         f"{ratio('take_in', 'read'):.3f}", rounds[-1]["rebuilt_kept"]],
        ["restart after the rebuild", f"{med('after'):.3f}", "-", f"{ratio('after', 'read'):.3f}",
         rounds[-1]["after_kept"]],
    ]
    print(table(["restart", "seconds", "GiB/s", "vs read", "blocks"], rows))
    counts = rounds[-1]["counts"]
    counted = ", ".join(f"{counts.get(k, 0)} {k}" for k in ("empty", "bad header", "other identity", "bad data",
                                                            "duplicate", "unreadable"))
    print(f"rebuild vs normal restart: {ratio('scan', 'normal'):.0f}x; slots not kept: {counted}")
    late, longest = max(r["late"] for r in rounds), max(r["gc"].longest for r in rounds)
    print(f"while the scan ran, the scheduler thread's 1 ms sleeps woke up at most {late * 1e3:.1f} ms late; the "
          f"scan's thread ran {sum(r['gc'].count for r in rounds)} garbage collections, the longest {longest * 1e3:.1f}"
          f" ms (a collection holds the GIL and walks every object of the process, whichever thread starts it)")
    kept_all = all(r["rebuilt_kept"] == r["after_kept"] == r["normal_kept"] == written and not r["after_rebuilding"]
                   for r in rounds)
    print(f"every block written kept by the rebuild, and the next restart is a normal one: {kept_all}")
    print(f"rebuild within 1.25x of reading the files once: {verdict(ratio('scan', 'read'), 1.25)}")
    print("plot:", save_plot("disk_rebuild", lambda ax: (
        ax.barh([r[0] for r in rows][::-1], [float(r[1]) for r in rows][::-1]),
        ax.set_xlabel("seconds"), ax.set_title(f"disk index rebuild, {gib:.1f} GiB tier"))))
    return 0 if kept_all else 1


if __name__ == "__main__":
    sys.exit(main())
