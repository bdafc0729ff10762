"""The ``local`` block manager: host memory (G2) and local disk (G3), no CUDA needed.

Where a page goes (the scheduler thread only reserves room and submits; the
copies run on workers, see ``copies``):

* stored from the device: into a host row while rows can be had (least
  recently used host blocks are evicted for it), else straight to disk;
* from host to disk: once KVBM's frequency filter says the block was reused
  (or always, with the filter off), the host row pinned meanwhile;
* back to the device: host blocks directly, disk blocks through verified
  staging rows (``read_staging``), one layer at a time (``copies.load_layer``).

A block becomes visible (and is announced) in a tier only once its bytes are
completely there and its parent is held somewhere below; :meth:`poll` is
where that happens.
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
from itertools import compress
import logging
from collections import deque
from concurrent.futures import Executor, Future, ThreadPoolExecutor, wait
from typing import Optional, Protocol, Sequence

from sglang_kvbm.backends.local import copies
from sglang_kvbm.backends.local.host_pool import HostBlockPool
from sglang_kvbm.backends.local.lookups import LoadPlan, TierReads
from sglang_kvbm.backends.local.read_staging import ReadStaging
from sglang_kvbm.core.identity import BlockId
from sglang_kvbm.core.offload_filter import FrequencyFilter
from sglang_kvbm.core.onboard_policy import OnboardPolicy
from sglang_kvbm.core.ports import BlockMeta, PollResult, StoreRequest, TierCounts, TierEvent, TierEventKind
from sglang_kvbm.core.tiers import Tier
from sglang_kvbm.kv_layout import PagedKvLayout

logger = logging.getLogger(__name__)
GIB = 1 << 30


class TransferObserver(Protocol):
    def observe(self, path: str, nbytes: int, seconds: float) -> None: ...


@dataclasses.dataclass(frozen=True)
class _Job:
    """A copy down: device -> host (``target`` HOST), device -> disk, or host -> disk (``ticket`` None)."""

    ticket: Optional[int]
    target: Tier
    ids: tuple[BlockId, ...]
    slots: tuple  # host rows, or disk reservations
    generation: int
    future: Future
    host_rows: tuple[int, ...] = ()  # host -> disk: the pinned rows it reads
    metas: tuple[BlockMeta, ...] = ()  # host -> disk: known up front


@dataclasses.dataclass
class LocalStats:
    stores_submitted: int = 0
    store_failures: int = 0
    blocks_not_stored_no_room: int = 0
    blocks_dropped_unreachable: int = 0
    disk_writes_submitted: int = 0
    disk_write_failures: int = 0
    load_waits: int = 0


class LocalBlockManager:
    """A :class:`~sglang_kvbm.core.ports.BlockManager` over a host slab and/or a disk store."""

    def __init__(
        self,
        layout: PagedKvLayout,
        host_blocks: int,
        *,
        pin: bool = False,
        disk=None,
        offload_filter: Optional[FrequencyFilter] = None,
        policy: Optional[OnboardPolicy] = None,
        observer: Optional[TransferObserver] = None,
        staging_blocks: int = 0,
        executor: Optional[Executor] = None,
        load_timeout: float = 30.0,
    ) -> None:
        """``executor`` (tests) replaces the device -> host worker; it must run one job at a time."""
        if host_blocks < 0 or (host_blocks == 0 and disk is None):
            raise ValueError(f"need a host tier (host_blocks={host_blocks}) or a disk tier")
        self.layout = layout
        self.host = HostBlockPool(layout.host_slab(host_blocks, pin=pin)) if host_blocks else None
        self.disk = disk
        self._filter = offload_filter
        self.policy = policy
        self.observer = observer
        self.stats = LocalStats()
        # One thread and one CUDA stream per copy path, made here, before any copy runs.
        self._offload = executor or ThreadPoolExecutor(1, thread_name_prefix="kvbm-offload")
        self._offload_stream = layout.new_stream()
        self._writer = self._reader = self._writer_stream = None
        self.staging: Optional[ReadStaging] = None
        if disk is not None:
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="kvbm-disk-write")
            self._reader = ThreadPoolExecutor(1, thread_name_prefix="kvbm-disk-read")
            self._writer_stream = layout.new_stream()
            if self.host is not None:
                disk.register_dram(self.host.slab)
            on_read = policy.read.record if policy is not None else (lambda nbytes, seconds: None)
            blocks = staging_blocks or max(16, min(layout.num_pages, GIB // layout.block_bytes))
            self.staging = ReadStaging(layout, disk, blocks, self._reader, self._removed, self._observe, on_read)
        self.reads = TierReads(layout, self.host, disk, self.staging, policy, self.stats, self._offer_to_disk, load_timeout)
        self._jobs: deque[_Job] = deque()  # device -> lower tier, in submission order
        self._writes: deque[_Job] = deque()  # host -> disk
        self._events: list[TierEvent] = []
        self._tickets = itertools.count(1)
        self._parts: dict[int, list] = {}  # ticket -> [jobs left, every page held]
        self._done: list[tuple[int, bool]] = []
        self._generation = 0
        if disk is not None and len(disk):
            self._announce_restored(disk.registered_metas())

    # -- storing -------------------------------------------------------------------

    def store(self, request: StoreRequest) -> int:
        ticket = next(self._tickets)
        self._parts[ticket] = [0, True]
        ids = request.block_ids
        host, disk = self.host, self.disk
        top = host if host is not None else disk
        todo = list(compress(range(len(ids)), map(operator.not_, map(top.holds, ids))))
        if todo and host is not None:
            rows, evicted = host.reserve([ids[i] for i in todo])
            self._removed(Tier.HOST, evicted)
            if rows:
                positions, todo = todo[: len(rows)], todo[len(rows) :]
                future = self._offload.submit(
                    copies.device_to_host, self.layout, self._offload_stream, request, positions, host.slab, rows
                )
                self._submit(_Job(ticket, Tier.HOST, tuple(ids[i] for i in positions), tuple(rows), self._generation, future))
        if todo and disk is not None:
            todo = [i for i in todo if not disk.holds(ids[i])]
            reserved, evicted = disk.reserve([ids[i] for i in todo])
            self._removed(Tier.DISK, evicted)
            if reserved:
                positions, todo = todo[: len(reserved)], todo[len(reserved) :]
                future = self._writer.submit(
                    copies.device_to_disk, self.layout, self._writer_stream, disk, request, positions, reserved
                )
                self._submit(_Job(ticket, Tier.DISK, tuple(r.block_id for r in reserved), tuple(reserved),
                                  self._generation, future))
        if todo:
            self.stats.blocks_not_stored_no_room += len(todo)
            self._parts[ticket][1] = False
        if not self._parts[ticket][0]:
            self._done.append((ticket, self._parts.pop(ticket)[1]))
        return ticket

    def _submit(self, job: _Job) -> None:
        self._jobs.append(job)
        self._parts[job.ticket][0] += 1
        self.stats.stores_submitted += 1

    def _offer_to_disk(self, metas: Sequence[BlockMeta]) -> None:
        """Host blocks that earned a disk copy (KVBM's frequency filter): pin their rows, write them."""
        if self.disk is None or not metas:
            return
        if self._filter is not None:
            metas = [m for m in metas if self._filter.offer(m.block_id)]
        todo = [m for m in metas if self.host.registered(m.block_id) and not self.disk.holds(m.block_id)]
        if not todo:
            return
        reserved, evicted = self.disk.reserve([m.block_id for m in todo])
        self._removed(Tier.DISK, evicted)
        if not reserved:
            return
        todo = todo[: len(reserved)]
        ids = tuple(m.block_id for m in todo)
        rows = self.host.pin(ids)
        future = self._writer.submit(copies.host_to_disk, self.disk, reserved, todo, self.host.slab, rows)
        self._writes.append(_Job(None, Tier.DISK, ids, tuple(reserved), self._generation, future, tuple(rows), tuple(todo)))
        self.stats.disk_writes_submitted += 1

    # -- completions -------------------------------------------------------------------

    def poll(self) -> PollResult:
        earned: list[BlockMeta] = []
        while self._jobs and self._jobs[0].future.done():
            job = self._jobs.popleft()
            held = self._finish_store(job, earned)
            part = self._parts.get(job.ticket)
            if part is not None:
                part[0] -= 1
                part[1] = part[1] and held
                if not part[0]:
                    del self._parts[job.ticket]
                    if job.generation == self._generation:
                        self._done.append((job.ticket, part[1]))
        while self._writes and self._writes[0].future.done():
            self._finish_write(self._writes.popleft())
        self._offer_to_disk(earned)
        if self.staging is not None:
            self.staging.collect()
        if self.disk is not None:
            self._removed(Tier.DISK, self.disk.take_retired())
            self.disk.persist()
        events, self._events = self._events, []
        done, self._done = self._done, []
        return PollResult(tuple(done), tuple(events))

    def _finish_store(self, job: _Job, earned: list[BlockMeta]) -> bool:
        """Register what a device -> host/disk copy wrote; True when all of its pages are held now."""
        error = _error_of(job.future)
        pool = self.host if job.target is Tier.HOST else self.disk
        if job.generation != self._generation or error is not None:
            if error is not None and error is not _CANCELLED:
                logger.error("kvbm: device->%s copy of %d blocks failed: %r", job.target.name.lower(), len(job.ids), error)
                self.stats.store_failures += 1
            self._abort(job)
            return False
        result = job.future.result()
        metas, seconds = result[0], result[-1]
        reachable = self._reachable(metas, set(job.ids))
        if reachable < len(metas):  # a page whose parent is held nowhere below could never be hit
            self.stats.blocks_dropped_unreachable += len(metas) - reachable
        keep = metas[:reachable]
        if job.target is Tier.HOST:
            pool.abort(job.ids[reachable:], job.slots[reachable:])
            pool.commit(keep, job.slots[:reachable])
            self._observe("d2h", reachable * self.layout.page_bytes, seconds)
            self._events.append(TierEvent(TierEventKind.STORED, Tier.HOST, tuple(keep), Tier.DEVICE))
            earned.extend(keep)
        else:
            headers = result[1]
            self.disk.abort(job.slots[reachable:])
            registered = self.disk.commit(job.slots[:reachable], headers[:reachable])
            self._observe("d2d", reachable * self.disk.slot_bytes, seconds)
            self._events.append(TierEvent(TierEventKind.STORED, Tier.DISK, tuple(registered), Tier.DEVICE))
            reachable = len(registered)
        return reachable == len(metas)

    def _reachable(self, metas: Sequence[BlockMeta], ids: set) -> int:
        """How many leading pages have their parent in this copy or held below (registered or on its way)."""
        host, disk = self.host, self.disk
        for i, meta in enumerate(metas):
            parent = meta.parent_id
            if parent is None or parent in ids:
                continue
            if (host is not None and host.holds(parent)) or (disk is not None and disk.holds(parent)):
                continue
            return i
        return len(metas)

    def _finish_write(self, job: _Job) -> None:
        self.host.unpin(job.ids)
        self.host.release_orphans(job.host_rows)
        error = _error_of(job.future)
        if job.generation != self._generation or error is not None:
            if error is not None and error is not _CANCELLED:
                logger.error("kvbm: host->disk write of %d blocks failed: %r", len(job.ids), error)
                self.stats.disk_write_failures += 1
            self.disk.abort(job.slots)
            return
        headers, seconds = job.future.result()
        registered = self.disk.commit(job.slots, headers)
        self._observe("h2d", len(registered) * self.disk.slot_bytes, seconds)
        self._events.append(TierEvent(TierEventKind.STORED, Tier.DISK, tuple(registered), Tier.HOST))

    def _abort(self, job: _Job) -> None:
        if job.target is Tier.HOST:
            self.host.abort(job.ids, job.slots)
        else:
            self.disk.abort(job.slots)

    # -- finding and loading (see ``lookups``) --------------------------------------------

    def peek(self, block_ids: Sequence[BlockId]) -> tuple[int, int]:
        return self.reads.peek(block_ids)

    def lookup(self, block_ids: Sequence[BlockId]) -> tuple[int, int]:
        return self.reads.lookup(block_ids)

    def acquire(self, block_ids: Sequence[BlockId]) -> Optional[LoadPlan]:
        return self.reads.acquire(block_ids)

    def release(self, plan: LoadPlan, *, reused: bool = True) -> None:
        self.reads.release(plan, reused=reused)

    def load_parts(self, plan: LoadPlan, pages) -> list:
        return self.reads.load_parts(plan, pages)

    # -- the rest of the port --------------------------------------------------------------

    def counts(self) -> tuple[TierCounts, ...]:
        counts = []
        if self.host is not None:
            counts.append(TierCounts(Tier.HOST, len(self.host), self.host.capacity))
        if self.disk is not None:
            counts.append(TierCounts(Tier.DISK, len(self.disk), self.disk.num_slots))
        return tuple(counts)

    def in_flight(self) -> list[Future]:
        futures = [job.future for job in self._jobs] + [job.future for job in self._writes]
        return futures + (self.staging.in_flight() if self.staging is not None else [])

    def busy(self) -> bool:
        return bool(self.in_flight())

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Wait for the copies submitted so far (not for those their completion starts); False on timeout."""
        _, not_done = wait(self.in_flight(), timeout=timeout)
        return not not_done

    def reset(self) -> None:
        self._generation += 1
        self._parts.clear()
        self._done.clear()
        if self.host is not None:
            self.host.forget()
        if self.staging is not None:
            self.staging.forget()
        if self.disk is not None:
            self.disk.forget()
        self._events.clear()

    def close(self) -> None:
        for executor in (self._offload, self._writer, self._reader):
            if executor is not None:
                executor.shutdown(wait=True, cancel_futures=True)
        self.poll()
        if self.disk is not None:
            self.disk.close()

    def _observe(self, path: str, nbytes: int, seconds: float) -> None:
        if self.observer is not None and nbytes:
            self.observer.observe(path, nbytes, seconds)

    def _removed(self, tier: Tier, metas: Sequence[BlockMeta]) -> None:
        if metas:
            self._events.append(TierEvent(TierEventKind.REMOVED, tier, tuple(metas)))

    def _announce_restored(self, metas: list[BlockMeta]) -> None:
        """Disk blocks found at start-up, announced parents first (an orphan would be dropped by the router)."""
        by_parent: dict[Optional[int], list[BlockMeta]] = {}
        for meta in metas:
            if meta.event is not None:
                by_parent.setdefault(meta.event.parent_block_hash, []).append(meta)
        announced, frontier = [], list(by_parent.pop(None, []))
        while frontier:
            meta = frontier.pop()
            announced.append(meta)
            frontier.extend(by_parent.pop(meta.event.block_hash, []))
        if announced:
            self._events.append(TierEvent(TierEventKind.STORED, Tier.DISK, tuple(announced)))


def _error_of(future: Future) -> Optional[BaseException]:
    if future.cancelled():
        return _CANCELLED
    return future.exception()


_CANCELLED = RuntimeError("cancelled at shutdown")
