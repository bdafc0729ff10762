"""The block manager: host memory (G2) and the chain of tiers below it, no CUDA needed.

The facade over the tiers' parts: host rows (``host.pool``), copies down from
the device and their completions (``offloads``), lookups and loads
(``lookups``), verified staging of reads from below (``staging``) and the
lower tiers, each a :class:`~sglang_kvbm.tiers.lower.LowerTier` (``disk``
and the rest of the chain, built from the configuration by ``registry``).
Where a page goes (the scheduler thread only reserves room and submits; the
copies run on workers, see ``transfer.copies``):

* stored from the device: into a host row while rows can be had (least
  recently used host blocks are evicted for it), else straight to disk;
* from host to each lower tier: every block the host tier registers, and every
  host hit, is offered to every lower tier, whose own filter decides (KVBM's
  frequency filter: once it was reused), its host row pinned meanwhile;
* back to the device: host blocks directly, lower tiers' blocks through
  verified staging rows, one layer at a time (``transfer.copies.load_layer``);
  once such a load landed, its staged blocks join the host tier
  (``kept_reads``: the worker that paid for the read holds it).

A block becomes visible (and is announced) in a tier only once its bytes are
completely there and its parent is held somewhere below; :meth:`poll` is
where that happens. Every tier's changes go to one stream, in order.
"""

from __future__ import annotations

import logging
from concurrent.futures import Executor, Future, wait
from typing import Optional, Protocol, Sequence

from sglang_kvbm.base.values import GIB
from sglang_kvbm.core.identity import BlockId
from sglang_kvbm.core.onboard_policy import OnboardPolicy
from sglang_kvbm.core.pages import Page
from sglang_kvbm.core.ports import PollResult, StoreRequest, TierCounts, TierEvent, TierEventKind
from sglang_kvbm.core.tiers import DISK, HOST
from sglang_kvbm.manager.kept_reads import KeptReads
from sglang_kvbm.manager.lookups import PinnedRows, TierReads
from sglang_kvbm.manager.offloads import Offloads
from sglang_kvbm.tiers.host.pool import HostBlockPool
from sglang_kvbm.tiers.lower import LowerTier
from sglang_kvbm.tiers.staging import ReadStaging
from sglang_kvbm.transfer.kv_layout import PagedKvLayout

logger = logging.getLogger(__name__)


class TransferObserver(Protocol):
    def observe(self, path: str, nbytes: int, seconds: float) -> None: ...


