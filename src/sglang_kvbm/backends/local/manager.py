"""The ``local`` block manager: host memory (G2) and local disk (G3), no CUDA needed.

Flows (the scheduler thread only reserves room and submits; workers copy):

* G1 -> G2: a store's pages are copied into reserved host rows by the offload
  worker (on CUDA: a side stream that waits for the forward pass).
* G2 -> G3: a host block that earns it (KVBM's frequency filter, or every block
  when the filter is off) is written to disk by the disk worker, its host row
  pinned meanwhile.
* G1 -> G3: without a host tier, a store goes straight to disk through a
  staging buffer.
* G2/G3 -> G1: a load reads disk blocks into staging and verifies them, then
  copies host and verified disk bytes into the device pages, on the caller's
  thread. Any failure is a miss for the whole load.

A block becomes visible (and is announced) in a tier only once its bytes are
completely there; :meth:`LocalBlockManager.poll` is where that happens.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections import deque
from concurrent.futures import Executor, Future, ThreadPoolExecutor, wait
from typing import Optional, Protocol, Sequence

from sglang_kvbm.backends.local.disk_store import DiskStore, Reservation
from sglang_kvbm.backends.local.host_pool import HostBlockPool, Reserved
from sglang_kvbm.core.identity import BlockId
from sglang_kvbm.core.offload_filter import FrequencyFilter
from sglang_kvbm.core.onboard_policy import OnboardPolicy
from sglang_kvbm.core.ports import (
    BlockMeta,
    LoadResult,
    PageStore,
    PollResult,
    TierCounts,
    TierEvent,
    TierEventKind,
)
from sglang_kvbm.core.tiers import Tier
from sglang_kvbm.kv_layout import PagedKvLayout

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class _HostJob:
    ticket: int
    generation: int
    reserved: tuple[Reserved, ...]
    future: Future


@dataclasses.dataclass(frozen=True)
class _DiskJob:
    ticket: Optional[int]  # set for device -> disk stores (device pages are read)
    generation: int
    reserved: tuple[Reservation, ...]
    host_ids: tuple[BlockId, ...]  # pinned host blocks it reads (host -> disk)
    host_rows: tuple[int, ...]
    future: Future


@dataclasses.dataclass
class LocalStats:
    stores_submitted: int = 0
    store_failures: int = 0
    blocks_not_stored_no_room: int = 0
    disk_writes_submitted: int = 0
    disk_write_failures: int = 0
    load_failures: int = 0
    disk_blocks_invalidated: int = 0


class TransferObserver(Protocol):
    def observe(self, path: str, nbytes: int, seconds: float) -> None: ...


def _timed(fn, *args):
    """Run ``fn`` on a worker and return ``(result, seconds)``."""
    started = time.perf_counter()
    result = fn(*args)
    return result, time.perf_counter() - started


class LocalBlockManager:
    """A :class:`~sglang_kvbm.core.ports.BlockManager` over a host slab and/or a disk store."""

    def __init__(
        self,
        layout: PagedKvLayout,
        host_blocks: int,
        *,
        pin: bool = False,
        executor: Optional[Executor] = None,
        disk: Optional[DiskStore] = None,
        disk_executor: Optional[Executor] = None,
        offload_filter: Optional[FrequencyFilter] = None,
        policy: Optional[OnboardPolicy] = None,
        observer: Optional[TransferObserver] = None,
    ) -> None:
        """``executor``/``disk_executor`` run copies in order (default: one thread each);
        ``offload_filter`` None writes every host block to disk; ``policy`` None always loads."""
        if host_blocks < 0 or (host_blocks == 0 and disk is None):
            raise ValueError(f"need a host tier (host_blocks={host_blocks}) or a disk tier")
        self._layout = layout
        self._host = HostBlockPool(layout.host_slab(host_blocks, pin=pin)) if host_blocks else None
        self._disk = disk
        if disk is not None and self._host is not None:
            disk.register_dram(self._host.slab)
        self._filter = offload_filter
        self._policy = policy
        self.observer = observer
        self._executor = executor or ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvbm-offload")
        self._disk_executor = None
        if disk is not None:
            self._disk_executor = disk_executor or ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvbm-disk")
        self._jobs: deque[_HostJob] = deque()
        self._disk_jobs: deque[_DiskJob] = deque()
        self._events: list[TierEvent] = []
        self._tickets = itertools.count(1)
        self._parts: dict[int, int] = {}  # store ticket -> jobs still running
        self._generation = 0
        self.stats = LocalStats()
        if disk is not None and len(disk):
            self._announce_restored(disk.registered_metas())

    @property
    def keeps_token_ids(self) -> bool:
        return self._disk is not None

    @property
    def layout(self) -> PagedKvLayout:
        return self._layout

    @property
    def host(self) -> Optional[HostBlockPool]:
        return self._host

    @property
    def disk(self) -> Optional[DiskStore]:
        return self._disk

    # -- storing ------------------------------------------------------------

    def store(self, pages: Sequence[PageStore]) -> Optional[int]:
        """Copy pages down: into host rows while there is room, the rest straight to disk.

        One ticket covers every job the store needed; it completes when all have.
        """
        ticket = next(self._tickets)
        rest = list(pages)
        if self._host is not None:
            rest = self._store_to_host(rest, ticket)
        if rest and self._disk is not None:
            rest = self._store_to_disk(rest, ticket)
        self.stats.blocks_not_stored_no_room += len(rest)
        return ticket if self._parts.get(ticket) else None

    def _store_to_host(self, pages: list[PageStore], ticket: int) -> list[PageStore]:
        """Submit what finds a host row; return the pages that did not (from the first one on)."""
        todo = [page for page in pages if not self._host.holds(page.meta.block_id)]
        if not todo:
            return []
        reserved, evicted = self._host.reserve([p.meta for p in todo])
        self._removed(Tier.HOST, evicted)
        if reserved:
            device_pages = [page.device_page for page in todo[: len(reserved)]]
            rows = [row for row, _ in reserved]
            future = self._executor.submit(
                _timed, self._layout.save, device_pages, self._host.slab, rows, self._layout.ready_event()
            )
            self._jobs.append(_HostJob(ticket, self._generation, tuple(reserved), future))
            self._parts[ticket] = self._parts.get(ticket, 0) + 1
            self.stats.stores_submitted += 1
        return todo[len(reserved) :]

    def _store_to_disk(self, pages: list[PageStore], ticket: int) -> list[PageStore]:
        todo = [page for page in pages if not self._disk.holds(page.meta.block_id)]
        if not todo:
            return []
        reserved, evicted = self._disk.reserve([p.meta for p in todo])
        self._removed(Tier.DISK, evicted)
        if reserved:
            device_pages = [page.device_page for page in todo[: len(reserved)]]
            future = self._disk_executor.submit(
                _timed, self._device_to_disk, device_pages, tuple(reserved), self._layout.ready_event()
            )
            self._disk_jobs.append(_DiskJob(ticket, self._generation, tuple(reserved), (), (), future))
            self._parts[ticket] = self._parts.get(ticket, 0) + 1
            self.stats.disk_writes_submitted += 1
        return todo[len(reserved) :]

    def _device_to_disk(self, device_pages, reserved, ready):
        """Disk worker: device pages -> staging -> disk, a staging-full at a time."""
        staging = self._disk.write_data
        headers = []
        for start in range(0, len(reserved), staging.shape[0]):
            chunk = reserved[start : start + staging.shape[0]]
            n = len(chunk)
            self._layout.save(device_pages[start : start + n], staging, list(range(n)), ready)
            headers += self._disk.write(chunk, [staging[i] for i in range(n)])
        return headers

    def _offload_to_disk(self, metas: Sequence[BlockMeta]) -> None:
        """Host blocks that earned a disk copy: reserve slots, pin their rows, write them."""
        if self._disk is None or not metas:
            return
        todo = [m for m in metas if self._host.registered(m.block_id) and not self._disk.holds(m.block_id)]
        if not todo:
            return
        reserved, evicted = self._disk.reserve(todo)
        self._removed(Tier.DISK, evicted)
        if not reserved:
            return
        ids = tuple(r.meta.block_id for r in reserved)
        rows = self._host.pin(ids)
        slab = self._host.slab
        future = self._disk_executor.submit(_timed, self._disk.write, tuple(reserved), [slab[row] for row in rows])
        self._disk_jobs.append(_DiskJob(None, self._generation, tuple(reserved), ids, tuple(rows), future))
        self.stats.disk_writes_submitted += 1

    def _earned_disk(self, metas: Sequence[BlockMeta]) -> list[BlockMeta]:
        if self._disk is None:
            return []
        if self._filter is None:
            return list(metas)
        return [m for m in metas if self._filter.offer(m.block_id)]

    # -- finding and loading -------------------------------------------------

    def lookup(self, block_ids: Sequence[BlockId]) -> int:
        host, disk = self._host, self._disk
        hit = 0
        disk_only = 0
        first_disk: Optional[int] = None
        for block_id in block_ids:
            if host is not None and host.registered(block_id):
                pass
            elif disk is not None and disk.registered(block_id):
                disk_only += 1
                if first_disk is None:
                    first_disk = hit
            else:
                break
            hit += 1
        if disk_only and self._policy is not None and not self._policy.disk_pays(disk_only * self._layout.page_size):
            hit = first_disk
        if host is not None:
            host.touch(block_ids[:hit])
        if disk is not None:
            disk.touch(block_ids[:hit])
        return hit

    def peek(self, block_ids: Sequence[BlockId]) -> tuple[int, int]:
        host_run = lower_run = 0
        in_host_prefix = True
        for block_id in block_ids:
            in_host = self._host is not None and self._host.registered(block_id)
            if not in_host and not (self._disk is not None and self._disk.registered(block_id)):
                break
            in_host_prefix = in_host_prefix and in_host
            host_run += in_host_prefix
            lower_run += 1
        return host_run, lower_run

    def load(self, block_ids: Sequence[BlockId], device_pages: Sequence[int]) -> Optional[LoadResult]:
        host, disk = self._host, self._disk
        host_ids, host_rows, host_pages = [], [], []
        disk_ids, disk_pages = [], []
        for block_id, page in zip(block_ids, device_pages):
            row = host.row_of(block_id) if host is not None else None
            if row is not None:
                host_ids.append(block_id)
                host_rows.append(row)
                host_pages.append(page)
            elif disk is not None and disk.registered(block_id):
                disk_ids.append(block_id)
                disk_pages.append(page)
            else:
                return None
        if disk_ids and not self._load_from_disk(disk_ids, disk_pages):
            return None
        if host_ids:
            started = time.perf_counter()
            try:
                self._layout.load(host_rows, host.slab, host_pages)
            except Exception:  # the request recomputes; the caller frees its pages
                logger.exception("kvbm: host->device copy of %d blocks failed", len(host_ids))
                self.stats.load_failures += 1
                return None
            self._observe("onboard_h2d", len(host_ids) * self._layout.page_bytes, time.perf_counter() - started)
            host.touch(host_ids)
            if disk is not None:  # a hit is a reuse: the filter may now send these blocks to disk
                self._offload_to_disk(self._earned_disk([host.meta_of(b) for b in host_ids]))
        return LoadResult(len(host_ids), len(disk_ids))

    def _load_from_disk(self, block_ids: list[BlockId], device_pages: list[int]) -> bool:
        entries = self._disk.entries(block_ids)
        if entries is None:
            return False

        def consume(rows, first, count):
            self._layout.load(list(range(count)), rows, device_pages[first : first + count])

        started = time.perf_counter()
        try:
            failed = self._disk.read(entries, consume)
        except Exception:
            logger.exception("kvbm: disk read of %d blocks failed", len(block_ids))
            failed = [(i, "I/O error") for i in range(len(block_ids))]
        self._removed(Tier.DISK, self._disk.take_retired())
        if failed:
            by_reason: dict[str, list[BlockId]] = {}
            for index, reason in failed:
                by_reason.setdefault(reason, []).append(block_ids[index])
            for reason, ids in by_reason.items():
                removed = self._disk.invalidate(ids, reason=reason)
                self._removed(Tier.DISK, removed)
                self.stats.disk_blocks_invalidated += len(removed)
                logger.warning(
                    "kvbm: %d disk block(s) failed verification (%s) and were dropped; the request recomputes",
                    len(ids), reason,
                )
            self.stats.load_failures += 1
            return False
        seconds = time.perf_counter() - started
        if self._policy is not None:
            self._policy.read.record(len(block_ids) * self._disk.slot_bytes, seconds)
        self._observe("onboard_d2d", len(block_ids) * self._disk.slot_bytes, seconds)
        self._disk.touch(block_ids)
        return True

    # -- completions ------------------------------------------------------------

    def poll(self) -> PollResult:
        completed: list[int] = []
        earned: list[BlockMeta] = []
        while self._jobs and self._jobs[0].future.done():
            job = self._jobs.popleft()
            self._part_done(job.ticket, completed)
            error = _error_of(job.future)
            if job.generation != self._generation:
                self._host.abort(job.reserved)  # reset while copying: the bytes belong to a dropped tree
            elif error is _CANCELLED:
                self._host.abort(job.reserved)
            elif error is not None:
                logger.error("kvbm: device->host copy of %d blocks failed: %r", len(job.reserved), error)
                self.stats.store_failures += 1
                self._host.abort(job.reserved)
            else:
                metas = self._host.commit(job.reserved)
                self._observe("d2h", len(metas) * self._layout.page_bytes, job.future.result()[1])
                self._events.append(TierEvent(TierEventKind.STORED, Tier.HOST, tuple(metas), Tier.DEVICE))
                earned += self._earned_disk(metas)
        while self._disk_jobs and self._disk_jobs[0].future.done():
            job = self._disk_jobs.popleft()
            if job.ticket is not None:
                self._part_done(job.ticket, completed)
            if job.generation != self._generation:
                if self._host is not None:
                    self._host.release_orphans(job.host_rows)
                self._disk.abort(job.reserved)
                continue
            if self._host is not None:
                self._host.unpin(job.host_ids)
            error = _error_of(job.future)
            if error is _CANCELLED:
                self._disk.abort(job.reserved)
                continue
            if error is not None:
                logger.error("kvbm: disk write of %d blocks failed: %s", len(job.reserved), error)
                self.stats.disk_write_failures += 1
                self._disk.abort(job.reserved)
                continue
            headers, seconds = job.future.result()
            metas = self._disk.commit(job.reserved, headers)
            source = Tier.HOST if job.ticket is None else Tier.DEVICE
            self._observe("h2d" if source is Tier.HOST else "d2d", len(job.reserved) * self._disk.slot_bytes, seconds)
            self._events.append(TierEvent(TierEventKind.STORED, Tier.DISK, tuple(metas), source))
        self._offload_to_disk(earned)
        if self._disk is not None:
            self._removed(Tier.DISK, self._disk.take_retired())
            self._disk.persist()
        events, self._events = self._events, []
        return PollResult(tuple(completed), tuple(events))

    def _observe(self, path: str, nbytes: int, seconds: float) -> None:
        if self.observer is not None:
            self.observer.observe(path, nbytes, seconds)

    def _part_done(self, ticket: int, completed: list[int]) -> None:
        left = self._parts.pop(ticket) - 1
        if left:
            self._parts[ticket] = left
        else:
            completed.append(ticket)

    def _removed(self, tier: Tier, metas: Sequence[BlockMeta]) -> None:
        if metas:
            self._events.append(TierEvent(TierEventKind.REMOVED, tier, tuple(metas)))

    def _announce_restored(self, metas: list[BlockMeta]) -> None:
        """Disk blocks found at start-up, announced parents first (an orphan would be dropped by the router)."""
        by_parent: dict[Optional[int], list[BlockMeta]] = {}
        announced = []
        for meta in metas:
            if meta.event is not None:
                by_parent.setdefault(meta.event.parent_block_hash, []).append(meta)
        frontier = list(by_parent.pop(None, []))
        while frontier:
            meta = frontier.pop()
            announced.append(meta)
            frontier.extend(by_parent.pop(meta.event.block_hash, []))
        if announced:
            self._events.append(TierEvent(TierEventKind.STORED, Tier.DISK, tuple(announced)))

    # -- the rest of the port ------------------------------------------------------

    def counts(self) -> tuple[TierCounts, ...]:
        counts = []
        if self._host is not None:
            counts.append(TierCounts(Tier.HOST, len(self._host), self._host.capacity))
        if self._disk is not None:
            counts.append(TierCounts(Tier.DISK, len(self._disk), self._disk.num_slots))
        return tuple(counts)

    def in_flight(self) -> int:
        return len(self._jobs) + len(self._disk_jobs)

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Wait for the copies submitted so far (not for the disk writes their completion may start)."""
        futures = [job.future for job in self._jobs] + [job.future for job in self._disk_jobs]
        _, not_done = wait(futures, timeout=timeout)
        return not not_done

    def reset(self) -> None:
        self._generation += 1
        if self._host is not None:
            self._host.forget()
        if self._disk is not None:
            self._disk.forget()
        self._events.clear()

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
        if self._disk_executor is not None:
            self._disk_executor.shutdown(wait=True, cancel_futures=True)
        self.poll()
        if self._disk is not None:
            self._disk.close()


def _error_of(future: Future) -> Optional[BaseException]:
    if future.cancelled():
        return _CANCELLED
    return future.exception()


_CANCELLED = RuntimeError("cancelled at shutdown")
