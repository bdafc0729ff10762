"""G4 (a Mooncake Store every worker shares) below the local tiers: write-through and verified fetches.

* **Write-through** (:class:`G4Writes`): every block that becomes registered in
  the host tier is put to G4 from its host row (pinned meanwhile), on the G4
  thread, as HiCache's ``write_through`` does for its L3. Blocks this worker
  wrote or read are remembered (a bounded set), so a reused prefix is not put again.
* **Fetches** (:func:`g4_to_staging`, run by ``read_staging``): the leading
  blocks G4 holds of a lookup's tail are read into staging rows and verified
  there (``backends.mooncake.store``); from then on they are served like
  verified disk blocks.

Every Mooncake call runs on the G4 thread (a ``LaneExecutor``); the scheduler
thread only submits, polls, and waits a bounded time for a lookup's fetch.
G4 blocks are in no event stream: Dynamo's router learns them from Mooncake.
"""

from __future__ import annotations

import collections
import logging
import time
from concurrent.futures import Future
from typing import Callable, NamedTuple, Optional, Sequence

import torch

from sglang_kvbm.core.identity import BlockId
from sglang_kvbm.core.ports import BlockMeta
from sglang_kvbm.kv_layout import aligned_empty

logger = logging.getLogger(__name__)


def g4_to_staging(store, block_ids: Sequence[BlockId], slab: torch.Tensor, headers: torch.Tensor,
                  rows: Sequence[int]) -> tuple[list[Optional[BlockMeta]], float]:
    """The leading blocks G4 holds, read into staging ``rows`` and verified: a meta per block, None for a miss."""
    started = time.perf_counter()
    held = store.contains(block_ids)
    n = held.index(False) if False in held else len(held)
    metas = store.read(block_ids[:n], [slab[r] for r in rows[:n]], [headers[r] for r in rows[:n]]) if n else []
    return metas + [None] * (len(block_ids) - n), time.perf_counter() - started


def _host_to_g4(store, metas, slab, headers, rows) -> list[bool]:
    return store.write(metas, [slab[r] for r in rows], [headers[r] for r in rows])


class _Write(NamedTuple):
    future: Future
    ids: tuple
    rows: tuple
    generation: int


class G4Writes:
    def __init__(self, store, host, lane, generation: Callable[[], int], *, remember: int = 0,
                 offload_filter=None) -> None:
        """``offload_filter`` (KVBM's ``FrequencyFilter``): write a block only once it was reused, not on its
        first store (its offers: when the host tier registers it, and each host hit)."""
        self.store = store
        self._host = host
        self._lane = lane
        self._generation = generation
        self.headers = aligned_empty((host.capacity, store.header_bytes))  # one per host row: the row's write
        store.register_dram(host.slab)
        store.register_dram(self.headers)
        self._known: collections.OrderedDict = collections.OrderedDict()  # block ids G4 holds, as far as we know
        self._remember = remember or 4 * host.capacity
        self._writes: collections.deque[_Write] = collections.deque()
        self._filter = offload_filter
        self.submitted = self.written = 0

    def forget(self) -> None:
        """G4's objects are under another name now (the identity changed): nothing is known to be there."""
        self._known.clear()

    def known(self, block_id: BlockId) -> bool:
        return block_id in self._known

    def learn(self, block_ids: Sequence[BlockId]) -> None:
        for block_id in block_ids:
            self._known[block_id] = None
            self._known.move_to_end(block_id)
        while len(self._known) > self._remember:
            self._known.popitem(last=False)

    def offer(self, metas: Sequence[BlockMeta]) -> None:
        """Host blocks just registered: put the ones G4 may not hold yet (nothing while G4 is down)."""
        todo = [m for m in metas if m.block_id not in self._known and self._host.registered(m.block_id)]
        if self._filter is not None:
            todo = [m for m in todo if self._filter.offer(m.block_id)]
        if not todo or self.store.down:
            return
        ids = tuple(m.block_id for m in todo)
        rows = tuple(self._host.pin(ids))
        future = self._lane.submit(_host_to_g4, self.store, todo, self._host.slab, self.headers, rows)
        self._writes.append(_Write(future, ids, rows, self._generation()))
        self.submitted += len(ids)

    def collect(self) -> None:
        while self._writes and self._writes[0].future.done():
            write = self._writes.popleft()
            if write.generation == self._generation():
                self._host.unpin(write.ids)
            self._host.release_orphans(write.rows)
            try:
                ok = write.future.result()
            except Exception:  # a bug or a client crash: the blocks are simply not shared
                logger.exception("kvbm: G4 write of %d blocks failed", len(write.ids))
                continue
            done = [b for b, good in zip(write.ids, ok) if good]
            self.learn(done)
            self.written += len(done)

    def futures(self) -> list[Future]:
        return [w.future for w in self._writes]
