"""The scheduler-side core: device pages in, blocks and events out.

An engine adapter (the SGLang radix cache) tells the connector four things:
pages were stored in the device pool (:meth:`KvbmConnector.store`), pages left
it (:meth:`~KvbmConnector.evicted`), a prefix is wanted (:meth:`~KvbmConnector.lookup`
then :meth:`~KvbmConnector.load`), and "now is a good time" (:meth:`~KvbmConnector.poll`).
The connector wraps each device page as a :class:`~sglang_kvbm.core.lifecycle.Block`,
hands copies to the block manager, and turns what the lower tiers report into
events on the sink. Everything here runs on the scheduler thread; the block
manager does its copying elsewhere.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable, Optional, Sequence

from sglang_kvbm.core.identity import BlockId
from sglang_kvbm.core.lifecycle import Block
from sglang_kvbm.core.ports import (
    BlockManager,
    BlockMeta,
    EventSink,
    LoadResult,
    PageStore,
    TierCounts,
    TierEventKind,
)
from sglang_kvbm.core.tiers import Tier

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class ConnectorStats:
    """Counts since start (or reset), named after KVBM's metrics where one exists."""

    device_blocks_registered: int = 0
    device_blocks_dropped: int = 0
    offload_blocks_d2h: int = 0  # kvbm_offload_blocks_d2h: device -> host
    offload_blocks_h2d: int = 0  # kvbm_offload_blocks_h2d: host -> disk
    offload_blocks_d2d: int = 0  # kvbm_offload_blocks_d2d: device -> disk
    host_blocks_removed: int = 0
    disk_blocks_removed: int = 0
    lookups: int = 0
    lookup_hit_blocks: int = 0
    requested_blocks: int = 0  # blocks below the device that finished requests wanted
    onboard_blocks_h2d: int = 0  # kvbm_onboard_blocks_h2d: host -> device
    onboard_blocks_d2d: int = 0  # kvbm_onboard_blocks_d2d: disk -> device
    failed_loads: int = 0
    skipped_by_priority: int = 0


