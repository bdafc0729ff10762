"""The disk tier (G3) as a :class:`~sglang_kvbm.tiers.lower.LowerTier`: an indexed tier that announces its blocks.

Its bytes live in a :class:`~sglang_kvbm.tiers.disk.store.DiskStore` (segment
files, an LRU slot index, a journal). Besides the protocol's host -> disk
writes it takes device pages directly when no host row is free
(``offloads``: the tree waits for those, so they run on the writer thread
ahead of background writes, see ``lanes``).

* **Writes from host**: a host block KVBM's frequency filter says was reused
  (or every one, with the filter off) is written from its host row, pinned
  meanwhile, and registered (and announced) when the write ends.
* **Reads**: registered blocks are pinned in the index for the read, read into
  staging rows on the reader thread and verified there; a block that fails is
  dropped from the index (only the copy that failed: see ``invalidate``) with
  its ``DISK`` removal and a warning, and the request recomputes it.
* **What changes without a write**: segments found missing or replaced, a
  rebuild's blocks taken in (``rebuild``: announced parents first), the index
  persisted, all in :meth:`DiskTier.collect`.
"""

from __future__ import annotations

import logging
from collections import deque
from concurrent.futures import Future
from typing import Callable, NamedTuple, Optional, Sequence

from sglang_kvbm.core.identity import BlockId, rekeyed
from sglang_kvbm.core.offload_filter import FrequencyFilter
from sglang_kvbm.core.onboard_policy import LinearCostMeter
from sglang_kvbm.core.pages import Page
from sglang_kvbm.core.ports import TierCounts, TierEvent, TierEventKind
from sglang_kvbm.core.tiers import DISK, HOST
from sglang_kvbm.tiers.disk.store import DiskStore
from sglang_kvbm.tiers.lower import Read
from sglang_kvbm.transfer import copies
from sglang_kvbm.transfer.lanes import LaneExecutor

logger = logging.getLogger(__name__)
NAME = DISK.name


class _Write(NamedTuple):
    future: Future
    ids: tuple
    reserved: tuple
    rows: tuple  # the pinned host rows it reads
    generation: int


class _ReadState(NamedTuple):
    holds: tuple
    metas: tuple
    where: tuple  # (slot, segment generation) each block was read from


