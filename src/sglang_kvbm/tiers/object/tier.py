"""The ``object`` tier (KVBM's G4: object storage) as a :class:`~sglang_kvbm.tiers.lower.LowerTier`.

A remote tier: every worker whose identity matches reads what any of them
wrote to the bucket. As in KVBM, host memory stages every transfer:

* **Writes**: every block the host tier registers (and every host hit of one
  not known to be there) is put from its host row, pinned meanwhile, on the
  tier's thread. A write queued before a reset or a re-key is dropped there
  (its row may be another block's by then; its KV the old weights'). With
  ``DYN_KVBM_OBJECT_WRITE_THROUGH=0`` a block leaves the host tier once it is
  written (with its host removal), as KVBM does.
* **Reads**: a lookup asks the bucket which blocks of its tail exist (one HEAD
  each), reads the leading run of them into staging rows and verifies them
  there; a stopped server, a missing or damaged object is a miss, never a
  stall: the lookup waits a bounded time, and a failure marks the tier down
  for a while.
* **What it knows**: the blocks it wrote or found, at most
  ``DYN_KVBM_OBJECT_NUM_BLOCKS`` (KVBM's registry size), least recently seen
  forgotten first. It announces nothing: no router scores object storage.
"""

from __future__ import annotations

import collections
import logging
from concurrent.futures import Future
from typing import Callable, NamedTuple, Optional, Sequence

from sglang_kvbm.core.identity import BlockId, rekeyed
from sglang_kvbm.core.onboard_policy import LinearCostMeter
from sglang_kvbm.core.pages import Page
from sglang_kvbm.core.ports import TierCounts, TierEvent, TierEventKind
from sglang_kvbm.core.tiers import HOST, OBJECT
from sglang_kvbm.tiers.lower import Read
from sglang_kvbm.tiers.remote import RemoteReads
from sglang_kvbm.transfer.lanes import LaneExecutor

logger = logging.getLogger(__name__)
NAME = OBJECT.name
QUEUE_BYTES = 1 << 30  # host rows pinned for writes waiting on the tier's thread, at most
MISSING, THERE, PUT = range(3)  # a block's fate in a write: not in the bucket, there already, put now


def host_to_object(store, metas, rows, slab, generation: int, current: Callable[[], int], fingerprint: bytes
                   ) -> Optional[list[int]]:
    """On the tier's thread: put the blocks the bucket lacks from their (pinned) host rows; each block's fate.
    None when the tiers were reset or re-keyed since the write was queued."""
    if current() != generation or store.fingerprint != fingerprint:
        return None
    held = store.contains([m.block_id for m in metas])  # another worker of this identity may have put them
    if store.down:
        return [MISSING] * len(metas)
    fates = [THERE if h else MISSING for h in held]
    todo = [i for i, h in enumerate(held) if not h]
    put = store.write([metas[i] for i in todo], [slab[rows[i]] for i in todo], fingerprint) if todo else []
    for i, ok in zip(todo, put):
        fates[i] = PUT if ok else MISSING
    return fates


class _Write(NamedTuple):
    future: Future
    metas: tuple
    rows: tuple
    generation: int


