"""Reading the tiers for a request: what they hold of a prefix, and pinning it for a load.

Scheduler thread only. Membership over a whole prefix is one C-level ``map``
per tier (no Python loop per page); the onboard policy decides whether a span
that only the disk holds is worth reading; disk blocks are read into verified
staging (``staging``) as soon as a lookup finds them, and a load waits
only for its own reads still in flight (moved ahead of other requests'
prefetches), for at most what the read meter expects them to take
(:data:`WAIT_SLACK` times its estimate plus :data:`WAIT_FLOOR_S`, capped by
the load timeout); past that the request recomputes the span.
"""

from __future__ import annotations

import dataclasses
import logging
import operator
from concurrent.futures import wait
from itertools import compress, repeat, takewhile, tee
from typing import Callable, Optional, Sequence

from sglang_kvbm.core.identity import BlockId
from sglang_kvbm.core.tiers import Tier
from sglang_kvbm.transfer.indexes import index

logger = logging.getLogger(__name__)
WAIT_SLACK = 3.0  # a read may take this many times the meter's estimate before the load gives up on it
WAIT_FLOOR_S = 0.05  # and at least this long (thread hand-offs, a disk's jitter)
G4_FIRST_WAIT_S = 0.5  # a G4 fetch before any was timed
_first, _second = operator.itemgetter(0), operator.itemgetter(1)


@dataclasses.dataclass
class LoadPlan:
    """Blocks pinned for one load: host rows, and staging rows holding verified disk blocks."""

    host_ids: list[BlockId]
    host_rows: list[int]
    host_positions: list[int]
    staged_ids: list[BlockId]
    staged_rows: list[int]
    staged_positions: list[int]
    generation: int = 0  # of the tiers it pinned in: after a reset its pins are gone with them

    @property
    def host_blocks(self) -> int:
        return len(self.host_ids)

    @property
    def disk_blocks(self) -> int:
        return len(self.staged_ids)


def _run(flags: list) -> int:
    """Length of the leading run of true flags."""
    try:
        return flags.index(False)
    except ValueError:
        return len(flags)


