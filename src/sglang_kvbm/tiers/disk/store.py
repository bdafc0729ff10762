"""G3: blocks in preallocated files on local disk, moved through NIXL's POSIX backend.

The facade over the disk tier's parts: the identity directory (``directory``),
segment files (``segments``), the slot index (``slot_index``), the index
journal (``journal``), how the index comes back at start (``restart``: from
the journal, or rebuilt from the blocks when damaged) and NIXL I/O
(``nixl_io``). Bookkeeping (reserve, commit, invalidate, lookups, taking a
finished rebuild in) belongs to the scheduler thread; :meth:`DiskStore.write`
runs on the one disk writer thread and :meth:`DiskStore.read` on the one disk
reader thread, each with staging buffers of its own.

Fail closed: a read is verified (header and checksum, see ``format``) in
host memory before one byte can reach the device. A block that fails is
invalidated and reported; the caller turns it into a miss.
"""

from __future__ import annotations

import logging
import threading
from typing import Optional, Sequence

import torch

from sglang_kvbm.core.identity import BlockId
from sglang_kvbm.core.pages import Page
from sglang_kvbm.tiers.disk import directory as identity_dir
from sglang_kvbm.tiers.disk.block_io import DiskStats, read_blocks, write_blocks
from sglang_kvbm.tiers.disk.journal import IndexJournal
from sglang_kvbm.tiers.disk.nixl_io import DiskIOError, NixlFileIO
from sglang_kvbm.tiers.disk.restart import IndexRestart
from sglang_kvbm.tiers.disk.segments import SegmentFiles
from sglang_kvbm.tiers.disk.setup import DiskProbe
from sglang_kvbm.tiers.disk.slot_index import DiskEntry, DiskSlotIndex, Reservation
from sglang_kvbm.tiers.format import BlockHeader, header_bytes_for
from sglang_kvbm.transfer.host_memory import aligned_empty

logger = logging.getLogger(__name__)

# Transfers of about 8 MiB, so while one chunk moves the next is prepared and the last one checked.
# Reads keep eight in flight, as the disk's limit is measured (benchmarks/tier_io.py): at four, a
# read and its verification reached 0.43-0.88 of that limit on the project's VM, at eight 1.00-1.02.
# Writes keep four (eight measured no better: 0.63-0.73 against 0.55-0.75).
CHUNK_BYTES = 8 << 20
DEPTH = 4
READ_DEPTH = 8


