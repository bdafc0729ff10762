"""A damaged disk index is rebuilt from the blocks' own headers, not thrown away (``disk/rebuild.py``).

Each test writes real blocks through the stack (``build_stack``: SGLang's tree, the linker, real
segment files through NIXL), damages the index files as a crash or a bad disk would, restarts on
the same directory and checks what the rebuilt tier serves: every block whose header and bytes
verify, byte for byte; nothing else. A scan is held with ``rebuild.gate`` where a test must see
the tier while it runs.
"""

from __future__ import annotations

import logging
import shutil
import threading

import msgspec
import pytest
import torch
import xxhash
from sglang.srt.disaggregation.kv_events import BlockStored

from conftest import build_stack, chain_links
from harness.disk import flip_bit, header_offset, load_exact, medium, on_disk_only, segment_path, slot_of
from sglang_kvbm.tiers.disk import rebuild
from sglang_kvbm.tiers.format import MAGIC, decode_header, encode_header

pytestmark = pytest.mark.usefixtures("loads_wait_for_their_reads")  # what a load serves, not how long it waits

DISK = {"host_blocks": 4, "disk_blocks": 64}
WAIT = 60


def flip_bytes(path, offset: int, count: int = 4) -> None:
    for i in range(count):
        flip_bit(path, offset + i, 0xFF)


def written_and_closed(root, groups, *, events: bool = False):
    """Write each token group to disk only, close cleanly; returns the directory and what each group wrote."""
    stack = build_stack(disk_dir=root, events=events, **DISK)
    try:
        written = [on_disk_only(stack, tokens, seed=seed) for seed, tokens in enumerate(groups, 30)]
        return stack.manager.tiers["disk"].store.directory, written, len(stack.manager.tiers["disk"].store)
    finally:
        stack.cache.close()


def crash_image(root, groups):
    """Write each group to disk only and copy the directory as it is (no clean close): a crash image.

    The snapshot is the empty one written at start; every block lives in the journal."""
    stack = build_stack(disk_dir=root / "live", **DISK)
    try:
        written = [on_disk_only(stack, tokens, seed=seed) for seed, tokens in enumerate(groups, 40)]
        source = stack.manager.tiers["disk"].store.directory
        crashed = root / "crashed" / source.name
        shutil.copytree(source, crashed)
        return crashed, written, len(stack.manager.tiers["disk"].store)
    finally:
        stack.cache.close()


def records(journal) -> list[int]:
    """Byte offset of every record in a journal file (its 12-byte prefix: payload length, xxh3)."""
    raw, offset, out = journal.read_bytes(), 0, []
    while offset + 12 <= len(raw):
        out.append(offset)
        offset += 12 + int.from_bytes(raw[offset : offset + 4], "little")
    return out


def restarted(root, **kwargs):
    stack = build_stack(disk_dir=root, **DISK, **kwargs)
    return stack, stack.manager.tiers["disk"].store


GROUPS = [list(range(700, 716)), list(range(800, 816))]