class TierReads:
    def __init__(self, layout, host, disk, staging, policy, stats, offer_reused: Optional[Callable], load_timeout: float,
                 generation: Callable[[], int], wait_floor: Optional[float] = None):
        """``wait_floor`` (``SGLANG_KVBM_LOAD_WAIT_MS``) replaces :data:`WAIT_FLOOR_S`, and raises
        :data:`G4_FIRST_WAIT_S` to it where it is longer."""
        self._layout = layout
        self._wait_floor = wait_floor
        self._host, self._disk, self._staging = host, disk, staging
        self._policy = policy
        self._stats = stats
        self._offer_reused = offer_reused
        self._load_timeout = load_timeout
        self._generation = generation

    def _flags(self, block_ids: Sequence[BlockId], *, staged: bool) -> tuple[list, list]:
        """Per block: in host (registered), and in host or on disk (registered, or with ``staged``,
        already read into staging: servable, but not a tier, so not announced)."""
        n = len(block_ids)
        host = list(map(self._host.contains, block_ids)) if self._host is not None else [False] * n
        return host, list(self._lower(block_ids, host, staged))

    def _lower(self, block_ids: Sequence[BlockId], host, staged: bool):
        """Lazily, per block: ``host`` or held below (see :meth:`_flags`)."""
        if self._disk is None:  # G4 alone below host: staged G4 blocks are servable
            if not staged or self._staging is None:
                return iter(host)
            return map(operator.or_, host, map(self._staging.pool.contains, block_ids))
        on_disk = map(self._disk.contains, block_ids)
        if staged:
            on_disk = map(operator.or_, on_disk, map(self._staging.pool.contains, block_ids))
        return map(operator.or_, host, on_disk)

    def _leading(self, block_ids: Sequence[BlockId], *, staged: bool) -> list:
        """Host flags of the leading run of servable blocks: lookups stop at the first block held nowhere (C)."""
        host = map(self._host.contains, block_ids) if self._host is not None else repeat(False, len(block_ids))
        host, into_lower = tee(host)
        pairs = takewhile(_second, zip(host, self._lower(block_ids, into_lower, staged)))
        return list(map(_first, pairs))

    def peek(self, block_ids: Sequence[BlockId]) -> tuple[int, int]:
        """What the tiers hold, exactly as their events announced it (no staging)."""
        if not block_ids:
            return 0, 0
        host = self._leading(block_ids, staged=False)
        return _run(host), len(host)

    def servable(self, block_ids: Sequence[BlockId]) -> list[bool]:
        """Per block: servable now (host, disk, or read into staging); changes nothing."""
        return self._flags(block_ids, staged=True)[1] if block_ids else []

    def lookup(self, block_ids: Sequence[BlockId]) -> tuple[int, int]:
        """``(leading blocks servable now, of which in host)``; starts reading the disk-only ones."""
        if not block_ids:
            return 0, 0
        host = self._leading(block_ids, staged=True)  # the lookups stop at the first block held nowhere
        hit = len(host)
        host_run = _run(host)
        disk_only = hit - sum(host)
        if disk_only:
            if disk_only > self._staging.capacity:  # no load can stage more than this at once
                hit, seen = 0, 0
                while hit < len(host) and (seen < self._staging.capacity or host[hit]):
                    seen += not host[hit]
                    hit += 1
                disk_only = seen
            if self._policy is not None and not self._policy.disk_pays(disk_only * self._layout.page_size):
                hit = host_run
                disk_only = 0
        if hit < len(block_ids) and self._staging is not None and self._staging.has_g4:
            hit += self._from_g4(block_ids, hit)
        if self._host is not None:
            self._host.touch(block_ids[:hit])
        if disk_only and self._disk is not None:
            self._disk.touch(block_ids[:hit])
            wanted = [b for b, in_host in zip(block_ids[:hit], host) if not in_host]
            self._staging.prefetch([b for b in wanted if self._disk.registered(b)], keep=wanted)
        return hit, host_run

    def _from_g4(self, block_ids: Sequence[BlockId], hit: int) -> int:
        """How many blocks after ``hit`` G4 serves: fetched into staging now, waited for a bounded time."""
        staging = self._staging
        futures = staging.fetch_g4(block_ids[hit:], keep=block_ids[:hit])
        if futures:
            estimate = staging.g4_meter.estimate(len(block_ids[hit:]) * staging.slot_bytes)
            budget = self._first_g4_wait() if estimate is None else WAIT_SLACK * estimate + self._floor()
            done, _ = wait(futures, timeout=min(budget, self._load_timeout))
            if len(done) < len(futures):
                self._stats.g4_waits_expired += 1
            staging.collect()
        return _run(list(map(staging.pool.contains, block_ids[hit:])))

    def acquire(self, block_ids: Sequence[BlockId]):
        host, staging = self._host, self._staging
        host_rows = host.rows(block_ids) if host is not None else [None] * len(block_ids)
        in_host = list(map(operator.is_not, host_rows, repeat(None)))
        lower = list(compress(block_ids, map(operator.not_, in_host)))
        if lower:
            if staging is None:
                return None
            if self._disk is not None:
                staging.prefetch([b for b in lower if self._disk.registered(b)], keep=lower)
            pending = staging.pending_bytes(lower)
            if pending:
                self._stats.load_waits += 1
                budget = self._wait_budget(pending)
                if not staging.wait(lower, budget):
                    self._stats.load_waits_expired += 1
                    logger.warning("kvbm: this request's disk reads (%d bytes) took over %.3f s; it recomputes them",
                                   pending, budget)
                    return None
            if not all(map(staging.staged, lower)):
                return None
        positions = range(len(block_ids))
        plan = LoadPlan(list(compress(block_ids, in_host)), [], list(compress(positions, in_host)),
                        lower, [], list(compress(positions, map(operator.not_, in_host))), self._generation())
        if plan.host_ids:
            plan.host_rows = host.pin(plan.host_ids)
        if plan.staged_ids:
            plan.staged_rows = staging.pool.pin(plan.staged_ids)
        return plan

    def _wait_budget(self, pending: int) -> float:
        """How long a load may wait for ``pending`` bytes of its own reads (one other job may be running)."""
        meter = self._policy.read if self._policy is not None else self._staging.g4_meter
        estimate = meter.estimate(pending + self._staging.job_blocks * self._staging.slot_bytes)
        if estimate is None:  # the disk's meter is seeded by its probe: this is a G4 read nothing was learnt of yet
            return min(self._load_timeout, self._first_g4_wait())
        return min(self._load_timeout, WAIT_SLACK * estimate + self._floor())

    def _floor(self) -> float:
        return WAIT_FLOOR_S if self._wait_floor is None else self._wait_floor

    def _first_g4_wait(self) -> float:
        return G4_FIRST_WAIT_S if self._wait_floor is None else max(G4_FIRST_WAIT_S, self._wait_floor)

    def release(self, plan: LoadPlan, *, reused: bool = True) -> None:
        """The copies of a load are over: unpin; a host hit is a reuse the disk filter counts.

        A plan of a generation reset since unpins nothing by id (its pins went
        with the tiers; a newer pin of the same block may exist): it only frees
        the rows it kept from reuse.
        """
        host, current = self._host, plan.generation == self._generation()
        if plan.host_ids:
            if current:
                host.unpin(plan.host_ids)
            host.release_orphans(plan.host_rows)
            if current and reused and self._offer_reused is not None:  # a host hit: a use the disk's and G4's
                self._offer_reused(host.metas_of(plan.host_ids))  # frequency filters count
        if plan.staged_ids:
            if current:
                self._staging.pool.unpin(plan.staged_ids)
            self._staging.pool.release_orphans(plan.staged_rows)

    def load_parts(self, plan: LoadPlan, pages) -> list:
        """``(slab, rows, device pages, tier)`` of a plan, for ``copies.load_batch``; ``pages`` per position
        (the loader's stream selects them)."""

        def select(positions):
            if len(positions) == pages.numel():  # the whole load from one tier: positions are 0..n-1
                return pages
            return pages.index_select(0, index(positions, pages.device))

        parts = []
        if plan.host_ids:
            parts.append((self._host.slab, plan.host_rows, select(plan.host_positions), Tier.HOST))
        if plan.staged_ids:
            parts.append((self._staging.pool.slab, plan.staged_rows, select(plan.staged_positions), Tier.DISK))
        return parts
