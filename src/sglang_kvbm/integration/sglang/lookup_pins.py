"""Pins taken at lookup, for an SGLang whose ``load`` cannot be refused (0.5.21).

SGLang 0.5.21 raises when a linker's ``load`` answers False, and inserts the
loaded tail into its tree before the copy. So there a load must never be asked
for what cannot be served: ``lookup`` pins what it reports (every block, or the
longest leading run it can pin: the host-resident one when a read below host
has not landed), and reports only that. SGLang intersects the
answers across attention ranks (MIN), so every rank loads at most what it
pinned itself, and ``load`` always succeeds. Its keys are those pages, or the
subset of them the tree adopted (pages another insert added meanwhile are
left out): pinned already, so pinning them for the load cannot miss.

No lookup waits for a read (``defer_reads``). A lookup whose blocks below host
are still being read (disk or a remote tier: ``reads_in_flight``) pins nothing,
reports the blocks they will make servable, and marks the request *deferred*:
the tree's ``init_load_back`` then answers None on every rank (``KvbmLinker.
defers_load``), which keeps the request in the waiting queue while the
scheduler runs other batches, and its next lookup finds the blocks staged.
One such wait per request, ending when the reads it waited for land or after
as long as a load would have waited for them (then the request takes what is
servable: its host run).

A pin lives from its lookup to its request's load, to the request's next
lookup (a request that waits is looked up again next round), to its cancel,
or to the batch's start (a request looked up and not admitted). Scheduler
thread only.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from concurrent import futures
from typing import Callable, Optional, Sequence

logger = logging.getLogger(__name__)


class LoadCannotBeServed(RuntimeError):
    """A load asked for blocks its lookup did not pin (a bug: SGLang 0.5.21 cannot be told)."""


MAX_WAITS = 4096  # requests remembered as having waited for reads (their own release forgets them first)


@dataclasses.dataclass
class _Wait:
    """A request's one wait for reads: until they land, or until ``deadline``."""

    deadline: float
    budget: float
    reads: list
    claim: int = 0  # pages reported while it waits
    first: object = None  # its lookup's first key and length: the same tail looked up again
    pages: int = 0


