"""Where reads from the tiers below host land: host staging rows, verified, before a load copies them to the device.

A lookup that finds blocks in an indexed tier (disk) starts reading them here
at once (:meth:`ReadStaging.prefetch`), so a request that waits in the queue
has them in host memory by the time it is scheduled; a load that comes sooner
waits only for its own reads: they move ahead of other requests' prefetches
(:meth:`ReadStaging.wait`, ``lanes``), which are queued as jobs of at most
:data:`JOB_BYTES` so that a read someone waits for is never behind more than
one of them. A lookup reads the tail nearer tiers could not serve from a
remote tier (:meth:`ReadStaging.fetch`) and waits a bounded time for it.

Staged blocks are kept in LRU order, with the name of the tier each came from,
and reused by later loads until their rows are needed. Staging is not a tier:
nothing here is announced, and a block leaves staging without an event. A
block that fails verification is never staged (its tier drops it). A read of a
forgotten generation (the tiers were reset meanwhile) stages nothing.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import Future, wait
from typing import Optional, Sequence

from sglang_kvbm.core.identity import BlockId
from sglang_kvbm.tiers.host.pool import HostBlockPool
from sglang_kvbm.tiers.lower import LowerTier, Read
from sglang_kvbm.transfer.host_memory import aligned_empty
from sglang_kvbm.transfer.kv_layout import PagedKvLayout

JOB_BYTES = 32 << 20  # one read job: four of the disk tier's ~8 MiB transfers in flight


@dataclasses.dataclass(frozen=True)
class _ReadJob:
    tier: LowerTier
    read: Read
    ids: tuple[BlockId, ...]
    rows: tuple[int, ...]
    generation: int


class ReadStaging:
    def __init__(self, layout: PagedKvLayout, tiers: Sequence[LowerTier], capacity: int) -> None:
        self._tiers = tuple(tiers)
        self.pool = HostBlockPool(layout.host_slab(capacity, pin=layout.is_cuda))
        header_bytes = max(t.header_bytes for t in tiers)  # one header row per staged block, whichever tier
        self.slot_bytes = header_bytes + layout.block_bytes  # what one block's read moves
        self._headers = aligned_empty((capacity, header_bytes))
        for tier in tiers:
            tier.register_dram(self.pool.slab)
            tier.register_dram(self._headers)
        self.source: dict[BlockId, str] = {}  # staged block -> the name of the tier it was read from
        self._jobs: dict[BlockId, _ReadJob] = {}  # block being read -> its job
        self._pending: list[_ReadJob] = []
        self.generation = 0

    @property
    def capacity(self) -> int:
        return self.pool.capacity

    @property
    def job_blocks(self) -> int:
        return max(1, JOB_BYTES // self.slot_bytes)

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
            rows, evicted = self.pool.reserve(todo)  # no events: staging is not a tier
        finally:
            self.pool.unpin(needed)
        for meta in evicted:
            self.source.pop(meta.block_id, None)
        return todo[: len(rows)], rows

    def _start(self, tier: LowerTier, block_ids: Sequence[BlockId], keep: Sequence[BlockId], *,
               urgent: bool) -> list[Future]:
        """Read the blocks not staged or being read yet from ``tier``, in jobs; stops at one that cannot start."""
        todo, rows = self._reserve(block_ids, keep)
        futures = []
        step = self.job_blocks
        for start in range(0, len(todo), step):
            ids, job_rows = tuple(todo[start : start + step]), tuple(rows[start : start + step])
            read = tier.start_read(ids, self.pool.slab, self._headers, job_rows, urgent=urgent)
            if read is None:  # not held any more, or the tier is down: the rest is not read
                self.pool.abort(rows[start:])
                break
            job = _ReadJob(tier, read, ids, job_rows, self.generation)
            self._pending.append(job)
            self._jobs.update(dict.fromkeys(ids, job))
            futures.append(read.future)
        return futures

    def prefetch(self, tier: LowerTier, block_ids: Sequence[BlockId], *, keep: Sequence[BlockId] = ()) -> None:
        """Start reading blocks an indexed tier holds (a lookup found them); nobody waits for them yet."""
        self._start(tier, block_ids, keep, urgent=False)

    def fetch(self, tier: LowerTier, block_ids: Sequence[BlockId], *, keep: Sequence[BlockId] = ()) -> list[Future]:
        """Start reading a lookup's tail from a remote tier: the futures it waits for (none if the tier is down)."""
        if tier.stalled():
            return []
        return self._start(tier, block_ids, keep, urgent=True)

    def pending_bytes(self, block_ids: Sequence[BlockId]) -> int:
        """Bytes still to read for these blocks (whole jobs: a job is read as one)."""
        jobs = {id(job): job for job in map(self._jobs.get, block_ids) if job is not None}
        return sum(len(job.ids) for job in jobs.values()) * self.slot_bytes

    def busy(self) -> bool:
        """Some read is in flight (or done and not collected yet)."""
        return bool(self._pending)

    def futures_of(self, block_ids: Sequence[BlockId], *, promote: bool = False) -> list[Future]:
        """The futures of the reads in flight for these blocks, each once (``promote``: someone waits for them now:
        moved ahead of other prefetches, as ``wait`` does)."""
        jobs = {id(job): job for job in map(self._jobs.get, block_ids) if job is not None}.values()
        if promote:
            for job in jobs:
                job.tier.promote([job.read.future])
        return [job.read.future for job in jobs]

    def pending_tiers(self, block_ids: Sequence[BlockId]) -> list[LowerTier]:
        """The tiers these blocks are being read from."""
        return list({id(job.tier): job.tier for job in map(self._jobs.get, block_ids) if job is not None}.values())

    def wait(self, block_ids: Sequence[BlockId], timeout: Optional[float]) -> bool:
        """Wait for the reads of these blocks, moved ahead of other prefetches; False on timeout.

        On a timeout the reads stay in flight (and staged when they end, for a later request).
        """
        jobs = {id(job): job for job in map(self._jobs.get, block_ids) if job is not None}
        if not jobs:
            return True
        for job in jobs.values():
            job.tier.promote([job.read.future])
        _, not_done = wait([job.read.future for job in jobs.values()], timeout=timeout)
        self.collect()
        return not not_done

    def collect(self) -> None:
        """Finish the reads that are done: stage verified blocks, give back the rows of the others."""
        if not self._pending:
            return
        still = []
        for job in self._pending:
            if not job.read.future.done():
                still.append(job)
                continue
            for block_id in job.ids:
                self._jobs.pop(block_id, None)
            self._finish(job)
        self._pending = still

    def _finish(self, job: _ReadJob) -> None:
        current = job.generation == self.generation
        metas = job.tier.finish_read(job.read, job.ids, current)
        good = [i for i, meta in enumerate(metas) if meta is not None]
        if len(good) < len(job.ids):
            bad = [i for i, meta in enumerate(metas) if meta is None]
            self.pool.abort([job.rows[i] for i in bad])
        if good:
            self.pool.commit([metas[i] for i in good], [job.rows[i] for i in good])
            self.source.update(dict.fromkeys((job.ids[i] for i in good), job.tier.name))

    def forget(self) -> None:
        """Drop every staged block; reads in flight are discarded when they end."""
        self.generation += 1
        self.pool.forget()
        self.source.clear()

    def in_flight(self) -> list[Future]:
        return [job.read.future for job in self._pending]