class DiskStore:
    """Fixed-slot block storage in segment files, with an LRU index of registered blocks."""

    def __init__(
        self, *, probe: DiskProbe, num_slots: int, block_bytes: int, fingerprint: bytes, page_size: int,
        pin: bool = False, siblings: tuple[bytes, ...] = (),
    ) -> None:
        """``pin``: page-lock the staging device -> disk copies land in (CUDA: else a synchronous pageable copy);
        ``siblings``: the identities of this server's other disk stores (hybrid models' sidecar pools)."""
        if num_slots <= 0:
            raise ValueError(f"num_slots must be positive, got {num_slots}")
        self.block_bytes = block_bytes
        self.header_bytes = self.header_bytes_for(page_size)
        self.slot_bytes = self.header_bytes + block_bytes
        self.num_slots = num_slots
        self.fingerprint = fingerprint
        self.o_direct = probe.o_direct
        self.stats = DiskStats()
        self.io = NixlFileIO("sglang-kvbm-disk")
        self.directory, self._lock_file, warm = identity_dir.claim(probe.directory, fingerprint, siblings)
        self.segments = SegmentFiles(
            self.directory, num_slots, self.slot_bytes, o_direct=probe.o_direct, preallocate=probe.preallocate, io=self.io
        )
        self._index = DiskSlotIndex(num_slots)
        self._journal = IndexJournal(self.directory, fingerprint, block_bytes, num_slots)
        self._restart = IndexRestart(self._journal, self._index, self.segments, self.io, warm=warm,
                                     directory=self.directory, fingerprint=fingerprint,
                                     header_bytes=self.header_bytes, block_bytes=block_bytes)
        self._holds: dict[int, tuple] = {}  # reservation slot -> segments held by its write
        self._retired: list[Page] = []
        self._owners: dict[str, int] = {}  # "write"/"read" -> the one thread allowed to use its buffers
        self.chunk_blocks = max(1, min(256, CHUNK_BYTES // self.slot_bytes))
        self._write_headers = aligned_empty((DEPTH * self.chunk_blocks, self.header_bytes))
        self.write_staging = aligned_empty((self.chunk_blocks, block_bytes), pin=pin)  # device -> disk goes through it
        for tensor in (self._write_headers, self.write_staging):
            self.io.register_memory(tensor)
        self._restart.start()  # a rebuild's scan, if the index was damaged

    header_bytes_for = staticmethod(header_bytes_for)  # the header row of a page size (see ``format``)

    existing_bytes = staticmethod(identity_dir.existing_bytes)

    def register_dram(self, tensor: torch.Tensor) -> None:
        """Let NIXL move bytes to and from ``tensor`` (the host slab, the read staging)."""
        self.io.register_memory(tensor)

    # -- bookkeeping (scheduler thread) ---------------------------------------------

    def __len__(self) -> int:
        return len(self._index)

    def holds(self, block_id: BlockId) -> bool:
        return self._index.holds(block_id)

    def missing(self, block_ids: Sequence[BlockId]) -> list[int]:
        """Positions of the blocks neither registered nor being written."""
        return self._index.missing(block_ids)

    @property
    def index(self):
        """The compiled block index (``lookups`` asks it and the host's about a prefix in one call)."""
        return self._index.index

    def registered(self, block_id: BlockId) -> bool:
        return self._index.registered(block_id)

    def touch(self, block_ids: Sequence[BlockId]) -> None:
        self._index.touch(block_ids)

    def reserve(self, block_ids: Sequence[BlockId]) -> tuple[list[Reservation], list[Page]]:
        """Slots for these blocks, in order, evicting LRU ones; stops at the first that finds none."""
        slots, evicted = self._index.reserve(block_ids)
        for header in evicted:
            self._journal.removed(header.block_id)
        out = [Reservation(b, s, self.segments.generation(s)) for b, s in zip(block_ids, slots)]
        for r in out:
            self._holds[r.slot] = self.segments.hold([r.slot])
        return out, [h.meta() for h in evicted]

    def commit(self, reserved: Sequence[Reservation], headers: Sequence[Optional[BlockHeader]]) -> list[Page]:
        """The writes completed: register the blocks (those written, whose segment was not retired meanwhile)."""
        kept = [h is not None and self.segments.generation(r.slot) == r.generation for r, h in zip(reserved, headers)]
        good = [(r, h) for r, h, keep in zip(reserved, headers, kept) if keep]
        stale = [r for r, keep in zip(reserved, kept) if not keep]
        if stale:
            self.abort(stale)
        self._index.commit([h for _, h in good], [r.slot for r, _ in good])
        for r, header in good:
            self._journal.added(r.slot, header)
            self.segments.release(self._holds.pop(r.slot, ()))
        return [h.meta() for _, h in good]

    def abort(self, reserved: Sequence[Reservation]) -> None:
        self._index.abort([r.slot for r in reserved])
        for r in reserved:
            self.segments.release(self._holds.pop(r.slot, ()))

    def invalidate(
        self, block_ids: Sequence[BlockId], *, reason: str, where: Optional[Sequence[tuple[int, int]]] = None
    ) -> list[Page]:
        """Remove blocks whose bytes cannot be trusted; returns the metas removed.

        With ``where`` (the slot and its segment's generation a failed read
        used), a block written again since, elsewhere or into a recreated file,
        is kept: only the copy that failed goes.
        """
        if where is not None:
            block_ids = [b for b, w in zip(block_ids, where) if self.located(b) == w]
        removed = self._index.remove(block_ids)
        for header in removed:
            self._journal.removed(header.block_id)
        self.stats.invalidated[reason] += len(removed)
        return [h.meta() for h in removed]

    def located(self, block_id: BlockId) -> Optional[tuple[int, int]]:
        """``(slot, segment generation)`` of a registered block."""
        slot = self._index.slot(block_id)
        return None if slot is None else (slot, self.segments.generation(slot))

    def begin_read(self, block_ids: Sequence[BlockId]) -> Optional[tuple[list[DiskEntry], tuple]]:
        """Pin registered blocks for a read; None if one is not registered (or its file went away)."""
        for segment in {self.segments.of(s) for s in map(self._index.slot, block_ids) if s is not None}:
            if not self.segments.check(segment):
                self._retire(segment, reason="file missing or replaced")
        if self._index.index.run(block_ids) < len(block_ids):
            return None
        slots = self._index.pin(block_ids)
        entries = [DiskEntry(s, self._index.header(s)) for s in slots]
        return entries, self.segments.hold(slots)

    def end_read(self, block_ids: Sequence[BlockId], holds: tuple) -> None:
        self._index.unpin(block_ids)
        self.segments.release(holds)

    def _retire(self, segment, *, reason: str) -> None:
        seg_slots = set(range(segment.first, segment.first + segment.slots))
        lost = self._index.drop_slots(seg_slots)
        for header in lost:
            self._journal.removed(header.block_id)
        self.stats.invalidated[reason] += len(lost)
        self._retired.extend(h.meta() for h in lost)
        if self.segments.retire(segment, reason=reason):
            self._index.add_free(sorted(seg_slots))

    def take_retired(self) -> list[Page]:
        """Blocks lost with retired segments since the last call (for the caller's removal events)."""
        retired, self._retired = self._retired, []
        return retired

    def registered_metas(self) -> list[Page]:
        return [header.meta() for _, header in self._index.entries()]

    def forget(self) -> None:
        self._restart.drop()
        self._index.forget()
        self._journal.cleared()

    def persist(self, force: bool = False) -> None:
        self._restart.settle()
        if not self._restart.pending:  # while a rebuild runs, the damaged files stay as they are
            self._journal.persist(self._index.entries, force=force)

    def accounting(self) -> dict:
        """Where every slot is: registered, free, being written, lost with a segment, or awaiting a rebuild."""
        lost = sum(s.slots for s in self.segments.segments if not s.alive)
        return {"slots": self.num_slots, "registered": len(self._index), "free": self._index.free_count(),
                "writing": self._index.inflight_count(), "lost": lost, "fds": self.segments.open_descriptors(),
                "rebuilding": self.num_slots - lost if self._restart.pending else 0}

    # -- a rebuild from the blocks (see ``rebuild``; scheduler thread) -------------------------

    @property
    def rebuilding(self) -> bool:
        """Whether a rebuild's blocks are not taken in yet (the tier misses and takes no writes meanwhile)."""
        return self._restart.pending

    def wait_rebuilt(self, timeout: Optional[float] = None) -> bool:
        """Wait for a rebuild's scan and take its blocks in; whether the tier is rebuilt (tests, benchmarks)."""
        return self._restart.wait(timeout)

    def take_restored(self) -> list[Page]:
        """Blocks a rebuild kept, once, for the caller's ``DISK`` BlockStored events (announce parents first)."""
        return self._restart.take_restored()

    # -- I/O (worker threads) ----------------------------------------------------------

    def _owned(self, role: str) -> None:
        me = threading.get_ident()
        owner = self._owners.setdefault(role, me)
        if owner != me:
            raise RuntimeError(f"DiskStore.{role} runs on one thread only (its staging buffers are not shared)")

    def write(self, reserved: Sequence[Reservation], metas: Sequence[Page],
              rows: Sequence[torch.Tensor]) -> list[Optional[BlockHeader]]:
        """Write blocks from host rows (the writer thread); their headers, None for one left out (its header
        does not fit). Raises :class:`DiskIOError`."""
        self._owned("write")
        return write_blocks(self, reserved, metas, rows, self._write_headers, self.chunk_blocks, DEPTH)

    def read(self, entries: Sequence[DiskEntry], data_rows: Sequence[torch.Tensor],
             header_rows: Sequence[torch.Tensor]) -> list[tuple[int, str]]:
        """Read and verify blocks into host rows (the reader thread); ``(index, reason)`` of those that failed."""
        self._owned("read")
        return read_blocks(self, entries, data_rows, header_rows, self.chunk_blocks, READ_DEPTH)

    def close(self) -> None:
        complete = self._restart.stop()  # a scan stopped before its end leaves the files to the next start's
        self._journal.close(self._index.entries() if complete else None)
        self.segments.close()
        self._lock_file.close()

    # -- another identity while serving (scheduler thread) --------------------------------

    def rekey(self, fingerprint: bytes) -> None:
        """Go on under ``fingerprint``: the directory is renamed to its name, the journal restarts under it,
        and every later write's header carries it (a read is verified against it).

        For weights replaced in memory: a server started on the files the old
        identity names must never find what is written from now on. Drop the
        tier's blocks first (``KvbmLinker.drop_tiers``, which also quiesces the
        copies): a block still registered here keeps its old header and fails
        verification when read (a miss). The segment files, their NIXL
        registrations and the lock move with the directory; no byte is copied.
        """
        self._restart.drop()  # a rebuild's blocks are of the old identity
        self.directory = identity_dir.move(self.directory, fingerprint)
        self.segments.directory = self.directory
        for segment in self.segments.segments:  # a retired file is recreated at its path: the new one
            segment.path = self.directory / segment.path.name
        self.fingerprint = fingerprint
        self._journal.rekey(self.directory, fingerprint, self._index.entries())


__all__ = ["DiskEntry", "DiskIOError", "DiskStats", "DiskStore", "Reservation"]
