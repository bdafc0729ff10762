"""The disk index on disk: a snapshot plus an append-only journal, for warm restarts.

Every change to the slot index since the last snapshot is one journal record
(length, xxh3, msgpack payload). The snapshot is rewritten (fsync, atomic
rename) when the journal has grown long and old, and at close. Nothing read is
trusted beyond its checksum and its typed decoding: a restored block is
verified again when it is read.

A torn last record is what a crash while appending leaves: it is ignored and
the records before it are replayed. Anything else unreadable is *damage*
(:attr:`Loaded.damage`): an unreadable snapshot (or none beside a journal), or
a bad record with good records after it (found by resynchronising on the next
record whose checksum holds). The caller then rebuilds the index from the
blocks themselves (``rebuild``); what the readable parts said is only a hint
for it (which copy of a block, and in what use order).
"""

from __future__ import annotations

import logging
import os
import re
import struct
import time
from pathlib import Path
from typing import Callable, NamedTuple, Optional

import msgspec
import xxhash

from sglang_kvbm.tiers.format import FORMAT_VERSION, BlockHeader

logger = logging.getLogger(__name__)

_INDEX_MAGIC = b"SGKVIDX\x01"
_INDEX_PREFIX = struct.Struct("<8sQ")
_RECORD_PREFIX = struct.Struct("<IQ")  # payload length, payload xxh3-64
_MAX_RECORD = 1 << 20  # a record is one header (a few KiB): a longer length is not one
_RECORD_START = re.compile(rb"\x94\xa3|\x94\xa5")  # every payload opens so: a 4-array, then "add"/"del" or "clear"


class _Record(msgspec.Struct, array_like=True):
    """One change to the index: add (slot, header), remove (block_id) or clear."""

    op: str
    slot: int = -1
    header: Optional[BlockHeader] = None
    block_id: str = ""


class _Entry(msgspec.Struct, array_like=True):
    slot: int
    header: BlockHeader


class _Snapshot(msgspec.Struct, array_like=True):
    version: int
    fingerprint: bytes
    block_bytes: int
    num_slots: int
    entries: list[_Entry]


