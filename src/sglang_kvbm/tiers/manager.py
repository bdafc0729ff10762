"""The ``local`` block manager: host memory (G2) and local disk (G3), no CUDA needed.

The facade over the tiers' parts: host rows (``host.pool``), copies down and
their completions (``offloads``), lookups and loads (``lookups``), verified
disk-read staging (``staging``) and the disk tier (``disk``). Where a page
goes (the scheduler thread only reserves room and submits; the copies run on
workers, see ``copies``):

* stored from the device: into a host row while rows can be had (least
  recently used host blocks are evicted for it), else straight to disk;
* from host to disk: once KVBM's frequency filter says the block was reused
  (or always, with the filter off), the host row pinned meanwhile;
* back to the device: host blocks directly, disk blocks through verified
  staging rows (``staging``), one layer at a time (``copies.load_layer``).

A block becomes visible (and is announced) in a tier only once its bytes are
completely there and its parent is held somewhere below; :meth:`poll` is
where that happens.
"""

from __future__ import annotations

import logging
from concurrent.futures import Executor, Future, wait
from typing import Optional, Protocol, Sequence

from sglang_kvbm.core.identity import BlockId
from sglang_kvbm.core.offload_filter import FrequencyFilter
from sglang_kvbm.core.onboard_policy import OnboardPolicy
from sglang_kvbm.core.ports import BlockMeta, PollResult, StoreRequest, TierCounts, TierEvent, TierEventKind
from sglang_kvbm.core.tiers import Tier
from sglang_kvbm.tiers.host.pool import HostBlockPool
from sglang_kvbm.tiers.lookups import LoadPlan, TierReads
from sglang_kvbm.tiers.mooncake.writes import G4Writes
from sglang_kvbm.tiers.offloads import LocalStats, Offloads
from sglang_kvbm.tiers.staging import ReadStaging
from sglang_kvbm.transfer.kv_layout import PagedKvLayout
from sglang_kvbm.transfer.lanes import LaneExecutor

logger = logging.getLogger(__name__)
GIB = 1 << 30


