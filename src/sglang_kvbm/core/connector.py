"""The scheduler-side core: offloads in, completions, loads and events out.

An engine adapter (the SGLang linker) tells the connector four things: device
pages should be kept (:meth:`KvbmConnector.offload`), a prefix is wanted
(:meth:`~KvbmConnector.lookup`, then :meth:`~KvbmConnector.acquire` and
:meth:`~KvbmConnector.release` around the copies), which offloads finished
(:meth:`~KvbmConnector.completed_offloads`), and "now is a good time"
(:meth:`~KvbmConnector.poll`). The block manager does the copying elsewhere
and keeps each tier's blocks through their lifecycle; the connector reports
completions in the order offloads were made, turns what the tiers report into
events on the sink, and counts what KVBM's metrics count. Everything here runs
on the scheduler thread.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from typing import Hashable, Optional, Sequence

from sglang_kvbm.core.hit_rate import DEFAULT_WINDOW, HitRateWindow
from sglang_kvbm.core.identity import BlockId
from sglang_kvbm.core.ports import BlockManager, EventSink, LoadPlan, StoreRequest, TierCounts, TierEventKind
from sglang_kvbm.core.tiers import DEVICE, DISK, HOST

logger = logging.getLogger(__name__)


# KVBM's counter names for the per-tier counts below: (source tier, tier) of an offload, the tier of an onboard.
# (Names of tiers further down belong to them: ``tiers/<name>/kind.py``'s ``metrics``.)
KVBM_OFFLOADS = {(DEVICE.name, HOST.name): "offload_blocks_d2h", (HOST.name, DISK.name): "offload_blocks_h2d",
                 (DEVICE.name, DISK.name): "offload_blocks_d2d"}
KVBM_ONBOARDS = {HOST.name: "onboard_blocks_h2d", DISK.name: "onboard_blocks_d2d"}


@dataclasses.dataclass
class ConnectorStats:
    """Counts since start (or reset), per tier by name; KVBM's counters are views of them (:meth:`as_dict`)."""

    offloads: int = 0
    offloads_failed: int = 0  # completed False: some page is not held below (the engine may offer it again)
    lookups: int = 0
    lookup_hit_blocks: int = 0
    matched_tokens: int = 0  # kvbm_matched_tokens: tokens onboarded instead of recomputed
    failed_loads: int = 0
    skipped_by_priority: int = 0
    offload_blocks: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # "source->tier"
    onboard_blocks: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # tier -> blocks
    removed_blocks: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # tier -> blocks
    hit_blocks: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # tier -> lookup hits

    def offloaded(self, source: str, tier: str) -> int:
        return self.offload_blocks[f"{source}->{tier}"]

    # KVBM's counters, read from the per-tier counts
    offload_blocks_d2h = property(lambda self: self.offloaded(DEVICE.name, HOST.name))
    offload_blocks_h2d = property(lambda self: self.offloaded(HOST.name, DISK.name))
    offload_blocks_d2d = property(lambda self: self.offloaded(DEVICE.name, DISK.name))
    onboard_blocks_h2d = property(lambda self: self.onboard_blocks[HOST.name])
    onboard_blocks_d2d = property(lambda self: self.onboard_blocks[DISK.name])

    def as_dict(self) -> dict:
        """Every count, per tier, and KVBM's names beside them (the snapshot ``/stats`` and the metrics read)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for key in ("offload_blocks", "onboard_blocks", "removed_blocks", "hit_blocks"):
            out[key] = dict(out[key])
        out.update({kvbm: self.offloaded(*path) for path, kvbm in KVBM_OFFLOADS.items()})
        out.update({kvbm: self.onboard_blocks[tier] for tier, kvbm in KVBM_ONBOARDS.items()})
        return out


class KvbmConnector:
    """Drives a :class:`BlockManager` for one engine worker."""

    def __init__(
        self,
        manager: BlockManager,
        sink: EventSink,
        *,
        page_size: int,
        min_offload_priority: int = 0,
        hit_rate_window: int = DEFAULT_WINDOW,
    ) -> None:
        self._manager = manager
        self._sink = sink
        self._page_size = page_size
        self._min_offload_priority = min_offload_priority
        self._tickets: collections.deque[int] = collections.deque()  # in submission order
        self._results: dict[int, bool] = {}
        self.stats = ConnectorStats()
        self.hit_rates = HitRateWindow(hit_rate_window)
        # A snapshot of the counters for other threads (the metrics endpoint), replaced
        # whole by the scheduler thread; readers never see a structure being changed.
        self.published: dict = {}
        self._publish_lock = threading.Lock()

    @property
    def manager(self) -> BlockManager:
        return self._manager

    # -- offload --------------------------------------------------------------

    def offload(self, request: StoreRequest, *, priority: int = 0) -> bool:
        """Start keeping these device pages below; False when not taken (the engine may offer them again).

        When True, the engine keeps the pages unchanged until this offload is
        reported by :meth:`completed_offloads` / :meth:`pop_completed_offload`.
        """
        if priority < self._min_offload_priority:
            self.stats.skipped_by_priority += len(request.block_ids)
            return False
        self._tickets.append(self._manager.store(request))
        self.stats.offloads += 1
        return True

    def completed_offloads(self) -> int:
        """How many of the oldest offloads have finished (polls first)."""
        self.poll()
        done = 0
        for ticket in self._tickets:
            if ticket not in self._results:
                break
            done += 1
        return done

    def pop_completed_offload(self) -> bool:
        """The result of the oldest finished offload: True when every page is held below."""
        ticket = self._tickets.popleft()
        ok = self._results.pop(ticket)
        if not ok:
            self.stats.offloads_failed += 1
        return ok

    def pending_offloads(self) -> int:
        return len(self._tickets)

    # -- lookup and load -------------------------------------------------------

    def lookup(self, request: Hashable, block_ids: Sequence[BlockId]) -> int:
        """How many leading blocks the lower tiers can serve now (records KVBM's hit rates)."""
        if not block_ids:
            return 0
        hit, found = self._manager.lookup(block_ids)
        self.hit_rates.record(request, found, len(block_ids))
        self.stats.lookups += 1
        self.stats.lookup_hit_blocks += hit
        self.stats.hit_blocks.update(found)
        return hit

    def peek(self, block_ids: Sequence[BlockId]) -> tuple[int, int]:
        """Leading blocks held in host, and in host or a tier below it that announces its blocks, right now."""
        return self._manager.peek(block_ids) if block_ids else (0, 0)

    def acquire(self, block_ids: Sequence[BlockId]) -> Optional[LoadPlan]:
        """Pin every block for a load, or none (None: the engine recomputes them)."""
        plan = self._manager.acquire(block_ids)
        if plan is None:
            self.stats.failed_loads += 1
            logger.info("kvbm: load of %d blocks missed; the request recomputes them", len(block_ids))
        return plan

    def reads_in_flight(self, block_ids: Sequence[BlockId], hit: int) -> tuple[int, list, float]:
        """``(claim, reads, budget)``: the leading blocks a lookup that found ``hit`` can serve once the reads in
        flight land, their futures (none: nothing to wait for) and how long a load would wait for them."""
        return self._manager.reads_in_flight(block_ids, hit) if block_ids else (hit, [], 0.0)

    def release(self, plan: LoadPlan, *, landed: bool) -> None:
        """The copies of a load are over; count it if its bytes reached the device."""
        self._manager.release(plan, reused=landed)
        if landed:
            self.stats.onboard_blocks.update(plan.by_tier)
            self.stats.matched_tokens += plan.blocks * self._page_size
        else:
            self.stats.failed_loads += 1

    def refuse(self, plan: LoadPlan, why: str) -> None:
        """A pinned load that cannot run after all (a hybrid model's other pools missed): unpin, count a failed load."""
        self._manager.release(plan, reused=False)
        self.stats.failed_loads += 1
        logger.info("kvbm: load of %d blocks refused (%s); the request recomputes them",
                    plan.blocks, why)

    def cancel(self, plan: LoadPlan) -> None:
        """A load that will not run (its request went away, or the cache was reset): unpin, count nothing."""
        self._manager.release(plan, reused=False)

    def counts(self) -> tuple[TierCounts, ...]:
        return self._manager.counts()

    # -- housekeeping ------------------------------------------------------------

    def poll(self) -> None:
        """Publish what the lower tiers did and collect finished offloads."""
        result = self._manager.poll()
        stats = self.stats
        for event in result.events:
            n = len(event.blocks)
            if event.kind is TierEventKind.STORED:
                if event.medium is not None:
                    self._sink.stored(event.medium, event.blocks)
                stats.offload_blocks[f"{event.source}->{event.tier}"] += n
            else:
                if event.medium is not None:
                    self._sink.removed(event.medium, event.blocks)
                stats.removed_blocks[event.tier] += n
        for ticket, ok in result.completed:
            self._results[ticket] = ok

    def publish(self, extra: dict) -> None:
        """Replace the snapshot other threads read (counters, rates, occupancy, plus ``extra``)."""
        snapshot = {
            "published_at": time.time(),  # so a reader knows how fresh it is
            "connector": self.stats.as_dict(),
            "host_hit_rate": self.hit_rates.host_rate,
            "disk_hit_rate": self.hit_rates.disk_rate,
            "hit_rates": self.hit_rates.rates(),
            "tiers": {c.tier: (c.blocks, c.capacity) for c in self.counts()},
            **extra,
        }
        with self._publish_lock:
            self.published = snapshot

    def snapshot(self) -> dict:
        with self._publish_lock:
            return self.published

    def flush(self, timeout: Optional[float] = None) -> bool:
        """Wait until no copy is under way, including those finished copies start (shutdown, tests, tools)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            done = self._manager.wait(left)
            self.poll()
            if not done:
                return False
            if not self._manager.busy():
                return True

    def reset(self) -> None:
        """Forget every lower tier (the engine cleared its cache). Pending offloads are the engine's to drop."""
        self._manager.reset()
        self._tickets.clear()
        self._results.clear()
        self.hit_rates.clear()

    def close(self) -> None:
        self._manager.close()
