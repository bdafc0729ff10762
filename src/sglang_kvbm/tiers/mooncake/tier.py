"""The ``mooncake`` tier (a Mooncake Store every worker shares) as a :class:`~sglang_kvbm.tiers.lower.LowerTier`.

A remote tier: what it holds is asked of the master on its own thread (every
Mooncake call runs there, a ``LaneExecutor``, lookups' fetches ahead of
writes). A lookup fetches the leading blocks of its tail that Mooncake holds
into staging rows, verified there (``store.MooncakeStore.read``); the write-through
(``writes.MooncakeWrites``) puts every block the host tier registers. It announces
nothing: Dynamo's router learns Mooncake's objects from the master
(``sglang-kvbm mooncake-events``), under the names ``l3_layout`` tells it.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Callable, Optional, Sequence

from sglang_kvbm.core.identity import BlockId, rekeyed
from sglang_kvbm.core.offload_filter import FrequencyFilter
from sglang_kvbm.core.onboard_policy import LinearCostMeter
from sglang_kvbm.core.pages import Page
from sglang_kvbm.core.ports import TierCounts, TierEvent, TierEventKind
from sglang_kvbm.core.tiers import HOST, MOONCAKE
from sglang_kvbm.tiers.lower import Read
from sglang_kvbm.tiers.mooncake.probe import unreachable_endpoints
from sglang_kvbm.tiers.mooncake.writes import MooncakeWrites
from sglang_kvbm.tiers.remote import RemoteReads
from sglang_kvbm.transfer.lanes import LaneExecutor

NAME = MOONCAKE.name


class MooncakeTier:
    name = NAME
    medium = MOONCAKE.medium  # None: Dynamo's router learns these blocks from the master
    indexed = False

    def __init__(self, store, host, generation: Callable[[], int], *,
                 offload_filter: Optional[FrequencyFilter] = None, lane: Optional[LaneExecutor] = None,
                 observe: Callable[[str, int, float], None] = lambda path, nbytes, seconds: None) -> None:
        """``store``: a connected-on-demand ``MooncakeStore``; ``host``: the host tier's pool (written through from)."""
        if host is None:
            raise ValueError("the mooncake tier needs a host tier: it is written through from host rows")
        self.store = store
        self.header_bytes = store.header_bytes
        self.meter = LinearCostMeter()
        self._lane = lane or LaneExecutor("kvbm-g4")
        self.writes = MooncakeWrites(store, host, self._lane, generation, offload_filter=offload_filter)
        # a master lost mid-call takes ~4.5 s to fail one read
        self._reads = RemoteReads(NAME, self._lane, store.header_bytes + store.block_bytes, observe)
        self._emit: Callable[[TierEvent], None] = lambda event: None
        self.staged = 0
        store.start_heartbeat()  # a lost master is noticed in seconds, not by a call that waits out its limit

    @property
    def stats(self) -> dict:
        return {**self.store.stats, "up": not self.store.down, "connected": self.store.connected,
                "write_through": self.writes.written, "staged": self.staged,
                "lookup_hits": self._reads.lookup_hits, "lookup_misses": self._reads.lookup_misses}

    def register_dram(self, tensor) -> None:
        self.store.register_dram(tensor)

    def holds(self, block_id: BlockId) -> bool:
        return self.writes.known(block_id)

    def counts(self) -> Optional[TierCounts]:
        return None  # shared with every worker: what this one holds there is not a count it knows

    def registered_metas(self) -> list[Page]:
        return []

    # -- reads -------------------------------------------------------------------------------

    def start_read(self, block_ids: Sequence[BlockId], slab, headers, rows: Sequence[int], *,
                   urgent: bool = True) -> Optional[Read]:
        if self.stalled():
            return None
        return self._reads.start(self.store, block_ids, slab, headers, rows)

    def finish_read(self, read: Read, block_ids: Sequence[BlockId], current: bool) -> list[Optional[Page]]:
        metas, seconds = self._reads.finish(read, block_ids, current)
        found = [b for b, meta in zip(block_ids, metas) if meta is not None]
        if found:
            self.staged += len(found)
            self.writes.learn(found)  # the write-through need not put them again
        if current and seconds:
            self.meter.record(len(block_ids) * (self.header_bytes + self.store.block_bytes), seconds)
        return metas

    def promote(self, futures: Sequence[Future]) -> None:
        """Lookups' reads are urgent from the start."""

    def ask(self, block_ids: Sequence[BlockId]) -> Optional[list[bool]]:
        """None while not connected or marked down (it asks Mooncake: never on the scheduler thread)."""
        if not self.store.connected or self.store.down:
            return None
        if not block_ids:  # nothing to look up (the nearer tiers hold it all): whether the master answers at all
            settings = self.store.settings
            return None if unreachable_endpoints(settings.master, settings.metadata) else []
        found = self.store.contains(list(block_ids))
        return None if self.store.down else found

    def stalled(self) -> bool:
        """Down (a failed call, for its retry time), or a read has run for over a second."""
        return self.store.down or self._reads.stalled()

    # -- writes ------------------------------------------------------------------------------

    def offer(self, metas: Sequence[Page]) -> None:
        self.writes.offer(metas)

    def bind(self, emit: Callable[[TierEvent], None]) -> None:
        self._emit = emit

    def collect(self) -> None:
        self.writes.collect()
        stored, self.writes.stored = self.writes.stored, []
        if stored:  # counted, not announced (medium None)
            self._emit(TierEvent(TierEventKind.STORED, NAME, tuple(stored), HOST.name))

    def in_flight(self) -> list[Future]:
        return self.writes.futures()

    # -- identity and life ------------------------------------------------------------------

    def rekey(self, how: str) -> None:
        """What this server shares from now on is not what its model files would compute."""
        self.store.rekey(rekeyed(self.store.fingerprint, how))
        self.writes.forget()

    def forget(self) -> None:
        """The tiers were reset: nothing of this worker's changes in the shared store."""

    def drop(self) -> None:
        """Nothing announced to take back: the shared store keeps its objects (a re-key stops reading them)."""

    index = None  # found by reading (``LowerTier.index``)

    def touch(self, block_ids: Sequence[BlockId]) -> None:
        """The shared store evicts by its own rules."""

    def stop(self) -> None:
        """No more writes (retries included), then its thread (queued calls cancelled)."""
        self.writes.close()
        self._lane.shutdown(wait=True, cancel_futures=True)

    def close(self) -> None:
        """The client goes: what this worker lent leaves with it."""
        self.stop()
        self.writes.collect()
        self.store.close()
