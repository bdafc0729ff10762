"""G4 (a Mooncake Store every worker shares) below the local tiers: write-through and verified fetches.

* **Write-through** (:class:`MooncakeWrites`): every block that becomes registered in
  the host tier is put to G4 from its host row (pinned for the write, which only
  it releases), on the G4 thread, as HiCache's ``write_through`` does for its L3.
  Blocks this worker wrote or read are remembered (a bounded set), so a reused
  prefix is not put again.
* **Only the bytes the name says**: a write is dropped, on the G4 thread right
  before its put, if the tiers were reset or dropped or G4 was re-keyed since it
  was queued (its row may be another block's by then; its KV is the old weights'),
  and it names and signs its objects with the identity it was queued under.
* **Bounded**: at most ``queue_blocks`` blocks wait (about 1 GiB; pinned rows): an
  offer past that is dropped and counted (``write_queue_full``), so a backlog
  never outlasts a quiesce.
* **After faults**: a remembered block offered again (reused) is checked on the G4
  thread when the store failed a call since it was seen there (a master restart
  loses every object, and the first call after one fails) or ``recheck_s`` ago
  (a client lending memory reconnects without a failed call), and written again
  if G4 lost it (``rewritten``). Offers made while G4 is down wait until it is back,
  and a failed write is tried again after ``retry_s``, ``max_tries`` times at most
  (``write_retried``, ``write_gave_up``).
* **Fetches** (``tier.read_into_staging``, run by ``tiers.staging``): the
  leading blocks G4 holds of a lookup's tail are read into staging rows and
  verified there (``store``); from then on they are served like verified disk
  blocks.

Every Mooncake call runs on the G4 thread (a ``LaneExecutor``); the scheduler
thread only submits, polls, and waits a bounded time for a lookup's fetch.
G4 blocks are in no event stream: Dynamo's router learns them from Mooncake.
"""

from __future__ import annotations

import collections
import itertools
import logging
import time
from concurrent.futures import Future
from typing import Callable, NamedTuple, Optional, Sequence

from sglang_kvbm.core.identity import BlockId
from sglang_kvbm.core.pages import Page
from sglang_kvbm.transfer.host_memory import aligned_empty

logger = logging.getLogger(__name__)


HELD, WRITTEN, FAILED, UNTRIED = range(4)  # a block's fate in a G4 write
MAX_TRIES = 3  # failed puts of a block before it is given up
RECHECK_S = 10.0  # a remembered block reused this long after G4 was seen holding it is checked again
QUEUE_BYTES = 1 << 30  # what may wait for the G4 thread (G4 puts run at ~1 GB/s on TCP: seconds, not a minute)


def _host_to_g4(store, metas, rows, recheck, slab, headers, generation: int, current: Callable[[], int],
                fingerprint: bytes) -> Optional[tuple[list[int], float]]:
    """On the G4 thread: put the blocks (``recheck[i]``: only if G4 lost it) under ``fingerprint``.

    None when the tiers were reset or G4 re-keyed since the write was queued (nothing is read or put); else each
    block's fate and the time G4 was seen before the put.
    """
    def stale() -> bool:
        return current() != generation or store.fingerprint != fingerprint

    if stale():
        return None
    when = time.monotonic()
    status = [UNTRIED] * len(metas)
    todo = list(range(len(metas)))
    if recheck and store.available:
        checks = [i for i in todo if recheck[i]]
        for i, held in zip(checks, store.contains([metas[i].block_id for i in checks], fingerprint)):
            status[i] = HELD if held else UNTRIED
        todo = [i for i in todo if status[i] != HELD]
    if not todo or not store.available:
        return status, when
    if stale():  # immediately before the put: the rows are still pinned for this write, whatever happened since
        return None
    ok = store.write([metas[i] for i in todo], [slab[rows[i]] for i in todo], [headers[rows[i]] for i in todo],
                     fingerprint)
    for i, good in zip(todo, ok):
        status[i] = WRITTEN if good else FAILED
    return status, when


class _Write(NamedTuple):
    future: Future
    ids: tuple
    metas: tuple
    rows: tuple
    recheck: tuple  # per block: a remembered one, put only if G4 lost it (empty: none is)
    generation: int
    fingerprint: bytes