class LookupPins:
    def __init__(self, connector, clock: Callable[[], float] = time.monotonic) -> None:
        self._connector = connector
        self._clock = clock
        self._pins: dict[str, tuple[frozenset, object]] = {}  # rid -> (keys pinned, plan)
        self._deferred: set[str] = set()  # looked up this round with reads in flight: kept waiting
        self._waits: collections.OrderedDict[str, _Wait] = collections.OrderedDict()
        self.deferrals = self.waits_expired = 0
        self.idle_wait_seconds = 0.0  # an idle scheduler's time waiting for those reads (``wait_idle``)

    def __len__(self) -> int:
        return len(self._pins)

    def pin(self, rid: str, keys: Sequence, hit: int) -> int:
        """Pin the first ``hit`` of ``keys`` (those the tiers reported) for ``rid``; how many leading pages are
        (deferred, with reads in flight: the pages those reads make servable, nothing pinned)."""
        self.release(rid)
        hit, deferred = self._defer(rid, keys, hit)
        if deferred:
            return hit
        while hit:
            plan = self._connector.acquire(keys[:hit])
            if plan is not None:
                self._pins[rid] = (frozenset(keys[:hit]), plan)
                return hit
            in_host = self._connector.peek(keys[:hit])[0]  # a read below host missed: host's leading run, if shorter
            hit = in_host if in_host < hit else 0
        return 0

    def _defer(self, rid: str, keys: Sequence, hit: int) -> tuple[int, bool]:
        """``(pages, deferred)``: deferred, the pages its reads in flight will serve (``rid`` marked, kept waiting);
        else the pages servable now (``hit``, and what remote reads staged since the lookup)."""
        claim, reads, budget = self._connector.reads_in_flight(keys, hit)
        if not reads:
            return claim, False
        wait = self._waits.get(rid)
        if wait is None:
            wait = self._waits[rid] = _Wait(self._clock() + budget, budget, reads, claim, keys[0], len(keys))
            while len(self._waits) > MAX_WAITS:
                self._waits.popitem(last=False)
        elif all(read.done() for read in wait.reads):
            return hit, False  # what it waited for landed (a read started since is not waited for)
        if self._clock() >= wait.deadline:
            if wait.reads:
                self.waits_expired += 1
                logger.info("kvbm: request %r waited its %.3f s for reads below host; it takes what is servable",
                            rid, wait.budget)
                wait.reads = []
            return hit, False
        self._deferred.add(rid)
        self.deferrals += 1
        return claim, True

    def waiting(self, rid: str, keys: Sequence) -> int:
        """The pages to report for ``rid``, looked up again (the scheduler's next round: an idle one loops without
        pause) while the reads it waits for are still in flight: its lookup need not run again; 0 when it does not
        wait. Hands the GIL to the threads reading them once (``time.sleep(0)``, no wait when none asks for it)."""
        wait = self._waits.get(rid)
        if (wait is None or not wait.reads or not keys or len(keys) != wait.pages or keys[0] != wait.first
                or self._clock() >= wait.deadline or all(read.done() for read in wait.reads)):
            return 0
        self.unpin(rid)
        self._deferred.add(rid)
        self.deferrals += 1
        time.sleep(0)
        return wait.claim

    def wait_idle(self) -> bool:
        """The scheduler has nothing to run: wait for the first read a deferred request waits for, until the
        earliest such request's wait runs out. False: none waits."""
        reads, deadline = [], None
        for rid in self._deferred:
            wait = self._waits.get(rid)
            if wait is not None and wait.reads:
                reads.extend(read for read in wait.reads if not read.done())
                deadline = wait.deadline if deadline is None else min(deadline, wait.deadline)
        if deadline is None:
            return False
        started = time.perf_counter()
        if reads:
            futures.wait(reads, timeout=max(0.0, deadline - self._clock()), return_when=futures.FIRST_COMPLETED)
        self.idle_wait_seconds += time.perf_counter() - started
        return True

    def mark_deferred(self, rid: str) -> None:
        """``rid`` is kept waiting (some rank's reads are in flight): an idle scheduler waits for them."""
        self._deferred.add(rid)

    def deferred(self, rid: str) -> bool:
        """``rid``'s lookup this round reported reads in flight, pinning nothing: its load must wait."""
        return rid in self._deferred

    def take(self, rid: str, keys: Sequence):
        """The plan for a load of ``keys`` (a subset of what ``rid``'s lookup pinned)."""
        pinned = self._pins.pop(rid, None)
        if pinned is None or not pinned[0].issuperset(keys):
            if pinned is not None:
                self._connector.cancel(pinned[1])
            raise LoadCannotBeServed(
                f"kvbm: request {rid!r} asked to load {len(keys)} pages its lookup did not pin; this SGLang cannot be "
                f"told that a load is refused"
            )
        keys_pinned, plan = pinned
        if len(keys_pinned) == len(keys):
            return plan
        narrower: Optional[object] = self._connector.acquire(list(keys))  # every one is pinned: this cannot miss
        self._connector.cancel(plan)
        if narrower is None:
            raise LoadCannotBeServed(f"kvbm: pages pinned for request {rid!r} could not be pinned again")
        return narrower

    def release(self, rid: str) -> bool:
        self._deferred.discard(rid)
        return self.unpin(rid)

    def unpin(self, rid: str) -> bool:
        """Let ``rid``'s pins go (a request some other rank keeps waiting: it stays deferred here too)."""
        pinned = self._pins.pop(rid, None)
        if pinned is not None:
            self._connector.cancel(pinned[1])
        return pinned is not None

    def forget(self, rid: str) -> bool:
        """``rid`` went away: its pins, and its wait for reads."""
        self._waits.pop(rid, None)
        return self.release(rid)

    def release_all(self) -> None:
        """Requests looked up and not loaded (not admitted this round; they are looked up again)."""
        for _, plan in self._pins.values():
            self._connector.cancel(plan)
        self._pins.clear()
        self._deferred.clear()