class KvbmConnector:
    """Wraps an engine's device pages as blocks over a :class:`BlockManager`."""

    def __init__(
        self,
        manager: BlockManager,
        sink: EventSink,
        *,
        min_offload_priority: int = 0,
    ) -> None:
        self._manager = manager
        self._sink = sink
        self._min_offload_priority = min_offload_priority
        self._device: dict[BlockId, Block] = {}
        # Store ticket -> what releases the device pages it reads.
        self._pending: dict[int, Callable[[], None]] = {}
        self.stats = ConnectorStats()

    @property
    def keeps_token_ids(self) -> bool:
        """Whether the block manager stores pages' token ids (a disk tier announces them after a restart)."""
        return self._manager.keeps_token_ids

    # -- device tier (G1) --------------------------------------------------

    def holds(self, block_id: BlockId) -> bool:
        """Whether a device page with this id is wrapped (i.e. in the device pool)."""
        return block_id in self._device

    def store(
        self,
        pages: Sequence[PageStore],
        *,
        priority: int = 0,
        on_offloaded: Callable[[], None],
    ) -> bool:
        """Wrap newly stored device pages as blocks and start copying them down.

        ``pages`` are in prefix order, each page's parent before it. Returns True
        when a copy is under way: the caller must keep those device pages from
        being freed or overwritten until ``on_offloaded`` is called (from a later
        :meth:`poll`). Returns False when nothing needs the pages.
        """
        new: list[PageStore] = []
        for page in pages:
            if page.meta.block_id in self._device:
                continue
            block = Block(page.meta)
            block.commit()  # the forward pass wrote its KV before the engine stored it
            block.register()
            self._device[page.meta.block_id] = block
            new.append(page)
        self.stats.device_blocks_registered += len(new)
        if not new:
            return False
        if priority < self._min_offload_priority:
            self.stats.skipped_by_priority += len(new)
            return False
        ticket = self._manager.store(new)
        if ticket is None:
            return False
        self._pending[ticket] = on_offloaded
        return True

    def loaded(self, metas: Sequence[BlockMeta]) -> None:
        """Pages just loaded into the device pool from a lower tier: device blocks again, nothing to copy."""
        device = self._device
        for meta in metas:
            if meta.block_id not in device:
                block = Block(meta)
                block.commit()
                block.register()
                device[meta.block_id] = block
        self.stats.device_blocks_registered += len(metas)

    def evicted(self, block_ids: Sequence[BlockId]) -> None:
        """The engine freed these device pages; lower-tier copies stay."""
        for block_id in block_ids:
            block = self._device.pop(block_id, None)
            if block is not None:
                block.drop()
                self.stats.device_blocks_dropped += 1

    # -- lower tiers -------------------------------------------------------

    def lookup(self, block_ids: Sequence[BlockId]) -> int:
        """How many leading blocks of ``block_ids`` the lower tiers can serve now."""
        if not block_ids:
            return 0
        hit = self._manager.lookup(block_ids)
        self.stats.lookups += 1
        self.stats.lookup_hit_blocks += hit
        return hit

    def peek(self, block_ids: Sequence[BlockId]) -> tuple[int, int]:
        """Leading blocks held in host, and in host or disk, right now; changes nothing."""
        return self._manager.peek(block_ids) if block_ids else (0, 0)

    def load(self, block_ids: Sequence[BlockId], device_pages: Sequence[int]) -> Optional[LoadResult]:
        """Copy all these blocks into the device pages, or none (None: recompute)."""
        if len(block_ids) != len(device_pages):
            raise ValueError(f"{len(block_ids)} blocks for {len(device_pages)} device pages")
        result = self._manager.load(block_ids, device_pages)
        if result is not None:
            self.stats.onboard_blocks_h2d += result.host_blocks
            self.stats.onboard_blocks_d2d += result.disk_blocks
            return result
        self.stats.failed_loads += 1
        logger.info("kvbm: load of %d blocks missed; the request recomputes them", len(block_ids))
        return None

    def request_done(self, wanted_blocks: int) -> None:
        """A request finished; it wanted ``wanted_blocks`` blocks beyond its device match (hit-rate denominator)."""
        self.stats.requested_blocks += wanted_blocks

    def counts(self) -> tuple[TierCounts, ...]:
        device = TierCounts(Tier.DEVICE, len(self._device), -1)
        return (device, *self._manager.counts())

    # -- housekeeping ------------------------------------------------------

    def poll(self) -> None:
        """Publish what the lower tiers finished and release device pages they no longer read."""
        result = self._manager.poll()
        stats = self.stats
        for event in result.events:
            n = len(event.blocks)
            if event.kind is TierEventKind.STORED:
                self._sink.stored(event.tier, event.blocks)
                if event.tier is Tier.HOST:
                    stats.offload_blocks_d2h += n
                elif event.source is Tier.HOST:
                    stats.offload_blocks_h2d += n
                elif event.source is Tier.DEVICE:
                    stats.offload_blocks_d2d += n
            else:
                self._sink.removed(event.tier, event.blocks)
                if event.tier is Tier.HOST:
                    stats.host_blocks_removed += n
                else:
                    stats.disk_blocks_removed += n
        for ticket in result.completed:
            release = self._pending.pop(ticket, None)
            if release is not None:
                release()

    def has_pending(self) -> bool:
        return bool(self._pending)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until no copy is under way (including the ones finishing copies start), polling.

        For shutdown, tests and tools; never on the scheduler's hot path.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            done = self._manager.wait(left)
            self.poll()
            if not done:
                return False
            if self._manager.wait(0) and not self._manager.in_flight():
                return True

    def reset(self) -> None:
        """Forget the device pool and every lower tier (the engine cleared its cache).

        Pending releases are dropped, not called: they belong to the tree the
        engine just threw away, and its pages were freed with it.
        """
        for block in self._device.values():
            block.drop()
        self._device.clear()
        self._pending.clear()
        self._manager.reset()

    def close(self) -> None:
        self._manager.close()
