"""Copies down from the device, and their completions: device -> host, and device -> disk when no host row is free.

The scheduler thread reserves room and queues; one thread per path copies
(see ``copies``; each with its own CUDA stream, made before it starts).
Device -> host copies are handed to their thread once per scheduler step
(:meth:`Offloads.flush`, from the step's first call, ``poll``): every store
of a step is one job and at most one wake-up of that thread, not one per
node. A store's copy so starts at the next step's first call instead of at
once: after what is left of the step that inserted it (no forward between).
The disk tier's writer serves device -> disk copies (which the tree waits for,
in order) ahead of its background host -> disk writes (see ``lanes``). A store's
pages go into host rows while rows can be had (least recently used host
blocks are evicted for them), the rest straight to disk. What the host tier
registers is offered to the lower tiers (``manager``), whose own writes start
from host rows. :meth:`Offloads.collect` registers what finished, in
submission order: a page becomes visible (and is announced) only once its
bytes are there and its parent is held somewhere below.

Completions of a cache generation that was reset or dropped since touch
nothing of the new one: their blocks were forgotten with the tiers (and the
pins on their rows with them), so they only give back the rows and slots they
held. They never unpin by block id, which a newer copy of the same block may
hold pinned.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections import deque
from concurrent.futures import Executor, Future
from typing import Callable, Optional, Sequence

from sglang_kvbm.core.pages import Page, unchained
from sglang_kvbm.core.ports import StoreRequest, TierEvent, TierEventKind
from sglang_kvbm.core.tiers import DEVICE, DISK, HOST, TierInfo
from sglang_kvbm.transfer import copies
from sglang_kvbm.transfer.lanes import LaneExecutor

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class _Job:
    """A copy down: device -> host (``target`` HOST) or device -> disk (``target`` DISK)."""

    ticket: int
    target: TierInfo
    slots: Sequence  # host rows, or disk reservations: one per page copied (the pages' ids come back in their metas)
    generation: int
    future: Future


@dataclasses.dataclass
class OffloadStats:
    stores_submitted: int = 0
    store_failures: int = 0
    blocks_not_stored_no_room: int = 0
    blocks_dropped_unreachable: int = 0


class Offloads:
    def __init__(self, layout, host, disk, emit: Callable[[TierEvent], None],
                 observe: Callable[[str, int, float], None], executor: Optional[Executor] = None) -> None:
        """``disk``: the disk tier (``DiskTier``) device pages go to when no host row is free, or None;
        ``executor`` (tests) replaces the device -> host worker; one job at a time."""
        self.layout, self.host = layout, host
        self._disk = disk
        self.disk = disk.store if disk is not None else None
        self.stats = OffloadStats()
        self._emit = emit
        self._observe = observe
        # Threads start now (their CUDA device and staging with them, not mid-serving).
        self._offload = executor or LaneExecutor("kvbm-offload", layout.worker_init())
        self._offload_stream = layout.new_stream()
        self._writer_stream = layout.new_stream() if disk is not None else None
        self._jobs: deque[_Job] = deque()  # device -> lower tier, in submission order
        self._tickets = itertools.count(1)
        self._parts: dict[int, list] = {}  # ticket -> [jobs left, every page held]
        self._queued: list[tuple] = []  # device -> host copies of this step, handed over by flush()
        self._done: list[tuple[int, bool]] = []
        self._generation = 0

    def _removed(self, tier: TierInfo, metas: Sequence[Page]) -> None:
        if metas:
            self._emit(TierEvent(TierEventKind.REMOVED, tier.name, tuple(metas), None, tier.medium))

    def store(self, request: StoreRequest) -> int:
        ticket = next(self._tickets)
        self._parts[ticket] = [0, True]
        ids = request.block_ids
        host, disk = self.host, self.disk
        if host is not None:  # positions not held (nor on their way) where the pages go first, and their rows
            todo, rows, evicted = host.reserve_missing(ids)
            self._removed(HOST, evicted)
            if rows:
                positions, todo = todo[: len(rows)], todo[len(rows) :]
                future: Future = Future()
                self._queued.append((future, request, positions, rows, self._generation))
                self._submit(_Job(ticket, HOST, rows, self._generation, future))
        else:
            todo = disk.missing(ids)
        if todo and disk is not None:
            if host is not None:
                todo = list(map(todo.__getitem__, disk.missing(list(map(ids.__getitem__, todo)))))
            reserved, evicted = disk.reserve(list(map(ids.__getitem__, todo)))
            self._removed(DISK, evicted)
            if reserved:
                positions, todo = todo[: len(reserved)], todo[len(reserved) :]
                future = self._disk.writer.submit_urgent(
                    copies.device_to_disk, self.layout, self._writer_stream, disk, request, positions, reserved
                )
                self._submit(_Job(ticket, DISK, reserved, self._generation, future))
        if todo:
            self.stats.blocks_not_stored_no_room += len(todo)
            self._parts[ticket][1] = False
        if not self._parts[ticket][0]:
            self._done.append((ticket, self._parts.pop(ticket)[1]))
        return ticket

    def flush(self) -> None:
        """Hand this step's device -> host copies to their thread, as one job (once per step: ``poll``)."""
        if not self._queued:
            return
        parts = []
        for future, request, positions, rows, generation in self._queued:
            if generation != self._generation:  # the tiers were reset or dropped since: nothing to copy
                future.cancel()
            else:
                parts.append((future, request, positions, rows))
        self._queued = []
        if not parts:
            return
        try:
            batch = self._offload.submit(copies.device_to_host_parts, self.layout, self._offload_stream, parts,
                                         self.host.slab)
        except RuntimeError as exc:  # shut down: nothing will copy them
            for future, *_ in parts:
                future.set_exception(exc)
            return
        batch.add_done_callback(lambda done: _cancel_parts(done, parts))

    def _submit(self, job: _Job) -> None:
        self._jobs.append(job)
        self._parts[job.ticket][0] += 1
        self.stats.stores_submitted += 1

    def collect(self) -> list[tuple[int, bool]]:
        """Finished offload tickets, in order, after registering what their copies wrote."""
        while self._jobs and self._jobs[0].future.done():
            job = self._jobs.popleft()
            held = self._finish_store(job)
            part = self._parts.get(job.ticket)
            if part is not None:
                part[0] -= 1
                part[1] = part[1] and held
                if not part[0]:
                    del self._parts[job.ticket]
                    self._done.append((job.ticket, part[1]))
        done, self._done = self._done, []
        return done

    def _finish_store(self, job: _Job) -> bool:
        """Register what a device -> host/disk copy wrote; True when all of its pages are held now."""
        error = _error_of(job.future)
        pool = self.host if job.target is HOST else self.disk
        if job.generation != self._generation or error is not None:
            if error is not None and error is not _CANCELLED:
                logger.error("kvbm: device->%s copy of %d blocks failed: %r", job.target.name, len(job.slots), error)
                self.stats.store_failures += 1
            self._abort(job)
            return False
        result = job.future.result()
        metas, seconds = result[0], result[-1]
        reachable = self.reachable(metas)
        if reachable < len(metas):  # a page whose parent is held nowhere below could never be hit
            self.stats.blocks_dropped_unreachable += len(metas) - reachable
        keep = metas[:reachable]  # device -> host: a tuple (``copies``), so all of it is the same tuple, not a copy
        if job.target is HOST:
            rows = job.slots
            if reachable < len(metas):
                pool.abort(rows[reachable:])
                rows = rows[:reachable]
            pool.commit(keep, rows)
            self._observe("d2h", reachable * self.layout.page_bytes, seconds)
            self._emit(TierEvent(TierEventKind.STORED, HOST.name, tuple(keep), DEVICE.name, HOST.medium))
        else:
            headers = result[1]
            self.disk.abort(job.slots[reachable:])
            registered = self.disk.commit(job.slots[:reachable], headers[:reachable])
            self._observe("d2d", reachable * self.disk.slot_bytes, seconds)
            self._emit(TierEvent(TierEventKind.STORED, DISK.name, tuple(registered), DEVICE.name, DISK.medium))
            reachable = len(registered)
        return reachable == len(metas)

    def reachable(self, metas: Sequence[Page]) -> int:
        """How many leading pages have their parent in this copy (among ``metas``) or held below (registered or on
        its way).

        Only pages whose parent is not the page before them (``unchained``: usually the first alone) are looked
        up; finding those is one C call, with no id read."""
        host, disk = self.host, self.disk
        copied = None
        for i in unchained(metas):
            parent = metas[i].parent_id
            if parent is None or (host is not None and host.holds(parent)) or (disk is not None and disk.holds(parent)):
                continue
            if copied is None:
                copied = {meta.block_id for meta in metas}
            if parent not in copied:
                return i
        return len(metas)

    def _abort(self, job: _Job) -> None:
        (self.host if job.target is HOST else self.disk).abort(job.slots)

    @property
    def generation(self) -> int:
        return self._generation

    def futures(self) -> list[Future]:
        """The copies under way (this step's device -> host copies are handed over first)."""
        self.flush()
        return [job.future for job in self._jobs]

    def reset(self, *, keep_tickets: bool = False) -> None:
        """A new generation: copies in flight register nothing when they end.

        ``keep_tickets``: the tree still waits for the offloads in flight (the
        tiers were dropped, the tree was not reset); they complete as not held.
        Otherwise their tickets are forgotten with the tree's pending offloads.
        """
        self._generation += 1
        if not keep_tickets:
            self._parts.clear()
            self._done.clear()

    def shutdown(self) -> None:
        for future, *_ in self._queued:
            future.cancel()
        self._queued.clear()
        self._offload.shutdown(wait=True, cancel_futures=True)


def _cancel_parts(batch: Future, parts: list) -> None:
    """A batch cancelled before it ran (shutdown): its parts are cancelled with it."""
    if batch.cancelled():
        for future, *_ in parts:
            future.cancel()


def _error_of(future: Future) -> Optional[BaseException]:
    if future.cancelled():
        return _CANCELLED
    return future.exception()


_CANCELLED = RuntimeError("cancelled at shutdown")