class TransferObserver(Protocol):
    def observe(self, path: str, nbytes: int, seconds: float) -> None: ...


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
        writer: Optional[LaneExecutor] = None,
        reader: Optional[LaneExecutor] = None,
        load_timeout: float = 30.0,
        wait_floor: Optional[float] = None,
        g4=None,
        g4_filter: Optional[FrequencyFilter] = None,
    ) -> None:
        """``executor``, ``writer`` and ``reader`` (tests) replace the device -> host worker and the disk threads.

        ``load_timeout`` caps how long a load waits for its own disk reads (the
        read meter's estimate for them usually ends the wait much sooner); ``wait_floor``
        (seconds) is the least it waits for them (``lookups.WAIT_FLOOR_S`` if None).
        """
        if host_blocks < 0 or (host_blocks == 0 and disk is None):
            raise ValueError(f"need a host tier (host_blocks={host_blocks}) or a disk tier")
        self.layout = layout
        self.host = HostBlockPool(layout.host_slab(host_blocks, pin=pin)) if host_blocks else None
        self.disk = disk
        self.policy = policy
        self.observer = observer
        self.stats = LocalStats()
        self._events: list[TierEvent] = []
        self._closed = False
        self.offloads = Offloads(layout, self.host, disk, offload_filter, self.stats, self._events.append,
                                 self.observe, executor, writer)
        self._reader = None
        self.staging: Optional[ReadStaging] = None
        self.g4, self.g4_writes, self._g4_lane = g4, None, None
        if g4 is not None:  # the shared tier (a G4Store): written through from host rows, fetched into staging
            if self.host is None:
                raise ValueError("G4 needs a host tier: it is written through from host rows")
            self._g4_lane = LaneExecutor("kvbm-g4")  # every Mooncake call: lookups' fetches ahead of writes
            self.g4_writes = G4Writes(g4, self.host, self._g4_lane, lambda: self.offloads.generation,
                                      offload_filter=g4_filter)
        if disk is not None or g4 is not None:
            self._reader = reader or LaneExecutor("kvbm-disk-read")
            if disk is not None and self.host is not None:
                disk.register_dram(self.host.slab)
            on_read = policy.read.record if policy is not None else (lambda nbytes, seconds: None)
            blocks = staging_blocks or max(16, min(layout.num_pages, GIB // layout.block_bytes))
            self.staging = ReadStaging(layout, disk, blocks, self._reader, self._removed, self.observe, on_read,
                                       g4=g4, g4_executor=self._g4_lane,
                                       g4_found=self.g4_writes.learn if g4 is not None else lambda ids: None)
        self.reads = TierReads(layout, self.host, disk, self.staging, policy, self.stats,
                               self._offer_reused if disk is not None or g4 is not None else None, load_timeout,
                               lambda: self.offloads.generation, wait_floor)
        if disk is not None and len(disk):
            self._announce_restored(disk.registered_metas())

    def store(self, request: StoreRequest) -> int:
        return self.offloads.store(request)

    def _offer_reused(self, metas: Sequence[BlockMeta]) -> None:
        """Host blocks a load just reused: to disk and G4, as their filters decide."""
        if self.disk is not None:
            self.offloads.offer_to_disk(metas)
        if self.g4_writes is not None:
            self.g4_writes.offer(metas)

    def poll(self) -> PollResult:
        done = self.offloads.collect()
        if self.staging is not None:
            self.staging.collect()
        if self.g4_writes is not None:  # G4 is written through from every block the host tier registered
            self.g4_writes.collect()
            for event in self._events:
                if event.kind is TierEventKind.STORED and event.tier is Tier.HOST:
                    self.g4_writes.offer(event.blocks)
        if self.disk is not None:
            self._removed(Tier.DISK, self.disk.take_retired())
            self.disk.persist()
            self._announce_restored(self.disk.take_restored())  # blocks a rebuilt index kept (disk/rebuild.py)
        events = tuple(self._events)
        self._events.clear()
        return PollResult(tuple(done), events)

    # -- finding and loading (see ``lookups``) --------------------------------------------

    def peek(self, block_ids: Sequence[BlockId]) -> tuple[int, int]:
        return self.reads.peek(block_ids)

    def lookup(self, block_ids: Sequence[BlockId]) -> tuple[int, int]:
        return self.reads.lookup(block_ids)

    def servable(self, block_ids: Sequence[BlockId]) -> list[bool]:
        return self.reads.servable(block_ids)

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
        return (self.offloads.futures() + (self.staging.in_flight() if self.staging is not None else [])
                + (self.g4_writes.futures() if self.g4_writes is not None else []))

    def busy(self) -> bool:
        return bool(self.in_flight())

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Wait for the copies submitted so far (not for those their completion starts); False on timeout."""
        _, not_done = wait(self.in_flight(), timeout=timeout)
        return not not_done

    def reset(self) -> None:
        """Forget every tier (the engine cleared its cache and announces that itself).

        Copies still in flight (the caller quiesces first; this holds even if
        it could not) register nothing and touch no block of the new generation.
        """
        self.offloads.reset()
        self._forget()
        self._events.clear()

    def drop(self) -> None:
        """Forget every tier's blocks, announcing their removal; offloads in flight still complete (not held)."""
        if self.host is not None:
            self._removed(Tier.HOST, self.host.metas())
        if self.disk is not None:
            self._removed(Tier.DISK, self.disk.registered_metas())
        self.offloads.reset(keep_tickets=True)
        self._forget()

    def _forget(self) -> None:
        if self.host is not None:
            self.host.forget()
        if self.staging is not None:
            self.staging.forget()
        if self.disk is not None:
            self.disk.forget()

    def close(self) -> None:
        """Stop every thread (queued copies are cancelled), collect what ended, close the disk tier and G4's client."""
        if self._closed:
            return
        self._closed = True
        if self.g4_writes is not None:
            self.g4_writes.close()  # nothing more goes to the G4 thread, retries included
        self.offloads.shutdown()
        for lane in (self._reader, self._g4_lane):
            if lane is not None:
                lane.shutdown(wait=True, cancel_futures=True)
        self.poll()
        if self.disk is not None:
            self.disk.close()
        if self.g4 is not None:  # after its thread: no call is under way; what this worker lent leaves with it
            self.g4.close()

    def observe(self, path: str, nbytes: int, seconds: float) -> None:
        """Report a finished transfer to the metrics (when they are on)."""
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
