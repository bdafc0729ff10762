"""The disk tier on real files through real NIXL (POSIX backend), with faults injected into the files.

Each fault is made on the real data path (the segment files the tier reads):
the load must miss (the caller recomputes), the bad block must leave the index
with a ``DISK`` removal, a counter must move, and nothing may crash.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from conftest import RecordingSink
from sglang_kvbm.backends.local.disk_setup import probe
from sglang_kvbm.backends.local.disk_store import DiskStore
from sglang_kvbm.backends.local.manager import LocalBlockManager
from sglang_kvbm.config import ConfigError
from sglang_kvbm.core.connector import KvbmConnector
from sglang_kvbm.core.identity import chain_hashes
from sglang_kvbm.core.offload_filter import FrequencyFilter
from sglang_kvbm.core.ports import BlockMeta, EventIdentity, PageStore
from sglang_kvbm.core.tiers import Tier
from sglang_kvbm.kv_layout import PagedKvLayout

PAGE = 4
FINGERPRINT = bytes(range(16))


class Tiers:
    """A connector over host + disk tiers on a CPU 'device' pool made of plain tensors."""

    def __init__(self, root: Path, *, host_blocks=16, disk_blocks=64, use_filter=False, fingerprint=FINGERPRINT,
                 o_direct=True, pages=64, staging_blocks=None):
        torch.manual_seed(0)
        self.buffers = [torch.randn(pages * PAGE, 2, 16) for _ in range(4)]
        self.layout = PagedKvLayout(self.buffers, PAGE)
        found = probe(root, disk_blocks * (4096 + self.layout.block_bytes), zerofill_fallback=False,
                      disable_o_direct=not o_direct)
        self.disk = DiskStore(probe=found, num_slots=disk_blocks, block_bytes=self.layout.block_bytes,
                              fingerprint=fingerprint, page_size=PAGE, staging_blocks=staging_blocks)
        self.manager = LocalBlockManager(self.layout, host_blocks, disk=self.disk,
                                         offload_filter=FrequencyFilter() if use_filter else None)
        self.sink = RecordingSink()
        self.connector = KvbmConnector(self.manager, self.sink)

    def store(self, tokens, pages):
        ids = chain_hashes(tokens, PAGE)
        metas = []
        parent = None
        for k, block_id in enumerate(ids):
            event = EventIdentity(int(block_id[:8], 16), parent)
            parent = event.block_hash
            metas.append(PageStore(BlockMeta(block_id, tuple(tokens[k * PAGE:(k + 1) * PAGE]), event), pages[k]))
        self.connector.store(metas, on_offloaded=lambda: None)
        assert self.connector.flush(timeout=60)
        return ids

    def pages(self, pages):
        return [self.layout.read_page(p) for p in pages]

    def evict_host(self, n):
        """Push ``n`` unrelated blocks through the host tier."""
        junk = [50_000 + i for i in range(n * PAGE)]
        self.store(junk, list(range(40, 40 + n)))

    def close(self):
        self.connector.close()


@pytest.fixture
def tiers_factory(tmp_path):
    made = []

    def make(**kwargs):
        t = Tiers(kwargs.pop("root", tmp_path), **kwargs)
        made.append(t)
        return t

    yield make
    for t in made:
        try:
            t.close()
        except Exception:
            pass


def segment_file(tiers) -> Path:
    return next(tiers.disk.directory.glob("seg-*.kv"))


def slot_data_offset(tiers, block_id) -> int:
    entry = tiers.disk.entries([block_id])[0]
    return entry.slot * tiers.disk.slot_bytes + tiers.disk.header_bytes


def test_host_to_disk_and_back_bytes_equal(tiers_factory):
    t = tiers_factory(host_blocks=8)
    ids = t.store(list(range(32)), [1, 2, 3, 4, 5, 6, 7, 8])
    original = t.pages([1, 2, 3, 4, 5, 6, 7, 8])
    assert t.sink.ids("stored", Tier.DISK) == ids  # filter off: every host block goes down
    t.evict_host(8)
    assert t.manager.host.rows_of(ids) is None  # gone from host, only on disk now
    assert t.connector.lookup(ids) == 8
    result = t.connector.load(ids, [20, 21, 22, 23, 24, 25, 26, 27])
    assert (result.host_blocks, result.disk_blocks) == (0, 8)
    for got, want in zip(t.pages(range(20, 28)), original):
        assert torch.equal(got, want)
    assert t.connector.stats.onboard_blocks_d2d == 8 and t.connector.stats.offload_blocks_h2d >= 8


def test_reads_pipelined_over_staging_chunks_and_a_fault_in_a_later_chunk(tiers_factory):
    """Ten blocks through a 3-block staging: four chunks, two buffers, read ahead of the copy."""
    t = tiers_factory(host_blocks=10, staging_blocks=3)
    pages = list(range(1, 11))
    ids = t.store(list(range(300, 340)), pages)
    original = t.pages(pages)
    t.evict_host(10)
    assert t.connector.load(ids, list(range(20, 30))).disk_blocks == 10
    for got, want in zip(t.pages(range(20, 30)), original):
        assert torch.equal(got, want)

    ids2 = t.store(list(range(400, 440)), pages)
    t.store(list(range(60_000, 60_040)), list(range(40, 50)))  # push ids2 out of the host tier
    assert t.manager.host.rows_of(ids2) is None
    victim = ids2[7]  # third chunk: two chunks are verified and copied before it is read
    with open(segment_file(t), "r+b") as f:
        f.seek(slot_data_offset(t, victim) + 5)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))
    assert t.connector.load(ids2, list(range(20, 30))) is None
    t.connector.poll()
    assert t.sink.ids("removed", Tier.DISK) == [victim]
    assert all(t.disk.registered(i) for i in ids2 if i != victim)
    assert t.disk.stats.invalidated == {"checksum mismatch": 1}
    # The next read finds both buffers free: the read-ahead of the fourth chunk was waited out.
    assert t.connector.load(ids, list(range(30, 40))).disk_blocks == 10
    for got, want in zip(t.pages(range(30, 40)), original):
        assert torch.equal(got, want)


def test_disk_only_tier_stores_device_pages_directly(tiers_factory):
    t = tiers_factory(host_blocks=0)
    ids = t.store(list(range(100, 120)), [3, 4, 5, 6, 7])
    original = t.pages([3, 4, 5, 6, 7])
    assert t.connector.stats.offload_blocks_d2d == 5
    assert t.connector.load(ids, [30, 31, 32, 33, 34]).disk_blocks == 5
    for got, want in zip(t.pages(range(30, 35)), original):
        assert torch.equal(got, want)


def test_offload_filter_writes_only_reused_blocks(tiers_factory):
    t = tiers_factory(use_filter=True)
    ids = t.store(list(range(16)), [1, 2, 3, 4])
    assert t.sink.ids("stored", Tier.DISK) == []  # seen once: host only
    assert t.connector.load(ids, [10, 11, 12, 13]).host_blocks == 4  # a hit doubles the count to 2
    assert t.connector.flush(timeout=60)
    assert t.sink.ids("stored", Tier.DISK) == ids


def test_disk_store_is_announced_only_after_the_write(tiers_factory):
    t = tiers_factory()
    ids = t.store(list(range(8)), [1, 2])
    order = [(k, tier) for k, tier, _ in t.sink.calls]
    assert order.index(("stored", Tier.HOST)) < order.index(("stored", Tier.DISK))
    assert all(t.disk.registered(i) for i in ids)


@pytest.mark.parametrize("fault", ["bit flip", "truncate", "delete", "zero header"])
def test_fault_is_a_miss_and_the_block_leaves_the_index(tiers_factory, fault, caplog):
    t = tiers_factory(host_blocks=4)
    ids = t.store(list(range(200, 216)), [1, 2, 3, 4])
    t.evict_host(4)
    path = segment_file(t)
    victim = ids[2]
    if fault == "bit flip":
        with open(path, "r+b") as f:
            f.seek(slot_data_offset(t, victim) + 100)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x01]))
    elif fault == "truncate":
        os.truncate(path, slot_data_offset(t, victim))
    elif fault == "delete":
        path.unlink()
    else:
        with open(path, "r+b") as f:
            f.seek(slot_data_offset(t, victim) - t.disk.header_bytes)
            f.write(b"\0" * 64)

    with caplog.at_level(logging.WARNING, logger="sglang_kvbm"):
        assert t.connector.load(ids, [10, 11, 12, 13]) is None
    t.connector.poll()  # removals are published with the next poll, like every tier event
    removed = t.sink.ids("removed", Tier.DISK)
    assert victim in removed and not t.disk.registered(victim)
    assert sum(t.disk.stats.invalidated.values()) >= 1
    assert t.connector.stats.failed_loads == 1
    assert "disk" in caplog.text
    if fault == "delete":
        assert t.disk.stats.segments_recreated == 1 and path.exists()
    # The tier keeps working: the same prefix can be stored and served again.
    t.connector.evicted(ids)
    ids2 = t.store(list(range(200, 216)), [5, 6, 7, 8])
    t.evict_host(4)
    assert t.connector.load(ids2, [14, 15, 16, 17]) is not None
    for got, want in zip(t.pages([14, 15, 16, 17]), t.pages([5, 6, 7, 8])):
        assert torch.equal(got, want)


def test_deleted_segment_in_an_unwritable_directory_is_lost_not_fatal(tiers_factory, tmp_path):
    t = tiers_factory(host_blocks=4)
    ids = t.store(list(range(300, 316)), [1, 2, 3, 4])
    t.evict_host(4)
    segment_file(t).unlink()
    make_unwritable(t.disk.directory)
    try:
        assert t.connector.load(ids, [10, 11, 12, 13]) is None
        t.connector.poll()
        assert t.disk.stats.segments_lost == 1
        assert t.disk.free_slots() == 0 and len(t.disk) == 0
        assert set(ids) <= set(t.sink.ids("removed", Tier.DISK))
        # Host-tier service goes on.
        more = t.store(list(range(400, 408)), [20, 21])
        assert t.connector.load(more, [22, 23]).host_blocks == 2
    finally:
        make_writable(t.disk.directory)


def make_unwritable(path: Path) -> None:
    if os.geteuid() == 0:  # root ignores permission bits; the immutable attribute stops it
        subprocess.run(["chattr", "+i", str(path)], check=True)
    else:
        path.chmod(0o500)


def make_writable(path: Path) -> None:
    if os.geteuid() == 0:
        subprocess.run(["chattr", "-i", str(path)], check=True)
    else:
        path.chmod(0o700)


def test_cap_evicts_least_recently_used_with_removals(tiers_factory):
    t = tiers_factory(host_blocks=4, disk_blocks=6)
    first = t.store(list(range(16)), [1, 2, 3, 4])
    second = t.store(list(range(1000, 1016)), [5, 6, 7, 8])
    removed = t.sink.ids("removed", Tier.DISK)
    assert len(removed) == 2 and set(removed) <= set(first)
    assert len(t.disk) == 6 and t.disk.free_slots() == 0
    assert all(t.disk.registered(i) for i in second)


def test_restart_reuses_blocks_and_another_identity_loads_nothing(tmp_path):
    a = Tiers(tmp_path, host_blocks=4)
    ids = a.store(list(range(500, 516)), [1, 2, 3, 4])
    original = a.pages([1, 2, 3, 4])
    a.close()

    b = Tiers(tmp_path, host_blocks=4)  # same identity: same directory, index and blocks
    assert len(b.disk) == 4
    assert b.sink.calls == [] and b.connector.lookup(ids) == 4
    b.connector.poll()
    assert b.sink.ids("stored", Tier.DISK) == ids  # restored blocks announced, parents first
    assert b.connector.load(ids, [9, 10, 11, 12]).disk_blocks == 4
    for got, want in zip(b.pages([9, 10, 11, 12]), original):
        assert torch.equal(got, want)
    old_dir = b.disk.directory
    b.close()

    c = Tiers(tmp_path, host_blocks=4, fingerprint=bytes(16))  # another model, page size, ...
    assert len(c.disk) == 0 and c.connector.lookup(ids) == 0
    assert not old_dir.exists()  # reclaimed: no live server held it
    c.close()


def test_corrupt_index_is_discarded_and_the_tier_starts(tmp_path, caplog):
    a = Tiers(tmp_path)
    a.store(list(range(16)), [1, 2, 3, 4])
    directory = a.disk.directory
    a.close()
    (directory / "index.msgpack").write_bytes(b"SGKVIDX\x01" + os.urandom(64))
    with caplog.at_level(logging.WARNING, logger="sglang_kvbm"):
        b = Tiers(tmp_path)
    assert "discarded the disk index" in caplog.text
    assert len(b.disk) == 0
    b.store(list(range(16)), [1, 2, 3, 4])
    assert len(b.disk) == 4
    b.close()


def test_torn_journal_tail_keeps_the_records_before_it(tmp_path):
    a = Tiers(tmp_path)
    a.store(list(range(16)), [1, 2, 3, 4])
    a.disk._journal.flush()
    # Simulate a crash: the journal holds the records, the snapshot is stale, the tail is torn.
    a.connector._manager._disk_executor.shutdown()
    a.disk._journal.write(b"\x10\x00\x00\x00torn")
    a.disk._journal.flush()
    a.disk._lock_file.close()
    b = Tiers(tmp_path)
    assert len(b.disk) == 4
    b.close()


def test_buffered_io_when_o_direct_is_disabled(tiers_factory):
    t = tiers_factory(host_blocks=4, o_direct=False)
    ids = t.store(list(range(16)), [1, 2, 3, 4])
    t.evict_host(4)
    assert t.connector.load(ids, [10, 11, 12, 13]).disk_blocks == 4


def test_probe_reports_what_is_wrong(tmp_path):
    with pytest.raises(ConfigError, match="DYN_KVBM_DISK_CACHE_GB"):
        probe(tmp_path, 1 << 60, zerofill_fallback=False, disable_o_direct=False)
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    with pytest.raises(ConfigError, match="DYN_KVBM_DISK_CACHE_DIR"):
        probe(not_a_dir, 1 << 20, zerofill_fallback=False, disable_o_direct=False)
    locked = tmp_path / "locked"
    locked.mkdir()
    make_unwritable(locked)
    try:
        with pytest.raises(ConfigError, match="DYN_KVBM_DISK_CACHE_DIR.*not writable"):
            probe(locked, 1 << 20, zerofill_fallback=False, disable_o_direct=False)
    finally:
        make_writable(locked)


def test_world_writable_cache_directory_is_refused(tmp_path):
    stale = tmp_path / ("sglang-kvbm-" + FINGERPRINT.hex()[:16])
    stale.mkdir()
    stale.chmod(0o777)
    with pytest.raises(ConfigError, match="writable by others"):
        Tiers(tmp_path)


@pytest.fixture
def tiny_tmpfs(tmp_path):
    """A 2 MiB tmpfs (needs CAP_SYS_ADMIN, which this project's CI machines have)."""
    mount = tmp_path / "tiny"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs CAP_SYS_ADMIN)")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_no_space_at_start_is_a_config_error(tiny_tmpfs):
    with pytest.raises(ConfigError, match="DYN_KVBM_DISK_CACHE_GB"):
        Tiers(tiny_tmpfs, disk_blocks=512)


