"""Reading the tiers for a request: what the chain holds of a prefix, and pinning it for a load.

Scheduler thread only. The chain is host, then the lower tiers in order
(``tiers.registry``). Which of host, the indexed tiers and staging hold each
block of a prefix is one call into their compiled indexes (``held_by``), up to
the first block none holds (no Python loop per page); the onboard policy decides whether a
span that only lower tiers hold is worth reading; indexed tiers' blocks are read
into verified staging (``staging``) as soon as a lookup finds them; what the
nearer tiers cannot serve is fetched from each remote tier in turn, waited for
a bounded time. A load waits only for its own reads still in flight (moved
ahead of other requests' prefetches), for at most what the tier's read meter
expects them to take (:data:`WAIT_SLACK` times its estimate plus
:data:`WAIT_FLOOR_S`, capped by the load timeout); past that the request
recomputes the span.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import operator
import time
from concurrent.futures import wait
from itertools import compress, repeat
from typing import Callable, Optional, Sequence

from sglang_kvbm._blocks import held_by
from sglang_kvbm.core.identity import BlockId
from sglang_kvbm.core.tiers import HOST
from sglang_kvbm.transfer.indexes import index

logger = logging.getLogger(__name__)
WAIT_SLACK = 3.0  # a read may take this many times the meter's estimate before the load gives up on it
WAIT_FLOOR_S = 0.05  # and at least this long (thread hand-offs, a disk's jitter)
FIRST_READ_WAIT_S = 0.5  # a remote tier's read before any was timed
_HOST = bytes(i & 1 for i in range(256))  # ``held_by``'s byte -> 1 where host (the first index) holds the block


@dataclasses.dataclass
class PinnedRows:
    """Blocks pinned for one load: host rows, and staging rows holding verified blocks of the tiers below (this
    manager's :class:`~sglang_kvbm.core.ports.LoadPlan`)."""

    host_ids: Sequence[BlockId]
    host_rows: Sequence[int]  # a pin's array('i')
    host_positions: Sequence[int]  # a range when the whole load is host rows
    staged_ids: list[BlockId]
    staged_rows: Sequence[int]
    staged_positions: list[int]
    staged_from: list[str] = dataclasses.field(default_factory=list)  # per staged block: its tier's name
    generation: int = 0  # of the tiers it pinned in: after a reset its pins are gone with them

    @property
    def by_tier(self) -> dict[str, int]:
        if not self.staged_ids:  # the usual case: host alone
            return {HOST.name: len(self.host_ids)} if self.host_ids else {}
        counts = collections.Counter(self.staged_from)
        if self.host_ids:
            counts[HOST.name] = len(self.host_ids)
        return dict(counts)

    @property
    def blocks(self) -> int:
        return len(self.host_ids) + len(self.staged_ids)

    @property
    def staged_blocks(self) -> int:
        """Blocks read from the tiers below host (SGLang reports them as storage hits)."""
        return len(self.staged_ids)


def _run(flags: bytes) -> int:
    """Length of the leading run of non-zero bytes."""
    end = flags.find(0)
    return len(flags) if end < 0 else end


class TierReads:
    def __init__(self, layout, host, tiers, staging, policy, offer_reused: Optional[Callable], load_timeout: float,
                 generation: Callable[[], int], wait_floor: Optional[float] = None):
        """``tiers``: the lower tiers in chain order; ``wait_floor`` (``SGLANG_KVBM_LOAD_WAIT_MS``) replaces
        :data:`WAIT_FLOOR_S`, and raises :data:`FIRST_READ_WAIT_S` to it where it is longer."""
        self._layout = layout
        self._wait_floor = wait_floor
        self._host, self._staging = host, staging
        self._indexed = [t for t in tiers if t.indexed]
        self._remote = [t for t in tiers if not t.indexed]
        # What ``held_by`` asks, in this order: host's index first (bit 0, when there is a host tier).
        self._chain = ([host.index] if host is not None else []) + [t.index for t in self._indexed]
        self._with_staging = self._chain + ([staging.pool.index] if staging is not None else [])
        self._policy = policy
        self._offer_reused = offer_reused
        self._load_timeout = load_timeout
        self._generation = generation
        self.keep: Optional[Callable] = None  # (staged ids, their tiers): a landed load's reads kept in host
        # False where the caller waits for reads itself, off the scheduler thread (``reads_in_flight``; SGLang
        # 0.5.21: a request is kept in the queue): lookups start remote reads without waiting for them, and
        # ``acquire`` misses rather than wait for a read in flight.
        self.waits = True
        self.load_waits = self.load_waits_expired = self.remote_waits_expired = 0
        self.wait_seconds = 0.0  # the scheduler thread's time waiting for reads (lookups' remote reads, loads')

    def _held(self, block_ids: Sequence[BlockId], *, staged: bool, touch: bool = False) -> tuple[int, bytes]:
        """``(leading blocks servable, 1/0 per one of them: in host)``; servable: in host, an indexed tier or (with
        ``staged``) read into staging already (servable, but not a tier, so not announced). One call: C++;
        ``touch``: host's blocks of that run are made most recently used in it."""
        mask = held_by(block_ids, self._with_staging if staged else self._chain, touch and self._host is not None)
        return len(mask), (mask.translate(_HOST) if self._host is not None else bytes(len(mask)))

    def peek(self, block_ids: Sequence[BlockId]) -> tuple[int, int]:
        """What host and the indexed tiers hold, exactly as their events announced it (no staging)."""
        if not block_ids:
            return 0, 0
        hit, host = self._held(block_ids, staged=False)
        return _run(host), hit

    def servable(self, block_ids: Sequence[BlockId]) -> list[bool]:
        """Per block: servable now (host, an indexed tier, or read into staging); changes nothing."""
        if not block_ids:
            return []
        flags = [index.flags(block_ids) for index in self._with_staging]
        return [any(f) for f in zip(*flags)] if flags else [False] * len(block_ids)

    def lookup(self, block_ids: Sequence[BlockId]) -> tuple[int, dict[str, int]]:
        """``(leading blocks servable now, how many of them each tier serves)``; starts reading those below host."""
        if not block_ids:
            return 0, {}
        # The lookups stop at the first block held nowhere; host's blocks of the run found are touched (those of a
        # run cut short below, by the staging room or the onboard policy, too: a prefix a request asked for).
        hit, host = self._held(block_ids, staged=True, touch=True)
        host_run = _run(host)
        below = hit - host.count(1)
        if below:
            if below > self._staging.capacity:  # no load can stage more than this at once
                hit, seen = 0, 0
                while hit < len(host) and (seen < self._staging.capacity or host[hit]):
                    seen += not host[hit]
                    hit += 1
                below = seen
            if self._policy is not None and not self._policy.disk_pays(below * self._layout.page_size):
                hit, below = host_run, 0
        found = {HOST.name: hit - below} if hit - below else {}  # a plain dict: the usual case is host alone
        if below:
            wanted = list(compress(block_ids[:hit], map(operator.not_, host)))
            sources = collections.Counter(map(self._staging.source.get, wanted))  # staged ones: their tier's name
            if sources[None] and self._indexed:  # in an indexed tier, not staged: read now, named after the first tier holding it
                name = self._indexed[0].name
                found[name] = found.get(name, 0) + sources.pop(None)
            for name, n in sources.items():
                found[name] = found.get(name, 0) + n
            for tier in self._indexed:
                tier.touch(block_ids[:hit])
                self._staging.prefetch(tier, [b for b in wanted if tier.holds(b)], keep=wanted)
        for tier in self._remote:
            if hit == len(block_ids):
                break
            run = self._fetch(tier, block_ids, hit)
            if run:
                found[tier.name] = found.get(tier.name, 0) + run
                hit += run
        return hit, found

    def _fetch(self, tier, block_ids: Sequence[BlockId], hit: int) -> int:
        """How many blocks after ``hit`` a remote tier serves: read into staging now, waited for a bounded time
        (unless the caller defers the request instead: ``waits``)."""
        staging = self._staging
        futures = staging.fetch(tier, block_ids[hit:], keep=block_ids[:hit])
        if futures and self.waits:
            estimate = tier.meter.estimate(len(block_ids[hit:]) * staging.slot_bytes)
            budget = self._first_read_wait() if estimate is None else WAIT_SLACK * estimate + self._floor()
            started = time.perf_counter()
            done, _ = wait(futures, timeout=min(budget, self._load_timeout))
            self.wait_seconds += time.perf_counter() - started
            if len(done) < len(futures):
                self.remote_waits_expired += 1
        staging.collect()  # reads that landed since the step's poll (``defer_reads``: a request that waited for them)
        return staging.pool.index.run(block_ids[hit:])

    def acquire(self, block_ids: Sequence[BlockId]) -> Optional[PinnedRows]:
        host, staging = self._host, self._staging
        if host is not None:  # the usual case first: every block in host, pinned in one call (or none is)
            try:
                rows = host.pin(block_ids)
            except KeyError:
                pass
            else:
                # the caller's ids, not copied: the tree builds a transfer's keys per call and never changes them
                return PinnedRows(block_ids, rows, range(len(block_ids)), [], [], [], [], self._generation())
        host_rows = host.rows(block_ids) if host is not None else [None] * len(block_ids)
        in_host = list(map(operator.is_not, host_rows, repeat(None)))
        lower = list(compress(block_ids, map(operator.not_, in_host)))
        if lower:
            if staging is None:
                return None
            for tier in self._indexed:
                staging.prefetch(tier, [b for b in lower if tier.holds(b)], keep=lower)
            if not self.waits:
                staging.collect()  # reads that landed since the step's poll
            pending = staging.pending_bytes(lower)
            if pending and not self.waits:
                return None
            if pending:
                self.load_waits += 1
                budget = self._wait_budget(pending, staging.pending_tiers(lower))
                started = time.perf_counter()
                landed = staging.wait(lower, budget)
                self.wait_seconds += time.perf_counter() - started
                if not landed:
                    self.load_waits_expired += 1
                    logger.warning("kvbm: this request's reads below host (%d bytes) took over %.3f s; it recomputes "
                                   "them", pending, budget)
                    return None
            if not all(map(staging.staged, lower)):
                return None
        positions = range(len(block_ids))
        plan = PinnedRows(list(compress(block_ids, in_host)), [], list(compress(positions, in_host)),
                        lower, [], list(compress(positions, map(operator.not_, in_host))),
                        list(map(staging.source.__getitem__, lower)) if lower else [], self._generation())
        if plan.host_ids:
            plan.host_rows = host.pin(plan.host_ids)
        if plan.staged_ids:
            plan.staged_rows = staging.pool.pin(plan.staged_ids)
        return plan

    def reads_in_flight(self, block_ids: Sequence[BlockId], hit: int) -> tuple[int, list, float]:
        """For a lookup that found ``hit`` leading blocks servable: ``(claim, reads, budget)``, the leading blocks
        servable once the reads in flight land (``hit``, and the run after it a remote tier is reading or has
        staged since), the futures of those reads (none: ``claim`` is servable now), and how long a load would wait
        for them."""
        staging = self._staging
        if staging is None or (not staging.busy() and hit == len(block_ids)):  # the usual case: nothing is read
            return hit, [], 0.0
        staging.collect()
        claim = hit
        while self._remote and claim < len(block_ids) and (staging.reading(block_ids[claim])
                                                           or staging.staged(block_ids[claim])):
            claim += 1  # a remote tier's run (the lookup counts what it has staged so far; the onboard policy's cut
            # of an indexed tier's run is left as it is)
        reading = list(compress(block_ids[:claim], map(staging.reading, block_ids[:claim]))) if staging.busy() else []
        if not reading:
            return claim, [], 0.0
        reads = staging.futures_of(reading, promote=True)  # a request waits for them
        return claim, reads, self._wait_budget(staging.pending_bytes(reading), staging.pending_tiers(reading))

    def _wait_budget(self, pending: int, tiers) -> float:
        """How long a load may wait for ``pending`` bytes of its own reads (one other job may be running)."""
        budget = 0.0
        for tier in tiers:
            estimate = tier.meter.estimate(pending + self._staging.job_blocks * self._staging.slot_bytes)
            # the disk's meter is seeded by its probe; a remote tier's knows nothing before its first read
            budget = max(budget, self._first_read_wait() if estimate is None else WAIT_SLACK * estimate + self._floor())
        return min(self._load_timeout, budget or self._floor())

    def _floor(self) -> float:
        return WAIT_FLOOR_S if self._wait_floor is None else self._wait_floor

    def _first_read_wait(self) -> float:
        return FIRST_READ_WAIT_S if self._wait_floor is None else max(FIRST_READ_WAIT_S, self._wait_floor)

    def release(self, plan: PinnedRows, *, reused: bool = True) -> None:
        """The copies of a load are over: unpin; a host hit is a reuse the lower tiers' filters count, and a
        landed (``reused``) load's staged blocks are kept in host (``keep``, ``kept_reads``) before they are unpinned.

        A plan of a generation reset since unpins nothing by id (its pins went
        with the tiers; a newer pin of the same block may exist): it only frees
        the rows it kept from reuse.
        """
        host, current = self._host, plan.generation == self._generation()
        if plan.host_ids:
            if current:
                host.unpin_rows(plan.host_rows)
            host.release_orphans(plan.host_rows)
            if current and reused and self._offer_reused is not None:
                self._offer_reused(host.metas_of(plan.host_ids))
        if plan.staged_ids:
            if current and reused and self.keep is not None:
                self.keep(plan.staged_ids, plan.staged_from)
            if current:
                self._staging.pool.unpin(plan.staged_ids)
            self._staging.pool.release_orphans(plan.staged_rows)

    def load_parts(self, plan: PinnedRows, pages) -> list:
        """``(slab, rows, device pages, source)`` of a plan, for ``copies.load_batch``; ``pages`` per position
        (the loader's stream selects them); ``source`` is ``host`` or ``staging``."""

        def select(positions):
            if len(positions) == pages.numel():  # the whole load from one slab: positions are 0..n-1
                return pages
            return pages.index_select(0, index(positions, pages.device))

        parts = []
        if plan.host_ids:
            parts.append((self._host.slab, plan.host_rows, select(plan.host_positions), HOST.name))
        if plan.staged_ids:
            parts.append((self._staging.pool.slab, plan.staged_rows, select(plan.staged_positions), "staging"))
        return parts