class MooncakeWrites:
    def __init__(self, store, host, lane, generation: Callable[[], int], *, remember: int = 0,
                 offload_filter=None, queue_blocks: int = 0, recheck_s: float = RECHECK_S,
                 max_tries: int = MAX_TRIES) -> None:
        """``offload_filter`` (KVBM's ``FrequencyFilter``): write a block only once it was reused, not on its
        first store (its offers: when the host tier registers it, and each host hit). ``generation``: the
        tiers' (a reset or drop moves it); read on the G4 thread too."""
        self.store = store
        self._host = host
        self._lane = lane
        self._generation = generation
        self.headers = aligned_empty((host.capacity, store.header_bytes))  # one per host row: the row's write
        store.register_dram(host.slab)
        store.register_dram(self.headers)
        self._known: collections.OrderedDict = collections.OrderedDict()  # id -> when G4 was last seen holding it
        self._remember = remember or 4 * host.capacity
        self._writes: collections.deque[_Write] = collections.deque()
        self._filter = offload_filter
        self.queue_blocks = queue_blocks or min(host.capacity, max(64, min(host.capacity // 2,
                                                                           QUEUE_BYTES // store.block_bytes)))
        self.recheck_s, self.max_tries = recheck_s, max_tries
        self._pending: set = set()  # ids queued (their rows pinned)
        self._retry: collections.OrderedDict = collections.OrderedDict()  # id -> failed puts so far
        self._tries: dict = {}  # id queued again from _retry -> failed puts so far
        self._retry_at = 0.0  # failed puts are tried again from then on
        self._closed = False
        self.stats = store.stats  # the write-through's counters live beside the store's (``/stats``: mooncake)
        self.submitted = self.written = self.queued = 0  # blocks queued ever, written, waiting now
        self.stored: list[Page] = []  # blocks written since the tier last took them (its STORED changes)

    def forget(self) -> None:
        """G4's objects are under another name now (the identity changed): nothing is known to be there."""
        self._known.clear()
        self._retry.clear()
        self._tries.clear()

    def close(self) -> None:
        """No more writes (the G4 thread is going away)."""
        self._closed = True

    def known(self, block_id: BlockId) -> bool:
        return block_id in self._known

    def learn(self, block_ids: Sequence[BlockId], when: Optional[float] = None) -> None:
        when = time.monotonic() if when is None else when
        for block_id in block_ids:
            self._known[block_id] = when
            self._known.move_to_end(block_id)
        while len(self._known) > self._remember:
            self._known.popitem(last=False)

    def offer(self, metas: Sequence[Page]) -> None:
        """Host blocks just registered or reused: queue those G4 may not hold (kept for later while G4 is down)."""
        if self._closed or not metas:
            return
        cutoff = max(self.store.last_fault, time.monotonic() - self.recheck_s)
        known, pending, registered = self._known.get, self._pending, self._host.registered
        fresh, recheck = [], []
        for meta in metas:
            block_id = meta.block_id
            if block_id in pending or not registered(block_id):
                continue
            seen = known(block_id)
            if seen is None:
                fresh.append(meta)
            elif seen <= cutoff:  # the master failed since, or it is a while ago: G4 may have lost it
                recheck.append(meta)
        if self._filter is not None and fresh:
            fresh = [m for m in fresh if self._filter.offer(m.block_id)]
        if self.store.down:  # queued again once G4 is back
            self._defer([m.block_id for m in fresh + recheck])
            return
        self._submit(fresh, recheck)

    def _submit(self, fresh: list, recheck: list) -> None:
        metas = fresh + recheck
        room = max(0, self.queue_blocks - self.queued)
        if len(metas) > room:  # a backlog: the rest wait (unpinned, in the bounded retry set) for room
            self.stats["write_queue_full"] += len(metas) - room
            self._defer([m.block_id for m in metas[room:]])
            metas = metas[:room]
        if not metas:
            return
        ids = tuple(m.block_id for m in metas)
        flags = ((False,) * len(fresh) + (True,) * len(recheck))[: len(metas)] if recheck else ()
        rows = tuple(self._host.pin(ids))
        generation, fingerprint = self._generation(), self.store.fingerprint
        future = self._lane.submit(_host_to_g4, self.store, metas, rows, flags, self._host.slab, self.headers,
                                   generation, self._generation, fingerprint)
        self._writes.append(_Write(future, ids, tuple(metas), rows, flags, generation, fingerprint))
        self._pending.update(ids)
        self.queued += len(ids)
        self.submitted += len(ids)

    def collect(self) -> None:
        while self._writes and self._writes[0].future.done():
            write = self._writes.popleft()
            same_tiers = write.generation == self._generation()
            if same_tiers:  # else its pins went with the forgotten index (a newer pin of the block may exist)
                self._host.unpin(write.ids)
            current = same_tiers and write.fingerprint == self.store.fingerprint
            self._host.release_orphans(write.rows)  # this write's hold on rows of a forgotten generation
            self._pending.difference_update(write.ids)
            self.queued -= len(write.ids)
            result = self._result(write)
            if result is None or not current:  # of a forgotten generation or identity: nothing to learn or retry
                if self._tries:
                    deque_pop(self._tries, write.ids)
                continue
            self._settle(write, *result)
        self._resubmit()

    def _result(self, write: _Write) -> Optional[tuple[list[int], float]]:
        if write.future.cancelled():  # shut down
            return None
        try:
            result = write.future.result()
        except Exception:  # a bug or a client crash: tried again, a bounded number of times
            logger.exception("kvbm: G4 write of %d blocks failed", len(write.ids))
            return [FAILED] * len(write.ids), 0.0
        if result is None:
            self.stats["write_stale"] += len(write.ids)
        return result

    def _settle(self, write: _Write, status: list[int], when: float) -> None:
        self.learn([b for b, s in zip(write.ids, status) if s == HELD or s == WRITTEN], when)
        written = status.count(WRITTEN)
        self.written += written
        if written:
            self.stored.extend(m for m, s in zip(write.metas, status) if s == WRITTEN)
        if write.recheck and written:
            self.stats["rewritten"] += sum(1 for r, s in zip(write.recheck, status) if r and s == WRITTEN)
        if FAILED not in status and UNTRIED not in status:
            if self._tries:
                deque_pop(self._tries, write.ids)
            return
        for block_id, fate in zip(write.ids, status):
            tries = self._tries.pop(block_id, 0)
            if fate == FAILED:
                tries += 1
                self._retry_at = time.monotonic() + self.store.retry_s
            if fate == FAILED or fate == UNTRIED:
                if tries >= self.max_tries:
                    self.stats["write_gave_up"] += 1
                    continue
                self._retry[block_id] = tries
                self.stats["write_retried"] += 1
        self._bound_retries()

    def _defer(self, block_ids: Sequence[BlockId]) -> None:
        for block_id in block_ids:
            self._retry[block_id] = self._retry.get(block_id, 0)
            self._retry.move_to_end(block_id)
        self._bound_retries()

    def _bound_retries(self) -> None:
        while len(self._retry) > self.queue_blocks:
            self._retry.popitem(last=False)
            self.stats["write_gave_up"] += 1

    def _resubmit(self) -> None:
        """Queue again what waits for G4 (offered while it was down, or failed), once it is up and the wait is over."""
        if not self._retry or self._closed or self.store.down or time.monotonic() < self._retry_at:
            return
        room = self.queue_blocks - self.queued
        ids = []
        while self._retry and len(ids) < room:
            block_id, tries = self._retry.popitem(last=False)
            if block_id not in self._pending:
                ids.append(block_id)
                self._tries[block_id] = tries
        metas = self._host.metas_of(ids)  # those still in the host tier: the rest cannot be written from it
        if len(metas) < len(ids):
            deque_pop(self._tries, set(ids).difference(m.block_id for m in metas))
        known = self._known
        self._submit([m for m in metas if m.block_id not in known], [m for m in metas if m.block_id in known])

    def futures(self) -> list[Future]:
        return [w.future for w in self._writes]


def deque_pop(table: dict, keys) -> None:
    """Remove ``keys`` from ``table`` (missing ones ignored), in C."""
    collections.deque(map(table.pop, keys, itertools.repeat(None)), maxlen=0)
