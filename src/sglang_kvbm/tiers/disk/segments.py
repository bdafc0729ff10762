"""The disk tier's segment files: fixed slots (``header | block``), preallocated, registered with NIXL.

Slots are spread over files of at most 1 GiB. A file deleted or replaced under
the server is *retired*: its blocks are lost (the caller publishes their
removal), the file is recreated empty, and the old descriptor and its NIXL
registration are released once no transfer in flight still uses them. Every
transfer holds the segments it touches (:meth:`SegmentFiles.hold`) from
submission to completion; the holds are taken and released on the scheduler
thread.
"""

from __future__ import annotations

import collections
import logging
import os
from pathlib import Path
from typing import Sequence

from sglang_kvbm.tiers.disk.nixl_io import NixlFileIO
from sglang_kvbm.tiers.disk.setup import fallocate, zerofill

logger = logging.getLogger(__name__)

SEGMENT_BYTES = 1 << 30


class Segment:
    __slots__ = ("index", "path", "slots", "first", "fd", "inode", "generation", "alive", "reg")

    def __init__(self, index: int, path: Path, first: int, slots: int) -> None:
        self.index = index
        self.path = path
        self.first = first
        self.slots = slots
        self.fd = -1
        self.inode = -1
        self.generation = 0
        self.alive = False
        self.reg = None


class SegmentFiles:
    def __init__(
        self, directory: Path, num_slots: int, slot_bytes: int, *, o_direct: bool, preallocate: str, io: NixlFileIO
    ) -> None:
        self.directory = directory
        self.slot_bytes = slot_bytes
        self.o_direct = o_direct
        self._preallocate = preallocate
        self._io = io
        self.per_file = max(1, min(num_slots, SEGMENT_BYTES // slot_bytes))
        self.segments: list[Segment] = []
        for k in range(-(-num_slots // self.per_file)):
            slots = min(self.per_file, num_slots - k * self.per_file)
            self.segments.append(Segment(k, directory / f"seg-{k:04d}.kv", k * self.per_file, slots))
        for segment in self.segments:
            self._open(segment)
        names = {s.path for s in self.segments}
        for path in directory.glob("seg-*.kv"):
            if path not in names:
                path.unlink(missing_ok=True)
        self._holds: collections.Counter = collections.Counter()  # (segment, generation) -> transfers in flight
        self._retired: list[tuple[int, int, int, object]] = []  # (segment, generation, fd, registration)
        self.recreated = 0
        self.lost = 0

    def _open(self, segment: Segment) -> None:
        flags = os.O_RDWR | os.O_CREAT | (os.O_DIRECT if self.o_direct else 0)
        fd = os.open(segment.path, flags, 0o600)
        try:
            size = segment.slots * self.slot_bytes
            current = os.fstat(fd).st_size
            if current > size:
                os.ftruncate(fd, size)
            elif current < size:
                if self._preallocate == "fallocate":
                    fallocate(fd, size)
                else:
                    zerofill(fd, size, o_direct=self.o_direct)
            reg = self._io.register_file(fd, size, segment.path.name)
        except BaseException:
            os.close(fd)
            raise
        segment.fd, segment.inode, segment.reg, segment.alive = fd, os.fstat(fd).st_ino, reg, True

    def of(self, slot: int) -> Segment:
        return self.segments[slot // self.per_file]

    def address(self, slot: int) -> tuple[int, int]:
        """``(fd, byte offset)`` of a slot."""
        segment = self.of(slot)
        return segment.fd, (slot - segment.first) * self.slot_bytes

    def usable(self, slot: int) -> bool:
        return self.of(slot).alive

    def generation(self, slot: int) -> int:
        return self.of(slot).generation

    def live_slots(self) -> list[int]:
        return [s for seg in self.segments if seg.alive for s in range(seg.first, seg.first + seg.slots)]

    # -- transfers in flight ------------------------------------------------------

    def hold(self, slots: Sequence[int]) -> tuple[tuple[int, int], ...]:
        """Mark the segments these slots are in as used by a transfer; returns what to pass to :meth:`release`."""
        keys = tuple({(s // self.per_file, self.segments[s // self.per_file].generation) for s in slots})
        self._holds.update(keys)
        return keys

    def release(self, keys: Sequence[tuple[int, int]]) -> None:
        self._holds.subtract(keys)
        self._holds = +self._holds  # drop the keys no transfer holds
        if self._retired:
            self._reap()

    def _reap(self) -> None:
        """Close retired files nobody's transfer uses any more (their fd and NIXL registration)."""
        keep = []
        for index, generation, fd, reg in self._retired:
            if self._holds[(index, generation)] > 0:
                keep.append((index, generation, fd, reg))
                continue
            self._holds.pop((index, generation), None)
            try:
                self._io.deregister(reg)
            except Exception:  # a registration NIXL already dropped with its file
                logger.debug("kvbm: deregistering a retired segment failed", exc_info=True)
            os.close(fd)
        self._retired = keep

    # -- files going away ---------------------------------------------------------

    def check(self, segment: Segment) -> bool:
        """Whether the file behind ``segment`` is still the one opened (alive and same inode)."""
        if not segment.alive:
            return False
        try:
            return os.stat(segment.path).st_ino == segment.inode
        except FileNotFoundError:
            return False

    def retire(self, segment: Segment, *, reason: str) -> bool:
        """Give up the file behind ``segment`` and recreate it empty; False if it cannot be recreated."""
        self._retired.append((segment.index, segment.generation, segment.fd, segment.reg))
        segment.generation += 1
        segment.alive, segment.fd, segment.reg = False, -1, None
        self._reap()
        try:
            self._open(segment)
        except OSError as exc:
            self.lost += 1
            logger.error(
                "kvbm: disk segment %s lost (%s) and cannot be recreated (%s); the disk tier continues without it",
                segment.path, reason, exc.strerror,
            )
            return False
        self.recreated += 1
        logger.warning("kvbm: disk segment %s %s; recreated it empty", segment.path, reason)
        return True

    def open_descriptors(self) -> int:
        """File descriptors this tier holds (live segments and retired ones still in use)."""
        return sum(1 for s in self.segments if s.fd >= 0) + len(self._retired)

    def close(self) -> None:
        for segment in self.segments:
            if segment.fd >= 0:
                self._retired.append((segment.index, segment.generation, segment.fd, segment.reg))
                segment.fd, segment.alive = -1, False
        self._holds.clear()
        self._reap()
