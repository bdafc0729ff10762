"""How a disk tier's slot index comes back at start: from its snapshot and journal, or rebuilt from its blocks.

A warm start replays the snapshot and the journal (``journal``) and takes
their blocks in at once. If they are damaged, a scan of the blocks' own
headers (``rebuild``) runs on a thread of its own and the index stays empty
(no lookups hit, no slot is handed out) until the scheduler thread takes the
scan's blocks in (:meth:`IndexRestart.settle`, called from every poll). Either
way the blocks are registered, a fresh snapshot is written and the journal
restarted (after a rebuild, by the scan's thread: the journal is untouched by
anyone else while the scan runs, and the scheduler thread only registers the
blocks in memory). Scheduler thread only, except the scan.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Sequence

from sglang_kvbm.core.pages import Page
from sglang_kvbm.tiers.disk.journal import IndexJournal
from sglang_kvbm.tiers.disk.rebuild import IndexRebuild
from sglang_kvbm.tiers.disk.slot_index import DiskSlotIndex
from sglang_kvbm.tiers.format import BlockHeader

if TYPE_CHECKING:
    from sglang_kvbm.tiers.disk.nixl_io import NixlFileIO
    from sglang_kvbm.tiers.disk.segments import SegmentFiles

logger = logging.getLogger(__name__)


class IndexRestart:
    def __init__(
        self, journal: IndexJournal, index: DiskSlotIndex, segments: "SegmentFiles", io: "NixlFileIO", *,
        warm: bool, directory: Path, fingerprint: bytes, header_bytes: int, block_bytes: int,
    ) -> None:
        """Load what the last run left (``warm``) and take it in, or prepare a rebuild (:meth:`start` starts it)."""
        self._journal, self._index, self._segments = journal, index, segments
        self._rebuild: Optional[IndexRebuild] = None  # a scan whose blocks are not taken in yet
        self._restored: list[Page] = []  # blocks a rebuild kept, not announced yet
        loaded = journal.load() if warm else None
        journal.open()
        if loaded is not None and loaded.damage is not None:
            logger.warning("kvbm: the disk index of %s is damaged (%s); rebuilding it from the blocks' headers on a "
                           "thread of its own: until then the disk tier misses and takes no writes",
                           directory, loaded.damage)
            self._rebuild = IndexRebuild(segments, io, fingerprint=fingerprint, header_bytes=header_bytes,
                                         block_bytes=block_bytes, hints=loaded.entries, where=str(directory),
                                         persist=journal.snapshot)  # the journal is the scan's until it ends
            return
        self._take_in(loaded.entries if loaded is not None else [])
        if len(index):
            logger.info("kvbm: disk tier restored %d blocks from %s (each is verified when read)", len(index), directory)

    def start(self) -> None:
        if self._rebuild is not None:
            self._rebuild.start()

    @property
    def pending(self) -> bool:
        """Whether a rebuild's blocks are not taken in yet (the tier misses and takes no writes meanwhile)."""
        return self._rebuild is not None

    def settle(self) -> None:
        """Take a finished scan's blocks in, if there is one."""
        rebuild = self._rebuild
        if rebuild is None or not rebuild.done() or rebuild.result() is None:
            return
        self._rebuild = None
        self._take_in(rebuild.result(), written=True)  # the scan's thread wrote the snapshot: no I/O here
        self._restored = [h.meta() for _, h in self._index.entries()]

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Wait for a rebuild's scan and take its blocks in; whether the index is complete."""
        if self._rebuild is not None:
            self._rebuild.wait(timeout)
            self.settle()
        return self._rebuild is None

    def take_restored(self) -> list[Page]:
        self.settle()
        restored, self._restored = self._restored, []
        return restored

    def drop(self) -> None:
        """The engine drops its cache (or the tier moves to another identity): stop a scan, go on empty."""
        if self._rebuild is not None:
            self._rebuild.stop()
            self._rebuild = None
            self._take_in([])

    def stop(self) -> bool:
        """At close: stop a scan (one that finished is taken in); whether the index may be written (complete)."""
        if self._rebuild is not None:
            self._rebuild.stop()
            self.settle()
        return self._rebuild is None

    def _take_in(self, entries: Sequence[tuple[int, BlockHeader]], *, written: bool = False) -> None:
        """Register ``entries``; unless ``written`` already, snapshot them (the journal starts empty)."""
        self._index.restore([(slot, header) for slot, header in entries if self._segments.usable(slot)])
        taken = {slot for slot, _ in entries}
        self._index.set_free([s for s in self._segments.live_slots() if s not in taken])
        if not written:
            self._journal.snapshot(self._index.entries())
