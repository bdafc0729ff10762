"""Where disk and G4 reads land: host staging rows, verified, before a load copies them to the device.

A lookup that finds blocks on disk starts reading them here at once
(:meth:`ReadStaging.prefetch`), so a request that waits in the queue has its
disk blocks in host memory by the time it is scheduled; a load that comes
sooner waits only for its own reads: they move ahead of other requests'
prefetches (:meth:`ReadStaging.wait`, ``lanes``), which are queued as jobs of
at most :data:`JOB_BYTES` so that a read someone waits for is never behind more
than one of them. Staged blocks are kept
in LRU order and reused by later loads until their rows are needed. Staging is
not a tier: nothing here is announced, and a block leaves staging without an
event. A block that fails verification is dropped from the disk tier (with its
``DISK`` removal) and never staged. A read of a forgotten generation (the tiers
were reset meanwhile) stages nothing and unpins nothing by block id.

G4 fetches (``mooncake.writes``) land here too, on the G4 thread: a lookup fetches the
leading blocks of its tail that G4 holds (:meth:`ReadStaging.fetch_g4`); a G4
object that fails verification is a miss, and it is not staged.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from concurrent.futures import Future, wait
from typing import Callable, Optional, Sequence

from sglang_kvbm.core.identity import BlockId
from sglang_kvbm.core.onboard_policy import LinearCostMeter
from sglang_kvbm.core.ports import BlockMeta
from sglang_kvbm.core.tiers import Tier
from sglang_kvbm.tiers.host.pool import HostBlockPool
from sglang_kvbm.tiers.mooncake.writes import g4_to_staging
from sglang_kvbm.transfer.copies import disk_to_staging
from sglang_kvbm.transfer.host_memory import aligned_empty
from sglang_kvbm.transfer.kv_layout import PagedKvLayout
from sglang_kvbm.transfer.lanes import LaneExecutor

logger = logging.getLogger(__name__)
JOB_BYTES = 32 << 20  # one read job: four of the disk tier's ~8 MiB transfers in flight


@dataclasses.dataclass(frozen=True)
class _ReadJob:
    ids: tuple[BlockId, ...]
    rows: tuple[int, ...]
    metas: tuple[BlockMeta, ...]
    holds: tuple
    generation: int
    future: Future
    where: tuple[tuple[int, int], ...] = ()  # (slot, segment generation) each block was read from
    started: float = 0.0  # time.monotonic() at submission (G4: a job that hangs marks G4 as stalled)
    g4: bool = False


class ReadStaging:
    def __init__(
        self,
        layout: PagedKvLayout,
        disk,
        capacity: int,
        executor: LaneExecutor,
        removed: Callable[[Tier, Sequence[BlockMeta]], None],
        observe: Callable[[str, int, float], None],
        on_read: Callable[[int, float], None] = lambda nbytes, seconds: None,
        g4=None,
        g4_executor: Optional[LaneExecutor] = None,
        g4_found: Callable[[Sequence[BlockId]], None] = lambda block_ids: None,
    ) -> None:
        """``disk`` may be None when ``g4`` (a ``G4Store``, read by ``g4_executor``) is the only source;
        ``g4_found`` hears of the blocks a fetch found in G4 (the write-through need not put them again)."""
        self._disk = disk
        self._executor = executor
        self._removed = removed
        self._observe = observe
        self._on_read = on_read
        self._g4, self._g4_executor, self._g4_found = g4, g4_executor, g4_found
        self.pool = HostBlockPool(layout.host_slab(capacity, pin=layout.is_cuda))
        header_bytes = (disk if disk is not None else g4).header_bytes  # the header row of this page size
        self.slot_bytes = header_bytes + layout.block_bytes  # what one block's read moves (the disk slot's size)
        self._headers = aligned_empty((capacity, header_bytes))
        for source in (disk, g4):
            if source is not None:
                source.register_dram(self.pool.slab)
                source.register_dram(self._headers)
        self.g4_staged = 0
        self.g4_meter = LinearCostMeter()  # seconds per byte of a G4 fetch, for how long a lookup waits for one
        self._jobs: dict[BlockId, _ReadJob] = {}  # block being read -> its job
        self._pending: list[_ReadJob] = []
        self.generation = 0
        self.failures = 0

    @property
    def capacity(self) -> int:
        return self.pool.capacity

    def staged(self, block_id: BlockId) -> bool:
        return self.pool.registered(block_id)

    def reading(self, block_id: BlockId) -> bool:
        return block_id in self._jobs

    def _reserve(self, block_ids: Sequence[BlockId], keep: Sequence[BlockId]) -> tuple[list, list]:
        """Rows for the blocks not staged or being read yet, evicting least recently used staged blocks, never
        one of ``block_ids`` or ``keep`` (the rest of the same load: it needs them too)."""
        todo = [b for b in block_ids if not self.pool.holds(b) and b not in self._jobs]
        if not todo:
            return [], []
        needed = [b for b in dict.fromkeys([*block_ids, *keep]) if self.pool.registered(b)]
        self.pool.pin(needed)
        try:
            rows, _ = self.pool.reserve(todo)  # no events: staging is not a tier
        finally:
            self.pool.unpin(needed)
        return todo[: len(rows)], rows

    def fetch_g4(self, block_ids: Sequence[BlockId], *, keep: Sequence[BlockId] = ()) -> list[Future]:
        """Start fetching ``block_ids`` (a lookup's tail) from G4: the futures to wait for (none if G4 is down)."""
        if self._g4 is None or self._g4.down or self.g4_stalled():
            return []
        todo, rows = self._reserve(block_ids, keep)
        futures = []
        step = self.job_blocks
        for start in range(0, len(todo), step):
            ids, job_rows = tuple(todo[start : start + step]), tuple(rows[start : start + step])
            future = self._g4_executor.submit_urgent(g4_to_staging, self._g4, ids, self.pool.slab, self._headers, job_rows)
            job = _ReadJob(ids, job_rows, (), (), self.generation, future, started=time.monotonic(), g4=True)
            self._pending.append(job)
            self._jobs.update(dict.fromkeys(ids, job))
            futures.append(future)
        return futures

    @property
    def has_g4(self) -> bool:
        return self._g4 is not None

    def g4_stalled(self, after: float = 1.0) -> bool:
        """A G4 job has run longer than ``after`` seconds (a master lost mid-call takes ~4.5 s to fail)."""
        now = time.monotonic()
        return any(job.g4 and not job.future.done() and now - job.started > after for job in self._pending)

    def prefetch(self, block_ids: Sequence[BlockId], *, keep: Sequence[BlockId] = ()) -> None:
        """Start reading the blocks not staged or being read yet (the disk must hold them)."""
        todo, rows = self._reserve(block_ids, keep)
        if not todo:
            return
        step = self.job_blocks
        for start in range(0, len(todo), step):
            ids, job_rows = tuple(todo[start : start + step]), tuple(rows[start : start + step])
            started = self._disk.begin_read(ids)
            if started is None:  # not registered any more (or its file went away): the rest is not read
                self.pool.abort(todo[start:], rows[start:])
                return
            entries, holds = started
            future = self._executor.submit(disk_to_staging, self._disk, entries, self.pool.slab, self._headers, job_rows)
            job = _ReadJob(ids, job_rows, tuple(e.header.meta() for e in entries), holds, self.generation, future,
                           tuple(map(self._disk.located, ids)))
            self._pending.append(job)
            self._jobs.update(dict.fromkeys(ids, job))

    @property
    def job_blocks(self) -> int:
        return max(1, JOB_BYTES // self.slot_bytes)

    def pending_bytes(self, block_ids: Sequence[BlockId]) -> int:
        """Bytes still to read for these blocks (whole jobs: a job is read as one)."""
        jobs = {id(job): job for job in map(self._jobs.get, block_ids) if job is not None}
        return sum(len(job.ids) for job in jobs.values()) * self.slot_bytes

    def wait(self, block_ids: Sequence[BlockId], timeout: Optional[float]) -> bool:
        """Wait for the reads of these blocks, moved ahead of other prefetches; False on timeout.

        On a timeout the reads stay in flight (and staged when they end, for a later request).
        """
        futures = {self._jobs[b].future for b in block_ids if b in self._jobs}
        if not futures:
            return True
        self._executor.promote(futures)
        _, not_done = wait(futures, timeout=timeout)
        self.collect()
        return not not_done

    def collect(self) -> None:
        """Finish the reads that are done: stage verified blocks, drop the ones that failed."""
        if not self._pending:
            return
        still = []
        for job in self._pending:
            if not job.future.done():
                still.append(job)
                continue
            for block_id in job.ids:
                self._jobs.pop(block_id, None)
            self._finish(job)
        self._pending = still

    def _finish(self, job: _ReadJob) -> None:
        if job.g4:
            self._finish_g4(job)
            return
        current = job.generation == self.generation
        # Pins of a forgotten generation went with the index: a newer read of the same block may hold one now.
        self._disk.end_read(job.ids if current else (), job.holds)
        try:
            failed, seconds = job.future.result()
        except Exception:  # the request recomputes; nothing is staged
            logger.exception("kvbm: disk read of %d blocks failed", len(job.ids))
            failed, seconds = [(i, "I/O error") for i in range(len(job.ids))], 0.0
        if not current:
            self.pool.abort(job.ids, job.rows)  # reset while reading: the blocks belong to a dropped cache
            return
        bad = {i for i, _ in failed}
        by_reason: dict[str, list[int]] = {}
        for i, reason in failed:
            by_reason.setdefault(reason, []).append(i)
        for reason, indices in by_reason.items():
            ids = [job.ids[i] for i in indices]
            self._removed(Tier.DISK, self._disk.invalidate(ids, reason=reason, where=[job.where[i] for i in indices]))
            logger.warning(
                "kvbm: %d disk block(s) failed verification (%s) and were dropped; the request recomputes", len(ids), reason
            )
        if bad:
            self.failures += 1
            self.pool.abort([job.ids[i] for i in sorted(bad)], [job.rows[i] for i in sorted(bad)])
        good = [i for i in range(len(job.ids)) if i not in bad]
        if good:
            self.pool.commit([job.metas[i] for i in good], [job.rows[i] for i in good])
            nbytes = len(good) * self._disk.slot_bytes
            self._observe("onboard_d2d", nbytes, seconds)
            if not bad:
                self._on_read(nbytes, seconds)

    def _finish_g4(self, job: _ReadJob) -> None:
        try:
            metas, seconds = job.future.result()
        except Exception:  # the request recomputes; nothing is staged
            logger.exception("kvbm: G4 read of %d blocks failed", len(job.ids))
            metas, seconds = [None] * len(job.ids), 0.0
        if job.generation != self.generation:
            self.pool.abort(job.ids, job.rows)
            return
        good = [i for i, meta in enumerate(metas) if meta is not None]
        bad = [i for i, meta in enumerate(metas) if meta is None]
        if bad:
            self.pool.abort([job.ids[i] for i in bad], [job.rows[i] for i in bad])
        if good:
            self.pool.commit([metas[i] for i in good], [job.rows[i] for i in good])
            self.g4_staged += len(good)
            self._g4_found([job.ids[i] for i in good])
            self.g4_meter.record(len(job.ids) * self.slot_bytes, seconds)

    def forget(self) -> None:
        """Drop every staged block; reads in flight are discarded when they end."""
        self.generation += 1
        self.pool.forget()

    def in_flight(self) -> list[Future]:
        return [job.future for job in self._pending]