class IndexJournal:
    def __init__(self, directory: Path, fingerprint: bytes, block_bytes: int, num_slots: int) -> None:
        self._dir = directory
        self._fingerprint = fingerprint
        self._block_bytes = block_bytes
        self._num_slots = num_slots
        self._file = None
        self._records = 0
        self._dirty = False
        self._last_snapshot = time.monotonic()

    def load(self) -> "Loaded":
        """What the last run left: ``(slot, header)`` of every block, later records winning, and any damage."""
        by_slot: dict[int, BlockHeader] = {}
        slot_of: dict[str, int] = {}
        path = self._dir / "index.msgpack"
        damage = None
        if path.exists():
            try:
                raw = path.read_bytes()
                magic, digest = _INDEX_PREFIX.unpack_from(raw)
                payload = raw[_INDEX_PREFIX.size :]
                if magic != _INDEX_MAGIC or xxhash.xxh3_64_intdigest(payload) != digest:
                    raise ValueError("bad magic or checksum")
                snapshot = msgspec.msgpack.decode(payload, type=_Snapshot)
                if (snapshot.version, snapshot.fingerprint, snapshot.block_bytes) != (
                    FORMAT_VERSION, self._fingerprint, self._block_bytes,
                ):
                    raise ValueError("written by another configuration")
                for entry in snapshot.entries:
                    self._restore(by_slot, slot_of, entry.slot, entry.header)
            except (OSError, ValueError, struct.error, msgspec.DecodeError) as exc:
                damage = f"the snapshot {path.name} is unreadable: {exc}"
                by_slot.clear()
                slot_of.clear()
        elif (self._dir / "journal").exists() and (self._dir / "journal").stat().st_size:
            damage = f"the snapshot {path.name} is missing beside a journal"
        replayed, broken = self._replay(by_slot, slot_of)
        if replayed and damage is None and broken is None:
            logger.info("kvbm: replayed %d disk index changes from the journal", replayed)
        return Loaded(list(by_slot.items()), damage or broken)

    def _restore(self, by_slot: dict[int, BlockHeader], slot_of: dict[str, int], slot: int, header: BlockHeader) -> None:
        """Record ``header`` in ``slot``; a slot holds one block and a block one slot: the later record wins."""
        if not 0 <= slot < self._num_slots or header.fingerprint != self._fingerprint:
            return
        old = slot_of.pop(header.block_id, None)
        if old is not None:
            by_slot.pop(old, None)
        displaced = by_slot.get(slot)
        if displaced is not None:
            slot_of.pop(displaced.block_id, None)
        by_slot[slot] = header
        slot_of[header.block_id] = slot

    def _replay(self, by_slot: dict[int, BlockHeader], slot_of: dict[str, int]) -> tuple[int, Optional[str]]:
        """Apply every intact record; how many, and the damage if a bad one has good ones after it."""
        try:
            raw = (self._dir / "journal").read_bytes()
        except FileNotFoundError:
            return 0, None
        offset = count = 0
        damage = None
        while offset + _RECORD_PREFIX.size <= len(raw):
            record, end = _record_at(raw, offset)
            if record is None:
                resumed = _next_record(raw, offset + 1)
                if resumed is None:
                    logger.warning("kvbm: the disk index journal ends in a torn record (%d bytes, a crash while it "
                                   "was written); ignoring it", len(raw) - offset)
                    break
                damage = damage or f"journal record {count + 1} (byte {offset} of {len(raw)}) is bad, with records after it"
                offset = resumed
                continue
            if record.op == "add" and record.header is not None:
                self._restore(by_slot, slot_of, record.slot, record.header)
            elif record.op == "del":
                slot = slot_of.pop(record.block_id, None)
                if slot is not None:
                    by_slot.pop(slot, None)
            elif record.op == "clear":
                by_slot.clear()
                slot_of.clear()
            offset = end
            count += 1
        return count, damage

    def open(self) -> None:
        fd = os.open(self._dir / "journal", os.O_RDWR | os.O_CREAT, 0o600)
        self._file = os.fdopen(fd, "r+b")
        self._file.seek(0, os.SEEK_END)

    def added(self, slot: int, header: BlockHeader) -> None:
        self._log(_Record("add", slot, header))

    def removed(self, block_id: str) -> None:
        self._log(_Record("del", block_id=block_id))

    def cleared(self) -> None:
        self._log(_Record("clear"))

    def _log(self, record: _Record) -> None:
        payload = msgspec.msgpack.encode(record)
        self._file.write(_RECORD_PREFIX.pack(len(payload), xxhash.xxh3_64_intdigest(payload)) + payload)
        self._records += 1
        self._dirty = True

    def persist(self, entries: Callable[[], list[tuple[int, BlockHeader]]], *, force: bool = False,
                interval: float = 60.0) -> None:
        """Flush the journal; rewrite the snapshot when forced, or when the journal is long and old."""
        if not self._dirty and not force:
            return
        try:
            self._file.flush()
        except OSError as exc:
            logger.warning("kvbm: could not append to the disk index journal (%s)", exc.strerror)
        now = time.monotonic()
        current = entries() if force or now - self._last_snapshot > interval else None
        if current is not None and (force or self._records > 4 * max(1024, len(current))):
            self.snapshot(current)
            self._last_snapshot = now
        self._dirty = False

    def snapshot(self, entries: list[tuple[int, BlockHeader]]) -> None:
        snapshot = _Snapshot(FORMAT_VERSION, self._fingerprint, self._block_bytes, self._num_slots,
                             [_Entry(slot, header) for slot, header in entries])
        payload = msgspec.msgpack.encode(snapshot)
        path = self._dir / "index.msgpack"
        tmp = path.with_suffix(".tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(_INDEX_PREFIX.pack(_INDEX_MAGIC, xxhash.xxh3_64_intdigest(payload)))
                f.write(payload)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            self._file.truncate(0)
            self._file.seek(0)
            self._records = 0
        except OSError as exc:
            logger.warning("kvbm: could not write the disk index %s (%s)", path, exc.strerror)

    def rekey(self, directory: Path, fingerprint: bytes, entries: list[tuple[int, BlockHeader]]) -> None:
        """Go on in ``directory`` (the same files, renamed) under another identity, starting from ``entries``.

        The snapshot is rewritten under ``fingerprint`` and the journal emptied:
        nothing recorded under the old identity is replayed under the new one,
        and records of the new one are ignored by a server of the old (every
        record's header names its fingerprint).
        """
        self._dir, self._fingerprint = directory, fingerprint
        self.snapshot(entries)
        self._last_snapshot = time.monotonic()

    def close(self, entries: Optional[list[tuple[int, BlockHeader]]]) -> None:
        """Write the snapshot of ``entries`` and close; None leaves the files as they are (a rebuild not done)."""
        if self._file is None:
            return
        if entries is not None:
            self.snapshot(entries)
        self._file.close()
        self._file = None


class Loaded(NamedTuple):
    entries: list[tuple[int, BlockHeader]]  # what the readable parts say, least recently used first
    damage: Optional[str]  # why they cannot be trusted whole (rebuild from the blocks); None when they can


def _record_at(raw: bytes, offset: int) -> tuple[Optional[_Record], int]:
    """The intact record at ``offset`` and where it ends, or ``(None, offset)``."""
    length, digest = _RECORD_PREFIX.unpack_from(raw, offset)
    start = offset + _RECORD_PREFIX.size
    if length > _MAX_RECORD or start + length > len(raw):
        return None, offset
    payload = raw[start : start + length]
    if xxhash.xxh3_64_intdigest(payload) != digest:
        return None, offset
    try:
        return msgspec.msgpack.decode(payload, type=_Record), start + length
    except msgspec.DecodeError:  # a checksum that holds over bytes that are no record: crafted
        return None, offset


def _next_record(raw: bytes, start: int) -> Optional[int]:
    """Offset of the first intact record at or after ``start``, if any (candidates found in C)."""
    for match in _RECORD_START.finditer(raw, start + _RECORD_PREFIX.size):
        offset = match.start() - _RECORD_PREFIX.size
        if _record_at(raw, offset)[0] is not None:
            return offset
    return None