def test_flipped_snapshot_keeps_every_verifying_block(tmp_path, caplog, monkeypatch):
    directory, written, held = written_and_closed(tmp_path, GROUPS)
    flip_bytes(directory / "index.msgpack", (directory / "index.msgpack").stat().st_size // 2)
    gate = threading.Event()  # held until the stack is built: the blocks are taken in below, not by a poll
    monkeypatch.setattr(rebuild, "gate", gate)
    with caplog.at_level(logging.INFO, logger="sglang_kvbm"):
        stack, disk = restarted(tmp_path, events=True)
        assert disk.rebuilding
        stack.tree.take_events()
        gate.set()
        assert disk.wait_rebuilt(timeout=WAIT)
    try:
        assert "rebuilding the disk index of" in caplog.text  # the progress line
        assert f"kept {held} blocks" in caplog.text
        assert len(disk) == held == 16 and disk.accounting()["free"] == 64 - held
        metas = disk.take_restored()
        assert sorted(m.block_id for m in metas) == sorted(h.block_id for _, h in disk._index.entries())
        assert disk.take_restored() == []  # announced once
        stack.manager.tiers["disk"]._announce_restored(metas)  # as the tier announces a clean restart's blocks
        stack.cache.poll()
        stores = [e for e in stack.tree.take_events() if isinstance(e, BlockStored) and medium(e) == "DISK"]
        seen = set()
        for parent, block_hash in chain_links(stores):  # parents first: the router drops an orphan
            assert parent is None or parent in seen
            seen.add(block_hash)
        assert len(seen) == held
        for tokens, pages in zip(GROUPS, written):
            load_exact(stack, tokens, pages, rid=f"r{tokens[0]}")
    finally:
        stack.cache.close()
    again, disk = restarted(tmp_path)  # a fresh snapshot was written: the next restart is a normal one
    try:
        assert not disk.rebuilding and len(disk) == held
    finally:
        again.cache.close()


@pytest.mark.parametrize("where", ["payload", "length"])
def test_bad_journal_record_in_the_middle_keeps_the_blocks_after_it(tmp_path, where, caplog):
    crashed, written, held = crash_image(tmp_path, GROUPS)
    offsets = records(crashed / "journal")
    assert len(offsets) >= held  # every block was added by a record of its own
    flip_bytes(crashed / "journal", offsets[0] + (20 if where == "payload" else 2), 1)
    with caplog.at_level(logging.WARNING, logger="sglang_kvbm"):
        stack, disk = restarted(tmp_path / "crashed")
    try:
        assert "journal record 1 (byte 0" in caplog.text
        assert disk.wait_rebuilt(timeout=WAIT)
        assert len(disk) == held  # the records after the bad one are kept as well: every block verifies
        for tokens, pages in zip(GROUPS, written):
            load_exact(stack, tokens, pages, rid=f"r{tokens[0]}")
    finally:
        stack.cache.close()


def test_torn_last_record_is_replayed_without_a_rebuild(tmp_path, caplog):
    crashed, written, held = crash_image(tmp_path, GROUPS)
    journal = crashed / "journal"
    last = records(journal)[-1]
    with open(journal, "r+b") as f:  # the last record half written
        f.truncate(last + 12 + (journal.stat().st_size - last - 12) // 2)
    with caplog.at_level(logging.WARNING, logger="sglang_kvbm"):
        stack, disk = restarted(tmp_path / "crashed")
    try:
        assert not disk.rebuilding and "damaged" not in caplog.text
        assert "ends in a torn record" in caplog.text
        assert len(disk) == held - 1  # every record before it
        load_exact(stack, GROUPS[0], written[0])
    finally:
        stack.cache.close()


def _other_identity(path, offset: int, header_bytes: int) -> None:
    """Rewrite a slot's header as another server's (its checksums intact): only the fingerprint differs."""
    with open(path, "r+b") as f:
        f.seek(offset)
        row = torch.frombuffer(bytearray(f.read(header_bytes)), dtype=torch.uint8)
        header = decode_header(row)
        encode_header(msgspec.structs.replace(header, fingerprint=bytes(16)), row)
        f.seek(offset)
        f.write(row.numpy().tobytes())


def _crafted_header(path, offset: int) -> None:
    """A header whose framing and checksum hold around bytes that are no header (a msgpack bomb, 4000 deep)."""
    payload = b"\x91" * 4000 + b"\xc0"
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(MAGIC + len(payload).to_bytes(4, "little") + xxhash.xxh3_64_intdigest(payload).to_bytes(8, "little")
                + payload)


@pytest.mark.parametrize("fault", ["bad bytes", "bad header", "crafted header", "another identity"])
def test_a_block_that_does_not_verify_is_not_kept(tmp_path, fault, caplog):
    stack = build_stack(disk_dir=tmp_path, **DISK)
    try:
        written = on_disk_only(stack, GROUPS[0], seed=50)
        disk = stack.manager.tiers["disk"].store
        ids = stack.block_ids(GROUPS[0])
        victim = ids[2]
        path, offset, header_bytes = segment_path(disk, victim), header_offset(disk, victim), disk.header_bytes
        held = len(disk)
        directory = disk.directory
        assert slot_of(disk, victim) is not None
    finally:
        stack.cache.close()
    if fault == "bad bytes":
        flip_bit(path, offset + header_bytes + 100)
    elif fault == "bad header":
        flip_bit(path, offset + 40)
    elif fault == "crafted header":
        _crafted_header(path, offset)
    else:
        _other_identity(path, offset, header_bytes)
    flip_bytes(directory / "index.msgpack", 20)
    with caplog.at_level(logging.WARNING, logger="sglang_kvbm"):
        stack, disk = restarted(tmp_path)
    try:
        assert disk.wait_rebuilt(timeout=WAIT)
        counted = {"bad bytes": "1 with bad bytes", "bad header": "1 with a bad header",
                   "crafted header": "1 with a bad header", "another identity": "1 of another identity"}[fault]
        assert counted in caplog.text
        assert len(disk) == held - 1 and not disk.registered(victim)
        assert all(disk.registered(i) for i in ids if i != victim)
        assert stack.linker.connector.peek(ids) == (0, 2)  # the prefix stops at the block not kept
        load_exact(stack, GROUPS[0][:8], written[:2])
    finally:
        stack.cache.close()


def test_while_the_scan_runs_the_tier_misses_and_takes_no_writes(tmp_path, monkeypatch):
    directory, written, held = written_and_closed(tmp_path, GROUPS[:1])
    flip_bytes(directory / "index.msgpack", 8)  # its checksum
    gate = threading.Event()
    monkeypatch.setattr(rebuild, "gate", gate)
    stack, disk = restarted(tmp_path)
    try:
        ids = stack.block_ids(GROUPS[0])
        assert disk.rebuilding and disk.accounting()["rebuilding"] == 64
        assert stack.linker.connector.peek(ids) == (0, 0)
        _, match, loaded, _, _ = stack.admit(GROUPS[0] + [1], "during")
        assert (match.host_hit_length, loaded) == (0, 0)  # a miss: the request recomputes
        stack.insert(list(range(900, 916)), seed=51)  # the host tier takes it; the disk refuses the write
        stack.settle()
        stack.cache.poll()
        assert len(disk) == 0 and disk.accounting()["free"] == 0 and disk.rebuilding
        gate.set()
        assert disk.wait_rebuilt(timeout=WAIT)
        assert len(disk) == held and disk.accounting()["free"] == 64 - held
        load_exact(stack, GROUPS[0], written[0])
        stack.insert(list(range(1000, 1016)), seed=52)  # writes go to disk again
        stack.settle()
        assert len(disk) > held
    finally:
        gate.set()
        stack.cache.close()


def test_close_during_the_scan_leaves_the_files_for_the_next_start(tmp_path, monkeypatch):
    directory, written, held = written_and_closed(tmp_path, GROUPS[:1])
    flip_bytes(directory / "index.msgpack", 30)
    damaged = (directory / "index.msgpack").read_bytes()
    monkeypatch.setattr(rebuild, "gate", threading.Event())  # never set: the scan is stopped before it reads
    stack, disk = restarted(tmp_path)
    assert disk.rebuilding
    stack.cache.close()
    monkeypatch.setattr(rebuild, "gate", None)
    assert (directory / "index.msgpack").read_bytes() == damaged
    stack, disk = restarted(tmp_path)
    try:
        assert disk.wait_rebuilt(timeout=WAIT) and len(disk) == held
        load_exact(stack, GROUPS[0], written[0])
    finally:
        stack.cache.close()


def test_dropping_the_tiers_during_the_scan_starts_the_disk_empty(tmp_path, monkeypatch):
    directory, _, _ = written_and_closed(tmp_path, GROUPS[:1])
    flip_bytes(directory / "index.msgpack", 30)
    monkeypatch.setattr(rebuild, "gate", threading.Event())  # never set
    stack, disk = restarted(tmp_path)
    try:
        stack.linker.drop_tiers()  # a weight update: nothing the scan would find may be served
        assert not disk.rebuilding and len(disk) == 0 and disk.accounting()["free"] == 64
        assert disk.take_restored() == []
        stack.insert(GROUPS[1], seed=53)
        stack.settle()
        assert len(disk) == 4
    finally:
        stack.cache.close()


def test_a_verifying_block_the_index_had_freed_is_kept(tmp_path):
    """Flushed (freed in the index: a ``clear`` in the journal) but not overwritten: a normal restart honours
    the journal and starts empty; a rebuild keeps the blocks, whose bytes still verify (see ``rebuild``)."""
    stack = build_stack(disk_dir=tmp_path / "live", **DISK)
    try:
        written = on_disk_only(stack, GROUPS[0], seed=60)
        held = len(stack.manager.tiers["disk"].store)
        stack.tree.reset()  # what /flush_cache does
        stack.cache.poll()  # the journal is flushed every poll
        assert len(stack.manager.tiers["disk"].store) == 0
        source = stack.manager.tiers["disk"].store.directory
        for image in ("intact", "damaged"):  # crash images: the blocks' records and the clear are in the journal
            shutil.copytree(source, tmp_path / image / source.name)
    finally:
        stack.cache.close()
    stack, disk = restarted(tmp_path / "intact")
    try:
        assert not disk.rebuilding and len(disk) == 0
    finally:
        stack.cache.close()
    flip_bytes(tmp_path / "damaged" / source.name / "index.msgpack", 12)
    stack, disk = restarted(tmp_path / "damaged")
    try:
        assert disk.wait_rebuilt(timeout=WAIT) and len(disk) == held
        load_exact(stack, GROUPS[0], written)
    finally:
        stack.cache.close()