@pytest.fixture
def eio_filesystem(tmp_path):
    """ext4 on a loop device whose backing file sits on a small tmpfs.

    The disk tier starts normally (fallocate only reserves extents); the test
    then fills the tmpfs, so the loop device cannot back the tier's first data
    writes and the kernel returns EIO to the writer: a real I/O error on the
    real write path.
    """
    if not shutil.which("losetup") or not shutil.which("mkfs.ext4"):
        pytest.skip("losetup/mkfs.ext4 not available")
    backing, mount = tmp_path / "backing", tmp_path / "ext4"
    backing.mkdir()
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=12m", "tmpfs", str(backing)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs CAP_SYS_ADMIN)")
    image = backing / "disk.img"
    loop = None
    try:
        subprocess.run(["truncate", "-s", "64M", str(image)], check=True)
        subprocess.run(["mkfs.ext4", "-q", "-F", "-O", "^has_journal", "-E", "lazy_itable_init=1,nodiscard", str(image)],
                       check=True, capture_output=True)
        out = subprocess.run(["losetup", "-f", "--show", str(image)], capture_output=True, text=True)
        if out.returncode:
            pytest.skip(f"no loop device: {out.stderr.strip()}")
        loop = out.stdout.strip()
        if subprocess.run(["mount", loop, str(mount)], capture_output=True).returncode:
            pytest.skip("cannot mount the loop device")
        yield mount, backing
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)
        if loop:
            subprocess.run(["losetup", "-d", loop], capture_output=True)
        subprocess.run(["umount", "-l", str(backing)], capture_output=True)


