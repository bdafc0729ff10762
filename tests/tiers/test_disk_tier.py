"""The disk tier on real files through real NIXL (POSIX backend), with faults injected into the files.

Driven through SGLang's default tree with the linker attached (``build_stack``),
as the scheduler drives it; the store's own properties are checked on the
:class:`DiskStore` the stack built. Each fault is made on the real data path
(the segment files the tier reads): the load is refused at ``load()`` (the
request recomputes, it is never aborted), the bad block leaves the index with
a ``DISK`` ``BlockRemoved``, ``disk.stats.invalidated[reason]`` moves, nothing
crashes, and a later load of intact blocks is byte-exact.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
import subprocess
import threading
from array import array
from pathlib import Path

import pytest
import torch
from sglang.srt.disaggregation.kv_events import BlockStored

from conftest import (
    LOADS_REFUSABLE,
    NIXL_1_5,
    build_stack,
    chain_links,
    make_req,
    needs_nixl_1_3,
    needs_refusable_loads,
)
from harness.disk import (
    data_offset,
    disk_removed,
    disk_stored,
    event_hash,
    flip_bit,
    header_offset,
    load_exact,
    medium,
    on_disk_only,
    push_out_of_host,
    segment_path,
)
from harness.permissions import make_unwritable, make_writable
from sglang_kvbm.config import ConfigError
from sglang_kvbm.integration.sglang.build import Identity
from sglang_kvbm.integration.sglang.compat import device_prefix_len
from sglang_kvbm.tiers.disk.setup import probe

pytestmark = pytest.mark.usefixtures("loads_wait_for_their_reads")  # what a load serves, not how long it waits
GIB = 1 << 30


def disk_stack(stack_factory, tmp_path, **kwargs):
    kwargs.setdefault("host_blocks", 4)
    kwargs.setdefault("disk_blocks", 64)
    return stack_factory(disk_dir=tmp_path, events=True, **kwargs)


def test_host_to_disk_and_back_bytes_equal(stack_factory, tmp_path):
    stack = disk_stack(stack_factory, tmp_path, host_blocks=8)
    tokens = list(range(32))
    written = stack.insert(tokens, seed=1)
    stack.settle()
    ids = stack.block_ids(tokens)
    events = stack.tree.take_events()
    assert [h for _, h in chain_links(disk_stored(events))] == [event_hash(stack.manager.tiers["disk"].store, i) for i in ids]
    push_out_of_host(stack)
    stack.evict_all()
    stack.scramble_pool()
    assert stack.linker.connector.peek(ids) == (0, 8)
    load_exact(stack, tokens, written)
    stats = stack.linker.connector.stats
    assert stats.onboard_blocks_d2d == 8 and stats.onboard_blocks_h2d == 0 and stats.offload_blocks_h2d >= 8


def test_read_staging_bounds_what_one_load_brings_from_disk(stack_factory, tmp_path):
    """``SGLANG_KVBM_READ_STAGING_GB``: the rows disk reads land in. A hit longer than they hold loads that much,
    byte for byte, and the request recomputes the rest."""
    probe_stack = disk_stack(stack_factory, tmp_path / "probe", size=256)
    block_bytes = probe_stack.layout.block_bytes
    assert probe_stack.manager.staging.capacity == 64  # the default, 1 GiB, is more than the 64-page pool
    stack = disk_stack(stack_factory, tmp_path / "small", size=256, config={"read_staging_gb": 20 * block_bytes / GIB})
    assert stack.manager.staging.capacity == 20
    tokens = list(range(5000, 5000 + 32 * stack.page_size))
    written = on_disk_only(stack, tokens, seed=50)
    req, match, loaded, slots, _ = stack.admit(tokens + [1], "staged")
    assert (device_prefix_len(match), loaded) == (0, 20 * stack.page_size)
    assert stack.finish(req)
    assert all(torch.equal(got, want) for got, want in zip(stack.read_pages(slots), written[:20]))


def test_disk_store_is_announced_only_after_the_host_store(stack_factory, tmp_path):
    stack = disk_stack(stack_factory, tmp_path)
    tokens = list(range(8))
    stack.insert(tokens, seed=2)
    stack.settle()
    order = [medium(e) for e in stack.tree.take_events() if isinstance(e, BlockStored)]
    assert order.index("CPU_PINNED") < order.index("DISK")
    assert all(stack.manager.tiers["disk"].store.registered(i) for i in stack.block_ids(tokens))


def test_disk_only_tier_stores_device_pages_directly(stack_factory, tmp_path):
    stack = disk_stack(stack_factory, tmp_path, host_blocks=0)
    tokens = list(range(100, 120))
    written = stack.insert(tokens, seed=3)
    stack.settle()
    assert stack.linker.connector.stats.offload_blocks_d2d == 5
    stack.evict_all()
    stack.scramble_pool()
    load_exact(stack, tokens, written)


def test_offload_filter_writes_only_reused_blocks(stack_factory, tmp_path):
    stack = disk_stack(stack_factory, tmp_path, host_blocks=16, disable_filter=False)
    tokens = list(range(16))
    written = stack.insert(tokens, seed=4)
    stack.settle()
    assert not disk_stored(stack.tree.take_events())  # seen once: host only
    stack.evict_all()
    load_exact(stack, tokens, written)  # a host hit doubles the block's count to 2: it earns a disk copy
    stack.settle()
    ids = stack.block_ids(tokens)
    assert all(stack.manager.tiers["disk"].store.registered(i) for i in ids)
    assert len(chain_links(disk_stored(stack.tree.take_events()))) == 4


def test_reads_pipelined_in_chunks_and_a_fault_in_a_later_chunk(stack_factory, tmp_path):
    """Ten blocks read three at a time: four NIXL reads, the next ones posted before the first is verified."""
    stack = disk_stack(stack_factory, tmp_path, host_blocks=4, size=128)
    disk = stack.manager.tiers["disk"].store
    disk.chunk_blocks = 3  # blocks per transfer (the buffers were sized for more)
    transfers = []
    post, finish = disk.io.post, disk.io.finish

    def recorded_post(op, local, remote):
        transfers.append((op, len(local) // 2))  # header and block: two descriptors each
        return post(op, local, remote)

    def recorded_finish(posted):
        transfers.append(("finished", 0))
        return finish(posted)

    disk.io.post, disk.io.finish = recorded_post, recorded_finish
    first = list(range(300, 340))
    written = on_disk_only(stack, first, seed=5)
    transfers.clear()
    load_exact(stack, first, written)
    assert [n for op, n in transfers if op == "READ"] == [3, 3, 3, 1]
    assert transfers[:2] == [("READ", 3), ("READ", 3)]  # the second chunk was posted before the first landed

    second = list(range(400, 440))
    on_disk_only(stack, second, seed=6)
    ids = stack.block_ids(second)
    victim = ids[7]  # third chunk: two chunks were read and verified before it
    victim_hash = event_hash(disk, victim)
    flip_bit(segment_path(disk, victim), data_offset(disk, victim) + 5, 0x10)
    stack.tree.take_events()
    req, match, loaded, _, _ = stack.admit(second + [1], "faulty")
    # found, then refused at load(): the request recomputes (0.5.21: the lookup, which pins what it reports, reports none)
    assert (match.host_hit_length, loaded) == ((40, 0) if LOADS_REFUSABLE else (0, 0))
    assert disk_removed(stack.tree.take_events()) == [victim_hash]
    assert [i for i in ids if not disk.registered(i)] == [victim]
    assert dict(disk.stats.invalidated) == {"checksum mismatch": 1}

    # Staging is not a tier: forget what it holds, so the first prefix is read from disk again.
    stack.manager.staging.forget()
    reads = disk.stats.reads
    load_exact(stack, first, written, "again")
    assert disk.stats.reads == reads + 1


def test_a_load_never_evicts_its_own_staged_blocks(stack_factory, tmp_path):
    """Staging full of verified blocks, the oldest of them the head of the prefix being loaded:
    reading the rest of the prefix must evict other staged blocks, not the ones this load needs."""
    stack = disk_stack(stack_factory, tmp_path)
    staging = stack.manager.staging
    prefix = list(range(1100, 1132))  # 8 pages
    written = on_disk_only(stack, prefix, seed=21)
    ids = stack.block_ids(prefix)
    others = list(range(1200, 1200 + 4 * (staging.capacity - 5)))
    on_disk_only(stack, others, seed=22)
    for rid, wanted in (("head", ids[:5]), ("others", stack.block_ids(others))):
        stack.linker.connector.lookup(rid, wanted)  # a request that waits in the queue: its blocks are staged
        assert stack.manager.wait(timeout=30)
        stack.cache.poll()
    assert staging.pool.accounting()["free"] == 0 and all(map(staging.staged, ids[:5]))
    load_exact(stack, prefix, written)
    assert stack.linker.connector.stats.failed_loads == 0


def test_staged_blocks_serve_but_are_not_reported_as_a_tier(stack_factory, tmp_path):
    """A block read into staging and then dropped from disk is still servable (verified bytes in
    memory), but the truth API, like the event stream, no longer counts it as held on disk."""
    stack = disk_stack(stack_factory, tmp_path)
    prefix = list(range(1300, 1316))
    written = on_disk_only(stack, prefix, seed=31)
    ids = stack.block_ids(prefix)
    stack.linker.connector.lookup("early", ids)  # staged while the request waits
    assert stack.manager.wait(timeout=30)
    stack.cache.poll()
    stack.manager.tiers["disk"].store.invalidate(ids, reason="test")  # the disk lets them go (its DISK removals go out)
    assert stack.linker.connector.peek(ids) == (0, 0)
    assert stack.cache.tier_tokens(prefix + [1]).disk == 0
    load_exact(stack, prefix, written)  # ... and the staged copies still serve the load


FAULTS = {  # fault -> what the disk tier counts as invalidated, by reason
    "bit flip": {"checksum mismatch": 1},
    "zero header": {"bad header": 1},
    "wrong block": {"wrong block": 1},
    # Cut inside the victim's bytes: its short read fails the checksum, the next slot has no header (NIXL 1.5: the
    # short reads of the batch fail as transfers, every block of it an I/O error).
    "truncate": {"I/O error": 4} if NIXL_1_5 else {"checksum mismatch": 1, "bad header": 1},
    # The one segment file is gone (or is another inode): every block in it is lost, the
    # prefix's four and the four that pushed it out of the host tier.
    "delete": {"file missing or replaced": 8},
    "replace": {"file missing or replaced": 8},
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_fault_is_a_miss_and_the_block_leaves_the_index(stack_factory, tmp_path, fault, caplog):
    stack = disk_stack(stack_factory, tmp_path)
    disk = stack.manager.tiers["disk"].store
    tokens = list(range(200, 216))
    written = on_disk_only(stack, tokens, seed=7)
    ids = stack.block_ids(tokens)
    victim = ids[2]
    hashes = [event_hash(disk, i) for i in ids]
    path = segment_path(disk, victim)
    if fault == "bit flip":
        flip_bit(path, data_offset(disk, victim) + 100)
    elif fault == "zero header":
        with open(path, "r+b") as f:
            f.seek(header_offset(disk, victim))
            f.write(b"\0" * 64)
    elif fault == "wrong block":  # another block's intact slot (header and bytes) copied over the victim's
        with open(path, "r+b") as f:
            f.seek(header_offset(disk, ids[0]))
            other = f.read(disk.slot_bytes)
            f.seek(header_offset(disk, victim))
            f.write(other)
    elif fault == "truncate":
        os.truncate(path, data_offset(disk, victim))
    elif fault == "delete":
        path.unlink()
    else:  # the same bytes under a new inode: the tier cannot know what else changed
        copy = path.with_suffix(".copy")
        shutil.copyfile(path, copy)
        os.replace(copy, path)
    stack.tree.take_events()
    free_before = stack.allocator.available_size()

    with caplog.at_level(logging.WARNING, logger="sglang_kvbm"):
        req, match, loaded, _, _ = stack.admit(tokens + [1])
    # refused at load(): the request recomputes (0.5.21: the lookup, which pins what it reports, reports none)
    assert (match.host_hit_length, loaded) == ((16, 0) if LOADS_REFUSABLE else (0, 0))
    assert stack.allocator.available_size() == free_before  # nothing leaked
    removed = disk_removed(stack.tree.take_events())
    assert hashes[2] in removed and not disk.registered(victim)
    assert not any(disk.registered(i) for i, h in zip(ids, hashes) if h in removed)
    assert dict(disk.stats.invalidated) == FAULTS[fault]
    assert stack.linker.connector.stats.failed_loads == 1
    assert "disk" in caplog.text
    if fault in ("delete", "replace"):
        assert disk.segments.recreated == 1 and path.exists()
        assert set(hashes) <= set(removed) and len(disk) == 0
        assert disk.accounting()["lost"] == 0 and disk.accounting()["fds"] == 1
    else:
        lost = (ids if NIXL_1_5 else ids[2:]) if fault == "truncate" else [victim]  # NIXL 1.5: the batch's reads fail
        assert [i for i in ids if not disk.registered(i)] == lost

    # The tier keeps working: the request recomputed the same KV (a function of its tokens), the
    # tree stores it again (only the missing blocks go to disk), and it is served from disk exactly.
    assert all(map(torch.equal, stack.insert(tokens, seed=7), written))
    stack.settle()
    push_out_of_host(stack)
    stack.evict_all()
    stack.scramble_pool()
    load_exact(stack, tokens, written)


@needs_refusable_loads  # on 0.5.21 the lookup waits for its verified read: nothing is between lookup and load
def test_disk_page_corrupted_between_lookup_and_load_is_recomputed(stack_factory, tmp_path):
    """The lookup starts the read into staging; the page changes before that read runs."""
    from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    stack = disk_stack(stack_factory, tmp_path)
    disk = stack.manager.tiers["disk"].store
    tokens = list(range(700, 716))
    on_disk_only(stack, tokens, seed=8)
    ids = stack.block_ids(tokens)
    victim = ids[1]
    victim_hash = event_hash(disk, victim)
    stack.tree.take_events()

    gate = threading.Event()
    stack.manager.tiers["disk"]._reader.submit(gate.wait, 60)  # the one disk reader: the lookup's read queues behind this
    req = make_req(tokens + [1], "between")
    match = stack.tree.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens)), req=req))
    assert match.host_hit_length == 16
    assert all(map(stack.manager.staging.reading, ids))  # the lookup started reading every disk block
    flip_bit(segment_path(disk, victim), data_offset(disk, victim) + 7)
    gate.set()
    req.last_node = match.last_device_node
    free_before = stack.allocator.available_size()
    loaded, _ = stack.tree.init_load_back(
        InitLoadBackParams(best_match_node=match.best_match_node, host_hit_length=16, req=req))
    assert loaded == 0 and stack.allocator.available_size() == free_before
    assert disk_removed(stack.tree.take_events()) == [victim_hash]
    assert disk.stats.invalidated["checksum mismatch"] == 1
    assert not disk.registered(victim) and not stack.manager.staging.staged(victim)

    # Bytes verified into staging before the file changed are what a load serves, never the file's new ones.
    others = list(range(800, 816))
    other_written = on_disk_only(stack, others, seed=9)
    other_ids = stack.block_ids(others)
    stack.linker.connector.lookup("prefetch", other_ids)
    assert stack.manager.wait(timeout=30)
    stack.cache.poll()
    assert all(map(stack.manager.staging.staged, other_ids))
    flip_bit(segment_path(disk, other_ids[0]), data_offset(disk, other_ids[0]) + 3)
    load_exact(stack, others, other_written, "staged")


def test_a_failed_read_drops_only_the_copy_it_read(stack_factory, tmp_path):
    """A block written again since a read began (another slot, or a recreated file) is not dropped with it."""
    stack = disk_stack(stack_factory, tmp_path)
    tokens = list(range(16))
    stack.insert(tokens, seed=3)
    stack.settle()
    disk = stack.manager.tiers["disk"].store
    ids = stack.block_ids(tokens)
    where = [disk.located(b) for b in ids]
    stale = [(slot, generation + 1) for slot, generation in where[:2]] + [(slot + 1, g) for slot, g in where[2:]]
    assert disk.invalidate(ids, reason="test", where=stale) == []  # none of them is where the read found it
    assert all(map(disk.registered, ids))
    assert [m.block_id for m in disk.invalidate(ids[:1], reason="test", where=where[:1])] == ids[:1]
    assert disk.stats.invalidated["test"] == 1


def test_retired_segment_is_closed_once_no_transfer_uses_it(stack_factory, tmp_path):
    """A segment file deleted while a read of it is in flight: the read finishes on the old
    descriptor, which (with its NIXL registration) is released only when that read ends."""
    stack = disk_stack(stack_factory, tmp_path)
    disk = stack.manager.tiers["disk"].store
    first, second = list(range(900, 916)), list(range(950, 966))
    written = on_disk_only(stack, first, seed=10)
    on_disk_only(stack, second, seed=11)
    path = segment_path(disk, stack.block_ids(first)[0])
    old_fd = disk.segments.segments[0].fd
    deregistered = []
    deregister = disk.io.deregister
    disk.io.deregister = lambda reg: deregistered.append(reg) or deregister(reg)
    posted, proceed = threading.Event(), threading.Event()
    finish = disk.io.finish

    def held_finish(transfer):  # the read is posted to NIXL on the old descriptor; hold its completion
        posted.set()
        assert proceed.wait(60)
        return finish(transfer)

    disk.io.finish = held_finish
    stack.linker.connector.lookup("first", stack.block_ids(first))  # starts reading `first`
    assert posted.wait(30)
    path.unlink()
    stack.linker.connector.lookup("second", stack.block_ids(second))  # finds the file gone: retires it
    assert disk.segments.recreated == 1 and path.exists() and len(disk) == 0
    assert disk.accounting()["fds"] == 2 and disk.segments.open_descriptors() == 2  # the old one is in use
    assert not deregistered and os.readlink(f"/proc/self/fd/{old_fd}").endswith(f"{path.name} (deleted)")

    disk.io.finish = finish
    proceed.set()
    assert stack.manager.wait(timeout=30)
    stack.cache.poll()  # the read ended: its hold is released, and the retired file with it
    assert disk.accounting()["fds"] == 1 and disk.segments.open_descriptors() == 1 and len(deregistered) == 1
    assert not any(link.endswith(f"{path.name} (deleted)") for link in _fd_links())
    assert disk.accounting()["free"] == 64
    # The read ran on the file as it was when it was posted (its inode lives until the descriptor
    # closes) and was verified: those bytes may be served. Nothing of the new, empty file can be.
    load_exact(stack, first, written)
    assert stack.admit(second + [1], "gone")[2] == 0


def _fd_links() -> list[str]:
    links = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            links.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass
    return links


def test_disk_store_io_runs_on_one_thread_each(stack_factory, tmp_path):
    stack = disk_stack(stack_factory, tmp_path)
    disk = stack.manager.tiers["disk"].store
    on_disk_only(stack, list(range(16)), seed=12)
    stack.admit(list(range(17)), "read")  # the reader thread has read
    writes, failures = disk.stats.writes, disk.stats.write_failures
    with pytest.raises(RuntimeError, match="one thread"):
        disk.write([], [], [])
    errors = []

    def from_another_thread():
        try:
            disk.write([], [], [])
        except RuntimeError as exc:
            errors.append(exc)

    thread = threading.Thread(target=from_another_thread)
    thread.start()
    thread.join()
    assert len(errors) == 1
    with pytest.raises(RuntimeError, match="one thread"):
        disk.read([], [], [])
    assert (disk.stats.writes, disk.stats.write_failures) == (writes, failures)


def test_deleted_segment_in_an_unwritable_directory_is_lost_not_fatal(stack_factory, tmp_path, caplog):
    stack = disk_stack(stack_factory, tmp_path)
    disk = stack.manager.tiers["disk"].store
    tokens = list(range(300, 316))
    on_disk_only(stack, tokens, seed=13)
    ids = stack.block_ids(tokens)
    hashes = [event_hash(disk, i) for i in ids]
    segment_path(disk, ids[0]).unlink()
    stack.tree.take_events()
    make_unwritable(disk.directory)
    try:
        with caplog.at_level(logging.ERROR, logger="sglang_kvbm"):
            assert stack.admit(tokens + [1])[2] == 0
        assert "cannot be recreated" in caplog.text
        assert set(hashes) <= set(disk_removed(stack.tree.take_events()))
        assert disk.segments.lost == 1
        accounting = disk.accounting()
        assert (accounting["registered"], accounting["free"], accounting["lost"], accounting["fds"]) == (0, 0, 64, 0)
        # Host-tier service goes on; nothing is written to the lost segment.
        more = list(range(400, 408))
        written = stack.insert(more, seed=14)
        stack.settle()
        stack.evict_all()
        load_exact(stack, more, written)
        assert len(disk) == 0
    finally:
        make_writable(disk.directory)


def test_cap_evicts_least_recently_used_with_removals(stack_factory, tmp_path):
    stack = disk_stack(stack_factory, tmp_path, disk_blocks=6)
    disk = stack.manager.tiers["disk"].store
    first, second = list(range(16)), list(range(1000, 1016))
    stack.insert(first, seed=15)
    stack.settle()
    first_hashes = [event_hash(disk, i) for i in stack.block_ids(first)]
    stack.tree.take_events()
    stack.insert(second, seed=16)
    stack.settle()
    removed = disk_removed(stack.tree.take_events())
    assert sorted(removed) == sorted(first_hashes[2:])  # a prefix's tail goes first, its head stays reachable
    assert len(disk) == 6 and disk.accounting()["free"] == 0
    assert all(disk.registered(i) for i in stack.block_ids(second))


def test_restart_reuses_blocks_and_another_identity_loads_nothing(tmp_path):
    tokens = list(range(500, 516))
    a = build_stack(host_blocks=4, disk_blocks=64, disk_dir=tmp_path, events=True)
    try:
        written = on_disk_only(a, tokens, seed=17)
        ids = a.block_ids(tokens)
        hashes = [event_hash(a.manager.tiers["disk"].store, i) for i in ids]
    finally:
        a.cache.close()

    b = build_stack(host_blocks=4, disk_blocks=64, disk_dir=tmp_path, events=True)  # same identity
    try:
        assert len(b.manager.tiers["disk"].store) == 8  # `tokens` and the blocks that pushed them out of the host
        stores = disk_stored(b.tree.take_events())  # restored blocks announced, parents first
        links = chain_links(stores)
        assert [h for _, h in links if h in hashes] == hashes
        seen = set()
        for parent, block_hash in links:
            assert parent is None or parent in seen
            seen.add(block_hash)
        load_exact(b, tokens, written)
        assert b.linker.connector.stats.onboard_blocks_d2d == 4
        old_dir = b.manager.tiers["disk"].store.directory
    finally:
        b.cache.close()

    c = build_stack(host_blocks=4, disk_blocks=64, disk_dir=tmp_path, identity=Identity(model_path="another-model"))
    try:
        assert len(c.manager.tiers["disk"].store) == 0 and c.linker.connector.peek(ids) == (0, 0)
        assert c.admit(tokens + [1])[1].host_hit_length == 0
        assert not old_dir.exists()  # reclaimed: no live server held it
    finally:
        c.cache.close()


def test_corrupt_index_is_rebuilt_and_the_tier_starts(tmp_path, caplog):
    a = build_stack(host_blocks=4, disk_blocks=64, disk_dir=tmp_path)
    try:
        a.insert(list(range(16)), seed=18)
        a.settle()
        directory = a.manager.tiers["disk"].store.directory
    finally:
        a.cache.close()
    (directory / "index.msgpack").write_bytes(b"SGKVIDX\x01" + os.urandom(64))
    with caplog.at_level(logging.WARNING, logger="sglang_kvbm"):
        b = build_stack(host_blocks=4, disk_blocks=64, disk_dir=tmp_path)
    try:
        assert b.manager.tiers["disk"].store.wait_rebuilt(timeout=60)  # rebuilt from the blocks' headers (tests/tiers/test_disk_rebuild.py)
        assert "rebuilt the disk index" in caplog.text
        assert len(b.manager.tiers["disk"].store) == 4 and b.manager.tiers["disk"].store.accounting()["free"] == 60
        b.insert(list(range(100, 116)), seed=18)
        b.settle()
        assert len(b.manager.tiers["disk"].store) == 8
    finally:
        b.cache.close()


def test_torn_journal_tail_keeps_the_records_before_it(tmp_path):
    """A crash image: the snapshot is older than the journal, whose last record was half written."""
    tokens = list(range(600, 616))
    a = build_stack(host_blocks=4, disk_blocks=64, disk_dir=tmp_path / "live")
    try:
        written = on_disk_only(a, tokens, seed=19)  # the journal is flushed every poll
        source = a.manager.tiers["disk"].store.directory
        crashed = tmp_path / "crashed" / source.name
        shutil.copytree(source, crashed)  # the files as they are at this instant, no clean close
    finally:
        a.cache.close()
    assert (crashed / "journal").stat().st_size > 0  # the blocks are only in the journal, not in the snapshot
    with open(crashed / "journal", "ab") as f:
        f.write(b"\x10\x00\x00\x00torn")
    b = build_stack(host_blocks=4, disk_blocks=64, disk_dir=tmp_path / "crashed")
    try:
        assert b.manager.tiers["disk"].store.directory == crashed
        assert len(b.manager.tiers["disk"].store) == 8
        load_exact(b, tokens, written)
    finally:
        b.cache.close()


def _o_direct(fd: int) -> bool:
    flags = next(line for line in Path(f"/proc/self/fdinfo/{fd}").read_text().splitlines() if line.startswith("flags"))
    return bool(int(flags.split()[1], 8) & os.O_DIRECT)


@pytest.mark.parametrize("o_direct", [True, False])
def test_buffered_io_when_o_direct_is_disabled(stack_factory, tmp_path, o_direct):
    stack = disk_stack(stack_factory, tmp_path, config={"disk_disable_o_direct": not o_direct})
    disk = stack.manager.tiers["disk"].store
    assert disk.o_direct is o_direct
    assert _o_direct(disk.segments.segments[0].fd) is o_direct
    tokens = list(range(16))
    written = on_disk_only(stack, tokens, seed=20)
    load_exact(stack, tokens, written)


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
    a = build_stack(host_blocks=4, disk_blocks=16, disk_dir=tmp_path)
    directory = a.manager.tiers["disk"].store.directory
    a.cache.close()
    directory.chmod(0o777)  # another user could replace its files
    with pytest.raises(ConfigError, match="writable by others"):
        build_stack(host_blocks=4, disk_blocks=16, disk_dir=tmp_path)


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
        build_stack(host_blocks=4, disk_blocks=512, disk_dir=tiny_tmpfs)  # 512 x 8 KiB slots: 4 MiB


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


@needs_nixl_1_3  # NIXL 1.5 reports these writes failed itself
def test_writes_lost_below_the_filesystem_are_caught_on_read(eio_filesystem, caplog):
    """The kernel acknowledges the O_DIRECT writes, then the loop device cannot store them
    ("Buffer I/O error ... lost async page write" in the kernel log): NIXL reports them done.
    Only verification on read stands between that and serving zeros as KV."""
    mount, backing = eio_filesystem
    stack = build_stack(size=256, host_blocks=64, disk_blocks=1024, disk_dir=mount, events=True)
    try:
        disk = stack.manager.tiers["disk"].store
        with open(backing / "filler", "wb") as filler:  # ext4 still believes it has room
            try:
                while True:
                    filler.write(b"\xff" * (1 << 16))
                    filler.flush()
            except OSError:
                pass
        for round_ in range(16):  # 16 x 60 blocks: nearly every one of the 1024 slots
            tokens = [round_ * 100_000 + i for i in range(60 * 4)]
            stack.insert(tokens, seed=round_)
            stack.settle()
            stack.evict_all()
        assert disk.stats.write_failures == 0 and len(disk) > 0  # nothing was reported failed
        push = [9_000_000 + i for i in range(64 * 4)]  # pushes `tokens` out of the host tier
        stack.insert(push[:128], seed=100)
        stack.insert(push[128:], seed=101)
        stack.settle()
        stack.evict_all()
        ids = stack.block_ids(tokens)
        assert stack.linker.connector.peek(ids) == (0, 60)
        hashes = {event_hash(disk, i): i for i in ids}
        stack.tree.take_events()
        with caplog.at_level(logging.WARNING, logger="sglang_kvbm"):
            assert stack.admit(tokens + [1])[2] == 0
        assert sum(disk.stats.invalidated.values()) >= 1
        assert "failed verification" in caplog.text
        removed = disk_removed(stack.tree.take_events())
        assert removed and set(removed) <= set(hashes)
        assert not any(disk.registered(hashes[h]) for h in removed)
    finally:
        stack.cache.close()


def test_stats_give_the_disk_slot_size_while_the_disk_tier_is_empty(stack_factory, tmp_path):
    """``/stats`` block sizes: an empty disk tier is still a disk tier (it has a length of 0, not None)."""
    from sglang_kvbm.observe.endpoint import stats_of

    stack = disk_stack(stack_factory, tmp_path)
    assert len(stack.manager.tiers["disk"].store) == 0
    assert stats_of(stack.linker)["block_bytes"]["disk"] == stack.manager.tiers["disk"].store.slot_bytes > 0


def test_a_directory_is_created_and_locked_at_once_for_every_other_claim(tmp_path):
    """Two identities starting side by side on one root (a server's TP ranks or PP stages): neither can take
    the other's new directory for a stale one between its creation and its lock, and remove it under it."""
    from sglang_kvbm.tiers.disk import directory

    claimed = {}

    def claim_b():
        claimed["b"] = directory.claim(tmp_path, b"\x0b" * 32)

    with directory._claims(tmp_path):  # what A holds from creating its directory to locking it
        a_dir = directory.identity_dir(tmp_path, b"\x0a" * 32)
        a_dir.mkdir(mode=0o700)
        (a_dir / "lock").touch(mode=0o600)  # created, not yet locked: the window B's reclaim must not see
        other = threading.Thread(target=claim_b)
        other.start()
        other.join(timeout=1.0)
        assert other.is_alive(), "B claimed (and reclaimed) while A was between creating and locking"
        path, lock, _ = directory._claim(tmp_path, b"\x0a" * 32, ())
    other.join(timeout=60)
    assert a_dir.exists() and path == a_dir, "B removed A's directory"
    assert claimed["b"][0].exists()
    for _, held, _ in (claimed["b"], (path, lock, None)):
        held.close()
    lock_file = tmp_path / f".sglang-kvbm-claims-{os.getuid()}.lock"
    assert stat.S_IMODE(lock_file.stat().st_mode) == 0o600


def test_a_restarted_tp_server_keeps_every_ranks_disk_tier(tmp_path):
    """Each TP rank claims its own directory under one root; the rank that claims first on a restart must not
    reclaim the directories of its siblings that have not claimed theirs yet (they are this server's)."""
    ranks = [{"tp_rank": r, "tp_size": 2} for r in (0, 1)]
    tokens = list(range(3000, 3016))
    dirs = []
    for r in ranks:  # the first run: each rank writes its shard of the prefix to disk
        s = build_stack(host_blocks=4, disk_blocks=64, disk_dir=tmp_path, identity=Identity(ranks=r))
        try:
            s.insert(tokens, seed=40 + r["tp_rank"])
            s.settle()
            dirs.append(s.manager.tiers["disk"].store.directory)
        finally:
            s.cache.close()
    restarted = build_stack(host_blocks=4, disk_blocks=64, disk_dir=tmp_path, identity=Identity(ranks=ranks[0]))
    try:  # rank 0 starts first: rank 1's directory, not held by anyone yet, is its sibling's, not stale
        assert dirs[1].exists()
        assert len(restarted.manager.tiers["disk"].store) == 4
    finally:
        restarted.cache.close()
    other = build_stack(host_blocks=4, disk_blocks=64, disk_dir=tmp_path,
                        identity=Identity(ranks=ranks[0], model_path="another-model"))
    try:  # another server's start still reclaims what no live server holds
        assert not dirs[1].exists() and not dirs[0].exists()
    finally:
        other.cache.close()