class ObjectTier:
    name = NAME
    medium = OBJECT.medium  # None: no router scores object storage
    indexed = False

    def __init__(self, store, host, generation: Callable[[], int], *, write_through: bool = True,
                 num_blocks: int = 100_000, lane: Optional[LaneExecutor] = None,
                 observe: Callable[[str, int, float], None] = lambda path, nbytes, seconds: None) -> None:
        if host is None:
            raise ValueError("the object tier needs a host tier: every transfer is staged in host memory")
        self.store = store
        self.header_bytes = store.header_bytes
        self.meter = LinearCostMeter()
        self.write_through = write_through
        self._host = host
        self._generation = generation
        self._lane = lane or LaneExecutor("kvbm-object")
        self._known: collections.OrderedDict = collections.OrderedDict()  # blocks known to be in the bucket
        self._num_blocks = num_blocks
        self._writes: collections.deque[_Write] = collections.deque()
        self._pending: set = set()
        self._queue_blocks = max(1, min(host.capacity // 2, QUEUE_BYTES // store.slot_bytes))
        store.start_heartbeat()  # an endpoint that stops answering is noticed in seconds
        self._reads = RemoteReads(NAME, self._lane, store.slot_bytes, observe)  # a hung server takes 3 s to fail one
        self._emit: Callable[[TierEvent], None] = lambda event: None
        self._closed = False
        self._own = collections.Counter()

    @property
    def stats(self) -> dict:
        return {**self.store.stats, **self._own, "up": not self.store.down, "known": len(self._known),
                "lookup_hits": self._reads.lookup_hits, "lookup_misses": self._reads.lookup_misses,
                "queued": sum(len(w.metas) for w in self._writes)}

    def bind(self, emit: Callable[[TierEvent], None]) -> None:
        self._emit = emit

    def register_dram(self, tensor) -> None:
        """Nothing: its transfers go through its own bounce buffers."""

    def holds(self, block_id: BlockId) -> bool:
        return block_id in self._known

    index = None  # found by reading (``LowerTier.index``)

    def touch(self, block_ids: Sequence[BlockId]) -> None:
        """The bucket keeps what it is given."""

    def _learn(self, block_ids: Sequence[BlockId]) -> None:
        for block_id in block_ids:
            self._known[block_id] = None
            self._known.move_to_end(block_id)
        while len(self._known) > self._num_blocks:
            self._known.popitem(last=False)

    def counts(self) -> Optional[TierCounts]:
        return TierCounts(NAME, len(self._known), self._num_blocks)

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
        self._learn([b for b, meta in zip(block_ids, metas) if meta is not None])
        if current and seconds:
            self.meter.record(len(block_ids) * self.store.slot_bytes, seconds)
        return metas

    def promote(self, futures: Sequence[Future]) -> None:
        """Lookups' reads are urgent from the start."""

    def stalled(self) -> bool:
        """Down (a failed call, for its retry time), or a read has run for over a second."""
        return self.store.down or self._reads.stalled()

    def ask(self, block_ids: Sequence[BlockId]) -> Optional[list[bool]]:
        """Which blocks the bucket holds (on the tier's thread, waited for); None while it is down."""
        if self.store.down:
            return None
        try:  # with nothing to look up (the nearer tiers hold it all), one HEAD says whether the store answers
            asked = list(block_ids) or ["sglang-kvbm-liveness"]
            found = self._lane.submit_urgent(self.store.contains, asked).result(timeout=30)[: len(block_ids)]
        except Exception:
            return None
        return None if self.store.down else found

    # -- writes ------------------------------------------------------------------------------

    def offer(self, metas: Sequence[Page]) -> None:
        """Host blocks just registered or reused: queue those not known to be in the bucket (room permitting)."""
        if self._closed or not metas or self.store.down:
            return
        known, pending, registered = self._known, self._pending, self._host.registered
        todo = [m for m in metas if m.block_id not in known and m.block_id not in pending and registered(m.block_id)]
        room = self._queue_blocks - len(pending)
        if len(todo) > room:
            self._own["write_queue_full"] += len(todo) - max(room, 0)
            todo = todo[: max(room, 0)]
        if not todo:
            return
        ids = tuple(m.block_id for m in todo)
        rows = tuple(self._host.pin(ids))
        generation = self._generation()
        future = self._lane.submit(host_to_object, self.store, todo, rows, self._host.slab, generation,
                                   self._generation, self.store.fingerprint)
        self._writes.append(_Write(future, tuple(todo), rows, generation))
        pending.update(ids)

    def collect(self) -> None:
        while self._writes and self._writes[0].future.done():
            self._finish(self._writes.popleft())

    def _finish(self, write: _Write) -> None:
        ids = [m.block_id for m in write.metas]
        current = write.generation == self._generation()
        if current:
            self._host.unpin(ids)
        self._host.release_orphans(write.rows)
        self._pending.difference_update(ids)
        try:
            result = None if write.future.cancelled() else write.future.result()
        except Exception:
            logger.exception("kvbm: object write of %d blocks failed", len(ids))
            result = None
        if result is None or not current:
            self._own["write_dropped"] += len(ids)
            return
        held = [m for m, fate in zip(write.metas, result) if fate != MISSING]
        put = [m for m, fate in zip(write.metas, result) if fate == PUT]
        self._own["write_failed"] += len(ids) - len(held)
        self._own["already_there"] += len(held) - len(put)
        if not held:
            return
        self._learn([m.block_id for m in held])
        if put:
            self._emit(TierEvent(TierEventKind.STORED, NAME, tuple(put), HOST.name))
        if not self.write_through:  # KVBM's DYN_KVBM_OBJECT_WRITE_THROUGH=0: the host copy goes
            removed = self._host.remove([m.block_id for m in held])
            if removed:
                self._emit(TierEvent(TierEventKind.REMOVED, HOST.name, tuple(removed), None, HOST.medium))

    def in_flight(self) -> list[Future]:
        return [w.future for w in self._writes]

    # -- identity and life ------------------------------------------------------------------

    def rekey(self, how: str) -> None:
        self.store.rekey(rekeyed(self.store.fingerprint, how))
        self._known.clear()

    def forget(self) -> None:
        """The tiers were reset: the bucket keeps its objects, and this worker still knows them."""

    def drop(self) -> None:
        """Nothing announced to take back."""

    def stop(self) -> None:
        self._closed = True
        self._lane.shutdown(wait=True, cancel_futures=True)

    def close(self) -> None:
        self.stop()
        self.collect()
        self.store.close()
