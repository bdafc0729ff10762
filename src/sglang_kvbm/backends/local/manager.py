"""The ``local`` block manager: host memory (G2) owned by this library, no CUDA needed.

Stores are copied by one worker thread (on CUDA: on a side stream that waits
for the forward pass), so the scheduler only reserves rows and submits. A
store's blocks become visible when :meth:`LocalBlockManager.poll` sees its copy
finished; a failed copy is dropped unseen. Loads copy on the caller's thread:
the request needs its KV before its forward pass anyway.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections import deque
from concurrent.futures import Executor, Future, ThreadPoolExecutor, wait
from typing import Sequence

from sglang_kvbm.backends.local.host_pool import HostBlockPool, Reserved
from sglang_kvbm.core.identity import BlockId
from sglang_kvbm.core.ports import (
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
class _StoreJob:
    ticket: int
    generation: int
    reserved: tuple[Reserved, ...]
    future: Future


@dataclasses.dataclass
class LocalStats:
    stores_submitted: int = 0
    store_failures: int = 0
    blocks_not_stored_no_room: int = 0
    load_failures: int = 0


class LocalBlockManager:
    """A :class:`~sglang_kvbm.core.ports.BlockManager` over a host slab."""

    def __init__(
        self,
        layout: PagedKvLayout,
        host_blocks: int,
        *,
        pin: bool = False,
        executor: Executor | None = None,
    ) -> None:
        """``executor`` runs the copies in order; the default is one worker thread."""
        if host_blocks <= 0:
            raise ValueError(f"host_blocks must be positive, got {host_blocks}")
        self._layout = layout
        self._host = HostBlockPool(layout.host_slab(host_blocks, pin=pin))
        self._executor = executor or ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvbm-offload")
        self._jobs: deque[_StoreJob] = deque()
        self._events: list[TierEvent] = []
        self._tickets = itertools.count(1)
        self._generation = 0
        self.stats = LocalStats()

    @property
    def host(self) -> HostBlockPool:
        return self._host

    def store(self, pages: Sequence[PageStore]) -> int | None:
        todo = []
        for page in pages:
            if not self._host.holds(page.meta.block_id):
                todo.append(page)
        if not todo:
            return None
        reserved, evicted = self._host.reserve([p.meta for p in todo])
        if evicted:
            self._events.append(TierEvent(TierEventKind.REMOVED, Tier.HOST, tuple(evicted)))
        self.stats.blocks_not_stored_no_room += len(todo) - len(reserved)
        if not reserved:
            return None
        device_pages = [page.device_page for page in todo[: len(reserved)]]
        rows = [row for row, _ in reserved]
        future = self._executor.submit(
            self._layout.save, device_pages, self._host.slab, rows, self._layout.ready_event()
        )
        ticket = next(self._tickets)
        self._jobs.append(_StoreJob(ticket, self._generation, tuple(reserved), future))
        self.stats.stores_submitted += 1
        return ticket

    def lookup(self, block_ids: Sequence[BlockId]) -> int:
        return self._host.lookup(block_ids)

    def load(self, block_ids: Sequence[BlockId], device_pages: Sequence[int]) -> bool:
        rows = self._host.rows_of(block_ids)
        if rows is None:
            return False
        try:
            self._layout.load(rows, self._host.slab, device_pages)
        except Exception:  # the request recomputes; the pages it got are freed by the caller
            logger.exception("kvbm: host->device copy of %d blocks failed", len(block_ids))
            self.stats.load_failures += 1
            return False
        self._host.touch(block_ids)
        return True

    def poll(self) -> PollResult:
        completed: list[int] = []
        while self._jobs and self._jobs[0].future.done():
            job = self._jobs.popleft()
            completed.append(job.ticket)
            error = (
                RuntimeError("cancelled at shutdown") if job.future.cancelled() else job.future.exception()
            )
            if job.generation != self._generation:
                self._host.abort(job.reserved)  # reset while copying: bytes belong to a dropped tree
            elif error is not None:
                logger.error("kvbm: device->host copy of %d blocks failed: %r", len(job.reserved), error)
                self.stats.store_failures += 1
                self._host.abort(job.reserved)
            else:
                metas = self._host.commit(job.reserved)
                self._events.append(TierEvent(TierEventKind.STORED, Tier.HOST, tuple(metas)))
        events, self._events = self._events, []
        return PollResult(tuple(completed), tuple(events))

    def counts(self) -> tuple[TierCounts, ...]:
        return (TierCounts(Tier.HOST, len(self._host), self._host.capacity),)

    def in_flight(self) -> int:
        return len(self._jobs)

    def wait(self, timeout: float | None = None) -> bool:
        _, not_done = wait([job.future for job in self._jobs], timeout=timeout)
        return not not_done

    def reset(self) -> None:
        self._generation += 1
        self._host.forget()
        self._events.clear()

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
        self.poll()