def test_writes_lost_below_the_filesystem_are_caught_on_read(eio_filesystem, caplog):
    """The kernel acknowledges the O_DIRECT writes, then the loop device cannot store them
    ("Buffer I/O error ... lost async page write" in the kernel log): NIXL reports them done.
    Only verification on read stands between that and serving zeros as KV."""
    mount, backing = eio_filesystem
    t = Tiers(mount, host_blocks=64, disk_blocks=1024)
    with open(backing / "filler", "wb") as filler:  # ext4 still believes it has room
        try:
            while True:
                filler.write(b"\xff" * (1 << 16))
                filler.flush()
        except OSError:
            pass
    for round_ in range(16):  # 16 x 60 blocks, then 60 more: nearly every one of the 1024 slots
        ids = t.store([round_ * 100_000 + i for i in range(60 * PAGE)], list(range(1, 61)))
    assert t.disk.stats.write_failures == 0 and len(t.disk) > 0  # nothing was reported failed
    t.store([9_000_000 + i for i in range(60 * PAGE)], list(range(1, 61)))  # pushes `ids` out of host
    assert t.manager.host.rows_of(ids) is None and t.connector.lookup(ids) == 60
    with caplog.at_level(logging.WARNING, logger="sglang_kvbm"):
        assert t.connector.load(ids, list(range(1, 61))) is None
    t.connector.poll()
    assert sum(t.disk.stats.invalidated.values()) >= 1
    assert "failed verification" in caplog.text
    removed = set(t.sink.ids("removed", Tier.DISK))
    assert removed and not any(t.disk.registered(i) for i in removed)
    t.close()