class DiskTier:
    name = NAME
    medium = DISK.medium
    indexed = True

    def __init__(self, store: DiskStore, host, *, offload_filter: Optional[FrequencyFilter] = None,
                 meter: Optional[LinearCostMeter] = None, generation: Callable[[], int] = lambda: 0,
                 observe: Callable[[str, int, float], None] = lambda path, nbytes, seconds: None,
                 writer: Optional[LaneExecutor] = None, reader: Optional[LaneExecutor] = None,
                 worker_init=None) -> None:
        """``host``: the host tier's pool (None: device pages come straight here); ``meter``: the onboard
        policy's read meter (seeded by the disk probe); ``writer``/``reader`` (tests) replace its threads."""
        self.store = store
        self.header_bytes = store.header_bytes
        self.meter = meter if meter is not None else LinearCostMeter()
        self._host = host
        self._filter = offload_filter
        self._generation = generation
        self._observe = observe
        self.writer = writer or LaneExecutor("kvbm-disk-write", worker_init)
        self._reader = reader or LaneExecutor("kvbm-disk-read")
        self._writes: deque[_Write] = deque()
        self._emit: Callable[[TierEvent], None] = lambda event: None
        self._own = {"host_writes_submitted": 0, "host_write_failures": 0, "failed_reads": 0}
        self._closed = False
        self.private = False  # re-keyed to an identity no model files give (weights replaced in memory)
        if host is not None:
            store.register_dram(host.slab)

    def bind(self, emit: Callable[[TierEvent], None]) -> None:
        """Where its changes go, in order with every other tier's; what a warm start found is announced now."""
        self._emit = emit
        if len(self.store):
            self._announce_restored(self.store.registered_metas())

    @property
    def stats(self) -> dict:
        """Its store's I/O counts, blocks invalidated by reason, where every slot is, and its own counts."""
        out = dict(self.store.stats.__dict__)
        out["invalidated"] = dict(self.store.stats.invalidated)
        out.update(self.store.accounting())
        out.update(self._own)
        return out

    def register_dram(self, tensor) -> None:
        self.store.register_dram(tensor)

    def holds(self, block_id: BlockId) -> bool:
        return self.store.registered(block_id)

    @property
    def index(self):
        """What it registers, compiled: ``lookups`` asks it with host's about a whole prefix in one call."""
        return self.store.index

    def touch(self, block_ids: Sequence[BlockId]) -> None:
        self.store.touch(block_ids)

    def counts(self) -> TierCounts:
        return TierCounts(NAME, len(self.store), self.store.num_slots)

    def registered_metas(self) -> list[Page]:
        return self.store.registered_metas()

    # -- reads -------------------------------------------------------------------------------

    def start_read(self, block_ids: Sequence[BlockId], slab, headers, rows: Sequence[int], *,
                   urgent: bool = False) -> Optional[Read]:
        started = self.store.begin_read(block_ids)
        if started is None:  # not registered any more (or its file went away)
            return None
        entries, holds = started
        submit = self._reader.submit_urgent if urgent else self._reader.submit
        future = submit(copies.disk_to_staging, self.store, entries, slab, headers, rows)
        return Read(future, _ReadState(holds, tuple(e.header.meta() for e in entries),
                                       tuple(map(self.store.located, block_ids))))

    def finish_read(self, read: Read, block_ids: Sequence[BlockId], current: bool) -> list[Optional[Page]]:
        state: _ReadState = read.state
        # Pins of a forgotten generation went with the index: a newer read of the same block may hold one now.
        self.store.end_read(block_ids if current else (), state.holds)
        try:
            failed, seconds = read.future.result()
        except Exception:  # the request recomputes; nothing is staged
            logger.exception("kvbm: disk read of %d blocks failed", len(block_ids))
            failed, seconds = [(i, "I/O error") for i in range(len(block_ids))], 0.0
        if not current:
            return [None] * len(block_ids)
        by_reason: dict[str, list[int]] = {}
        for i, reason in failed:
            by_reason.setdefault(reason, []).append(i)
        for reason, indices in by_reason.items():
            ids = [block_ids[i] for i in indices]
            self._removed(self.store.invalidate(ids, reason=reason, where=[state.where[i] for i in indices]))
            logger.warning("kvbm: %d disk block(s) failed verification (%s) and were dropped; the request "
                           "recomputes", len(ids), reason)
        metas: list[Optional[Page]] = list(state.metas)
        for i, _ in failed:
            metas[i] = None
        good = len(block_ids) - len({i for i, _ in failed})
        if failed:
            self._own["failed_reads"] += 1
        if good:
            nbytes = good * self.store.slot_bytes
            self._observe("onboard_d2d", nbytes, seconds)
            if not failed:
                self.meter.record(nbytes, seconds)
        return metas

    def promote(self, futures: Sequence[Future]) -> None:
        self._reader.promote(futures)

    def stalled(self) -> bool:
        return False

    def ask(self, block_ids: Sequence[BlockId]) -> list[bool]:
        return [False] * len(block_ids)  # indexed: the scheduler thread answers (``peek``)

    # -- writes from host -------------------------------------------------------------------

    def offer(self, metas: Sequence[Page]) -> None:
        """Host blocks that earned a disk copy (KVBM's frequency filter): pin their rows, write them."""
        if self._closed or self._host is None or not metas:
            return
        if self._filter is not None:
            metas = [m for m in metas if self._filter.offer(m.block_id)]
        todo = [m for m in metas if self._host.registered(m.block_id) and not self.store.holds(m.block_id)]
        if not todo:
            return
        reserved, evicted = self.store.reserve([m.block_id for m in todo])
        self._removed(evicted)
        if not reserved:
            return
        todo = todo[: len(reserved)]
        ids = tuple(m.block_id for m in todo)
        rows = self._host.pin(ids)
        future = self.writer.submit(copies.host_to_disk, self.store, reserved, todo, self._host.slab, rows)
        self._writes.append(_Write(future, ids, tuple(reserved), tuple(rows), self._generation()))
        self._own["host_writes_submitted"] += 1

    def _finish_write(self, write: _Write) -> None:
        current = write.generation == self._generation()
        if current:
            self._host.unpin(write.ids)
        self._host.release_orphans(write.rows)  # rows of a forgotten generation: free now
        error = None if not write.future.done() or write.future.cancelled() else write.future.exception()
        if not current or write.future.cancelled() or error is not None:
            if error is not None:
                logger.error("kvbm: host->disk write of %d blocks failed: %r", len(write.ids), error)
                self._own["host_write_failures"] += 1
            self.store.abort(write.reserved)
            return
        headers, seconds = write.future.result()
        registered = self.store.commit(write.reserved, headers)
        self._observe("h2d", len(registered) * self.store.slot_bytes, seconds)
        self._emit(TierEvent(TierEventKind.STORED, NAME, tuple(registered), HOST.name, DISK.medium))

    def in_flight(self) -> list[Future]:
        return [w.future for w in self._writes]

    # -- what changed ------------------------------------------------------------------------

    def collect(self) -> None:
        while self._writes and self._writes[0].future.done():
            self._finish_write(self._writes.popleft())
        self._removed(self.store.take_retired())
        self.store.persist()
        self._announce_restored(self.store.take_restored())  # blocks a rebuilt index kept (disk/rebuild.py)

    def _removed(self, metas: Sequence[Page]) -> None:
        if metas:
            self._emit(TierEvent(TierEventKind.REMOVED, NAME, tuple(metas), None, DISK.medium))

    def _announce_restored(self, metas: list[Page]) -> None:
        """Disk blocks found at start-up, announced parents first (an orphan would be dropped by the router)."""
        by_parent: dict[Optional[int], list[Page]] = {}
        for meta in metas:
            if meta.event_hash is not None:
                by_parent.setdefault(meta.event_parent, []).append(meta)
        announced, frontier = [], list(by_parent.pop(None, []))
        while frontier:
            meta = frontier.pop()
            announced.append(meta)
            frontier.extend(by_parent.pop(meta.event_hash, []))
        if announced:
            self._emit(TierEvent(TierEventKind.STORED, NAME, tuple(announced), None, DISK.medium))

    # -- identity and life ------------------------------------------------------------------

    def rekey(self, how: str) -> None:
        """Move the files to an identity of this run only, once: later updates find them there already."""
        if not self.private:
            old = self.store.fingerprint
            self.store.rekey(rekeyed(old, how))
            self.private = True
            logger.info("kvbm: the disk tier moved from identity %s to %s (%s)", old.hex(),
                        self.store.fingerprint.hex(), self.store.directory)

    def forget(self) -> None:
        self.store.forget()

    def drop(self) -> None:
        """Announce the removal of every block, then forget them."""
        self._removed(self.store.registered_metas())
        self.store.forget()

    def stop(self) -> None:
        self._closed = True
        for lane in (self.writer, self._reader):
            lane.shutdown(wait=True, cancel_futures=True)

    def close(self) -> None:
        self.stop()
        while self._writes:
            self._finish_write(self._writes.popleft())
        self.store.close()
