"""Rebuilding a damaged disk index from the blocks themselves.

Every slot opens with a self-verifying header (``format``: magic, the header's
own xxh3, the writer's identity fingerprint, the block id, the xxh3 of the
block's bytes). So when the index is damaged (``journal``: an unreadable
snapshot, or a bad journal record with good ones after it; a torn *last*
record is what a crash leaves and is simply replayed up to), nothing needs to
be thrown away: :class:`IndexRebuild` reads every live slot once, in order,
and keeps each block whose header verifies, whose fingerprint is this store's,
and whose bytes match the header's checksum. Empty slots, torn or crafted
headers (decoded typed, as a read decodes them), other identities' blocks and
bad bytes are left free.

Off the scheduler's path: the scan runs on a thread of its own, through the
tier's NIXL agent (a few large reads in flight, each chunk verified while the
next ones land), logs its progress (``progress``), and is one sequential pass
over the tier: its time is the tier's size over the disk's read bandwidth
(``benchmarks/disk_rebuild.py``). Once it has ended, the same thread writes
the blocks kept as a fresh snapshot and empties the journal (the next restart
is a normal one); the scheduler thread only registers them in memory
(``restart``) and they are announced as a clean restart announces its own
(``DISK`` BlockStored, parents first: ``DiskStore.take_restored``).

**Slots while the scan runs.** None are handed out: the tier's index stays
empty with no free slot until the scan is taken in, so lookups miss, no read
can start, and every write is refused (offloads skip the disk; a device page
with no host room is not stored). That is the simplest rule that is correct:
the scan never races a write into a slot it has yet to read, and nothing needs
to know which slots it has passed. A flush (``forget``) or a new identity
(``rekey``) stops the scan and the tier goes on empty; a close stops it and
leaves the damaged files as they are, so the next start scans again.

**A verifying block in a slot the index had freed** (evicted, or dropped by a
flush, but not overwritten) **is kept.** Its bytes are proven intact and of
this identity, and a block id names its whole token prefix, so serving it is
exactly as correct as serving a block the index never freed: freeing is a
room decision, never a correctness one (a block freed because its bytes were
bad fails the scan the same way, and weights replaced in memory move the tier
to another fingerprint, which the scan rejects). Nor could the journal's order
decide it consistently: the record that freed a block may be the damaged one,
or older than the last snapshot, which is gone. The readable records are used
only as hints: when a block is found in several slots, the one the latest
readable record names is kept (else the lowest); the use order of the rebuilt
index is theirs, blocks they do not name first (least recently used).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import xxhash

from sglang_kvbm.base.progress import Progress
from sglang_kvbm.tiers.disk.nixl_io import DiskIOError
from sglang_kvbm.tiers.format import MAGIC, BlockHeader, parse_header
from sglang_kvbm.transfer.host_memory import aligned_empty

if TYPE_CHECKING:
    from sglang_kvbm.tiers.disk.nixl_io import NixlFileIO
    from sglang_kvbm.tiers.disk.segments import SegmentFiles

logger = logging.getLogger(__name__)

SCAN_BYTES = 16 << 20  # one read: whole slots, about this many bytes
SCAN_DEPTH = 4  # reads in flight

# Tests hold a scan before it reads anything (a threading.Event they set); production never sets it.
gate: Optional[threading.Event] = None


class _Stopped(Exception):
    pass


class IndexRebuild:
    """One scan of a store's live segments on its own thread; :meth:`result` once it is :meth:`done`."""

    def __init__(
        self, segments: "SegmentFiles", io: "NixlFileIO", *, fingerprint: bytes, header_bytes: int, block_bytes: int,
        hints: Sequence[tuple[int, BlockHeader]], where: str, persist: Callable[[list], None],
    ) -> None:
        """``hints``: ``(slot, header)`` the index's readable parts still name, least recently used first;
        ``persist``: writes the kept blocks as a fresh snapshot (on the scan's thread, once it has ended)."""
        self._io = io
        self._persist = persist
        self._fingerprint = fingerprint
        self._header_bytes, self._slot_bytes = header_bytes, header_bytes + block_bytes
        self._hints = {header.block_id: (rank, slot) for rank, (slot, header) in enumerate(hints)}
        self._where = where
        self._per = max(1, SCAN_BYTES // self._slot_bytes)
        self._chunks = [  # (fd, first slot, slots, byte offset): taken now, on the thread that owns the segments
            (seg.fd, first, min(self._per, seg.first + seg.slots - first), (first - seg.first) * self._slot_bytes)
            for seg in segments.segments if seg.alive for first in range(seg.first, seg.first + seg.slots, self._per)
        ]
        self.counts: collections.Counter = collections.Counter()
        self.seconds = 0.0
        self._found: dict[str, list[tuple[int, BlockHeader]]] = {}
        self._kept: Optional[list[tuple[int, BlockHeader]]] = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvbm-disk-rebuild", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def done(self) -> bool:
        return self._thread.ident is not None and not self._thread.is_alive()

    def wait(self, timeout: Optional[float] = None) -> bool:
        self._thread.join(timeout)
        return self.done()

    def stop(self) -> None:
        """End the scan early (at most the reads in flight finish) and wait for its thread."""
        self._stop.set()
        if self._thread.ident is not None:
            self._thread.join()

    def result(self) -> Optional[list[tuple[int, BlockHeader]]]:
        """``(slot, header)`` of every block kept, least recently used first; None if stopped before its end."""
        return self._kept

    # -- the scan's thread -------------------------------------------------------------

    def _run(self) -> None:
        started = time.monotonic()
        try:
            while gate is not None and not gate.wait(0.05):
                if self._stop.is_set():
                    raise _Stopped
            self._scan()
            kept = self._choose()
        except _Stopped:
            logger.info("kvbm: the disk index rebuild of %s stopped before its end", self._where)
            return
        except Exception:  # the tier must go on: empty, rather than not at all
            logger.exception("kvbm: rebuilding the disk index of %s failed; the disk tier starts empty", self._where)
            kept = []
        self._persist(kept)  # a fresh snapshot, the journal emptied: the next restart is a normal one
        self._kept = kept
        self.seconds = time.monotonic() - started
        c = self.counts
        logger.warning(
            "kvbm: rebuilt the disk index of %s from its blocks in %.1f s: kept %d blocks; %d slots empty, "
            "%d with a bad header, %d of another identity, %d with bad bytes, %d duplicates, %d unreadable",
            self._where, self.seconds, len(kept), c["empty"], c["bad header"], c["other identity"],
            c["bad data"], c["duplicate"], c["unreadable"],
        )

    def _scan(self) -> None:
        chunks, slot_bytes = self._chunks, self._slot_bytes
        depth = max(1, min(SCAN_DEPTH, len(chunks)))
        buffer = aligned_empty((depth, self._per * slot_bytes))
        rows = buffer.numpy()
        registration = self._io.register_memory(buffer)
        progress = Progress(sum(c[2] for c in chunks) * slot_bytes, f"rebuilding the disk index of {self._where}")

        def prepare(k: int):
            if self._stop.is_set():
                raise _Stopped
            fd, _, count, offset = chunks[k]
            return [(buffer[k % depth].data_ptr(), count * slot_bytes, 0)], [(offset, count * slot_bytes, fd)]

        def done(k: int, error: Optional[DiskIOError]) -> None:
            fd, first, count, offset = chunks[k]
            unread = set() if error is None else self._retry(buffer[k % depth].data_ptr(), fd, offset, count)
            self._verify(memoryview(rows[k % depth]), first, count, unread)
            progress.update(count * slot_bytes)

        try:
            self._io.pipeline("READ", len(chunks), prepare, done, depth=depth)
        finally:
            progress.close()
            self._io.deregister(registration)

    def _retry(self, address: int, fd: int, offset: int, count: int) -> set[int]:
        """A chunk that failed as a whole, read again slot by slot; the slots that still fail."""
        failed = set()
        for j in range(count):
            try:
                self._io.transfer("READ", [(address + j * self._slot_bytes, self._slot_bytes, 0)],
                                  [(offset + j * self._slot_bytes, self._slot_bytes, fd)])
            except DiskIOError:
                failed.add(j)
        self.counts["unreadable"] += len(failed)
        return failed

    def _verify(self, rows: memoryview, first: int, count: int, unread: set[int]) -> None:
        header_bytes, slot_bytes, counts = self._header_bytes, self._slot_bytes, self.counts
        empty = bytes(len(MAGIC))
        for j in range(count):
            if j in unread:
                continue
            base = j * slot_bytes
            if rows[base : base + len(MAGIC)] == empty:
                counts["empty"] += 1
                continue
            header = parse_header(rows[base : base + header_bytes])
            if header is None:
                counts["bad header"] += 1
            elif header.fingerprint != self._fingerprint:
                counts["other identity"] += 1
            elif xxhash.xxh3_64_intdigest(rows[base + header_bytes : base + slot_bytes]) != header.checksum:
                counts["bad data"] += 1
            else:
                self._found.setdefault(header.block_id, []).append((first + j, header))

    def _choose(self) -> list[tuple[int, BlockHeader]]:
        """One copy of each block (the hinted slot's, else the lowest), in the hints' use order."""
        kept = []
        for block_id, copies in self._found.items():
            hinted = self._hints.get(block_id)
            kept.append(next((c for c in copies if hinted is not None and c[0] == hinted[1]), copies[0]))
            self.counts["duplicate"] += len(copies) - 1
        never = (-1, -1)
        kept.sort(key=lambda c: (self._hints.get(c[1].block_id, never)[0], c[0]))
        return kept
