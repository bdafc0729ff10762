"""The disk index on disk: a snapshot plus an append-only journal, for warm restarts.

Every change to the slot index since the last snapshot is one journal record
(length, xxh3, msgpack payload); a torn or corrupt tail is ignored. The
snapshot is rewritten (fsync, atomic rename) when the journal has grown long
and old, and at close. Anything unreadable is discarded, never trusted: a
restored block is verified again when it is read.
"""

from __future__ import annotations

import logging
import os
import struct
import time
from pathlib import Path
from typing import Callable, Optional

import msgspec
import xxhash

from sglang_kvbm.backends.local.disk.format import FORMAT_VERSION, BlockHeader

logger = logging.getLogger(__name__)

_INDEX_MAGIC = b"SGKVIDX\x01"
_INDEX_PREFIX = struct.Struct("<8sQ")
_RECORD_PREFIX = struct.Struct("<IQ")  # payload length, payload xxh3-64


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

    def load(self) -> list[tuple[int, BlockHeader]]:
        """``(slot, header)`` of every block the last run left, later records winning."""
        by_slot: dict[int, BlockHeader] = {}
        slot_of: dict[str, int] = {}
        path = self._dir / "index.msgpack"
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
                logger.warning("kvbm: discarded the disk index %s (%s); the disk tier starts empty", path, exc)
                by_slot.clear()
                slot_of.clear()
                (self._dir / "journal").unlink(missing_ok=True)
        replayed = self._replay(by_slot, slot_of)
        if replayed:
            logger.info("kvbm: replayed %d disk index changes from the journal", replayed)
        return list(by_slot.items())

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

    def _replay(self, by_slot: dict[int, BlockHeader], slot_of: dict[str, int]) -> int:
        try:
            raw = (self._dir / "journal").read_bytes()
        except FileNotFoundError:
            return 0
        offset = count = 0
        while offset + _RECORD_PREFIX.size <= len(raw):
            length, digest = _RECORD_PREFIX.unpack_from(raw, offset)
            payload = raw[offset + _RECORD_PREFIX.size : offset + _RECORD_PREFIX.size + length]
            if len(payload) != length or xxhash.xxh3_64_intdigest(payload) != digest:
                logger.warning("kvbm: the disk index journal ends in a torn or corrupt record; ignoring the rest")
                break
            try:
                record = msgspec.msgpack.decode(payload, type=_Record)
            except msgspec.DecodeError:
                break
            if record.op == "add" and record.header is not None:
                self._restore(by_slot, slot_of, record.slot, record.header)
            elif record.op == "del":
                slot = slot_of.pop(record.block_id, None)
                if slot is not None:
                    by_slot.pop(slot, None)
            elif record.op == "clear":
                by_slot.clear()
                slot_of.clear()
            offset += _RECORD_PREFIX.size + length
            count += 1
        return count

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

    def close(self, entries: list[tuple[int, BlockHeader]]) -> None:
        if self._file is None:
            return
        self.snapshot(entries)
        self._file.close()
        self._file = None