class LocalBlockManager:
    """A :class:`~sglang_kvbm.core.ports.BlockManager` over a host slab and a chain of lower tiers."""

    def __init__(
        self,
        layout: PagedKvLayout,
        host_blocks: int,
        *,
        pin: bool = False,
        tiers: Sequence = (),
        policy: Optional[OnboardPolicy] = None,
        observer: Optional[TransferObserver] = None,
        staging_blocks: int = 0,
        executor: Optional[Executor] = None,
        load_timeout: float = 30.0,
        wait_floor: Optional[float] = None,
        keep_reads: bool = True,
    ) -> None:
        """``tiers``: the lower tiers in chain order, or callables that build one from this manager (``registry``);
        ``executor`` (tests) replaces the device -> host worker.

        ``load_timeout`` caps how long a load waits for its own reads (the
        read meter's estimate for them usually ends the wait much sooner); ``wait_floor``
        (seconds) is the least it waits for them (``lookups.WAIT_FLOOR_S`` if None); ``keep_reads``: a landed load's
        blocks from below host join the host tier (``kept_reads``).
        """
        self.layout = layout
        self.host = HostBlockPool(layout.host_slab(host_blocks, pin=pin)) if host_blocks else None
        self.policy = policy
        self.observer = observer
        self._events: list[TierEvent] = []
        self._closed = False
        built = [tier(self) if callable(tier) else tier for tier in tiers]
        self.tiers: dict[str, LowerTier] = {tier.name: tier for tier in built}
        if host_blocks < 0 or (host_blocks == 0 and DISK.name not in self.tiers):
            raise ValueError(f"need a host tier (host_blocks={host_blocks}) or a disk tier")
        for tier in built:
            tier.bind(self._events.append)
        self.offloads = Offloads(layout, self.host, self.tiers.get(DISK.name), self._events.append, self.observe,
                                 executor)
        self.staging: Optional[ReadStaging] = None
        if built:
            blocks = staging_blocks or max(16, min(layout.num_pages, GIB // layout.block_bytes))
            self.staging = ReadStaging(layout, built, blocks)
        self.reads = TierReads(layout, self.host, built, self.staging, policy,
                               self._offer if built else None, load_timeout, self.generation, wait_floor)
        self.kept: Optional[KeptReads] = None
        if keep_reads and self.host is not None and self.staging is not None:
            self.kept = KeptReads(self.host, self.staging, self._events.append, self.observe, self.offloads.reachable,
                                  self.generation)
            self.reads.keep = self.kept.keep

    @property
    def stats(self) -> dict:
        """What the manager itself counts (``/stats`` ``local``): offloads from the device, and loads' waits."""
        reads = self.reads
        kept = self.kept.stats if self.kept is not None else {}
        return {**self.offloads.stats.__dict__, **kept, "load_waits": reads.load_waits,
                "load_waits_expired": reads.load_waits_expired, "remote_waits_expired": reads.remote_waits_expired,
                "read_wait_seconds": reads.wait_seconds}

    def generation(self) -> int:
        """Of the tiers' contents: a reset or drop moves it (writes and reads of an older one register nothing)."""
        return self.offloads.generation

    def tier(self, name: str) -> Optional[LowerTier]:
        return self.tiers.get(name)

    def store(self, request: StoreRequest) -> int:
        return self.offloads.store(request)

    def _offer(self, metas: Sequence[Page]) -> None:
        """Host blocks just registered, or reused by a load: to every lower tier, as its filter decides."""
        for tier in self.tiers.values():
            tier.offer(metas)

    def poll(self) -> PollResult:
        self.offloads.flush()  # the engine polls once per step: this step's copies down start now
        done = self.offloads.collect()
        if self.staging is not None:
            self.staging.collect()
        if self.kept is not None:
            self.kept.collect()
        if self.tiers:
            for event in list(self._events):  # every block the host tier registered is offered below it
                if event.kind is TierEventKind.STORED and event.tier == HOST.name:
                    self._offer(event.blocks)
            for tier in self.tiers.values():
                tier.collect()
        events = tuple(self._events)
        self._events.clear()
        return PollResult(tuple(done), events)

    # -- finding and loading (see ``lookups``) --------------------------------------------

    def peek(self, block_ids: Sequence[BlockId]) -> tuple[int, int]:
        return self.reads.peek(block_ids)

    def lookup(self, block_ids: Sequence[BlockId]) -> tuple[int, dict[str, int]]:
        return self.reads.lookup(block_ids)

    def servable(self, block_ids: Sequence[BlockId]) -> list[bool]:
        return self.reads.servable(block_ids)

    def acquire(self, block_ids: Sequence[BlockId]) -> Optional[PinnedRows]:
        return self.reads.acquire(block_ids)

    def reads_in_flight(self, block_ids: Sequence[BlockId], hit: int) -> tuple[int, list, float]:
        return self.reads.reads_in_flight(block_ids, hit)

    def defer_reads(self) -> None:
        """The caller waits for reads below host itself (``reads_in_flight``), off the scheduler thread: from now
        on lookups and ``acquire`` never wait for one."""
        self.reads.waits = False

    def release(self, plan: PinnedRows, *, reused: bool = True) -> None:
        self.reads.release(plan, reused=reused)

    def load_parts(self, plan: PinnedRows, pages) -> list:
        return self.reads.load_parts(plan, pages)

    # -- the rest of the port --------------------------------------------------------------

    def counts(self) -> tuple[TierCounts, ...]:
        counts = [TierCounts(HOST.name, len(self.host), self.host.capacity)] if self.host is not None else []
        counts += [c for c in (tier.counts() for tier in self.tiers.values()) if c is not None]
        return tuple(counts)

    def in_flight(self) -> list[Future]:
        futures = self.offloads.futures() + (self.staging.in_flight() if self.staging is not None else [])
        if self.kept is not None:
            futures += self.kept.futures()
        for tier in self.tiers.values():
            futures += tier.in_flight()
        return futures

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
        for tier in self.tiers.values():
            tier.forget()
        self._events.clear()

    def drop(self) -> None:
        """Forget every tier's blocks, announcing their removal; offloads in flight still complete (not held)."""
        if self.host is not None:
            metas = self.host.metas()
            if metas:
                self._events.append(TierEvent(TierEventKind.REMOVED, HOST.name, tuple(metas), None, HOST.medium))
        for tier in self.tiers.values():
            tier.drop()
        self.offloads.reset(keep_tickets=True)
        self._forget()

    def _forget(self) -> None:
        if self.host is not None:
            self.host.forget()
        if self.staging is not None:
            self.staging.forget()

    def close(self) -> None:
        """Stop every thread (queued copies are cancelled), collect what ended, close every lower tier."""
        if self._closed:
            return
        self._closed = True
        self.offloads.shutdown()
        if self.kept is not None:
            self.kept.shutdown()
        for tier in self.tiers.values():
            tier.stop()
        self.poll()  # what ended, registered, before the files and clients go
        for tier in self.tiers.values():
            tier.close()

    def observe(self, path: str, nbytes: int, seconds: float) -> None:
        """Report a finished transfer to the metrics (when they are on)."""
        if self.observer is not None and nbytes:
            self.observer.observe(path, nbytes, seconds)
