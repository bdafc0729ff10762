"""Host rows holding blocks: the G2 tier, and the staging rows disk reads land in.

A fixed slab of rows, one block per row, each row following the block
lifecycle (:class:`~sglang_kvbm.core.lifecycle.SlotLifecycle`); registered
blocks are kept in LRU order (:class:`~sglang_kvbm.core.lru.LruIndex`). Only
the scheduler thread calls this class. Copy threads write the rows of
``MUTABLE`` blocks and read the rows of pinned ones, nothing else; a row is
reused only after its block was dropped *and* no copy can still use it.

Pins are counted per holder (a disk write, a shared tier's write and a load may read one
row at once). When the blocks are forgotten (:meth:`HostBlockPool.forget`), a
row still pinned becomes an orphan holding that count: each holder gives its
hold back when it ends (:meth:`HostBlockPool.release_orphans`), and the row is
free only once the last one did.
"""

from __future__ import annotations

import operator
from collections import deque
from itertools import compress, repeat
from typing import Optional, Sequence

import torch

from sglang_kvbm.core.identity import BlockId
from sglang_kvbm.core.lifecycle import BlockState, SlotLifecycle
from sglang_kvbm.core.lru import LruIndex
from sglang_kvbm.core.ports import BlockMeta

_block_id = operator.attrgetter("block_id")


class HostBlockPool:
    """Rows of a host slab; registered blocks are found by id and evicted least recently used first."""

    def __init__(self, slab: torch.Tensor) -> None:
        self.slab = slab
        self.capacity = slab.shape[0]
        self.rows_state = SlotLifecycle(self.capacity)
        # Popped from the end: rows go out in ascending order, so a burst of
        # stores lands in contiguous rows (fewer, larger copies).
        self._free: list[int] = list(range(self.capacity - 1, -1, -1))
        self._index = LruIndex()
        self._inflight: dict[BlockId, int] = {}
        self._metas: list[Optional[BlockMeta]] = [None] * self.capacity
        self._orphans: dict[int, int] = {}  # row of a forgotten block -> holders (copies) that still use it

    def __len__(self) -> int:
        return len(self._index)

    def holds(self, block_id: BlockId) -> bool:
        """Registered, or on its way (a copy is writing it)."""
        return block_id in self._index or block_id in self._inflight

    def held(self, block_ids: Sequence[BlockId]) -> list[bool]:
        """``holds`` of each block, in C (``map``)."""
        return list(map(operator.or_, map(self._index.contains, block_ids), map(self._inflight.__contains__, block_ids)))

    def registered(self, block_id: BlockId) -> bool:
        return block_id in self._index

    @property
    def contains(self):
        """``registered`` as a C-level callable, for ``map`` over a prefix."""
        return self._index.contains

    def rows(self, block_ids: Sequence[BlockId]) -> list[Optional[int]]:
        """The row of each registered block (None where not registered)."""
        return self._index.slots(block_ids)

    def reserve(self, block_ids: Sequence[BlockId]) -> tuple[list[int], list[BlockMeta]]:
        """Set aside a row for each block, in order, evicting least recently used ones.

        Returns the rows (one per leading block that found one; the rest found
        none) and the metas of the blocks evicted to make room.
        """
        evicted: list[BlockMeta] = []
        need = len(block_ids)
        if len(self._free) < need:
            rows = [row for _, row in self._index.pop_victims(need - len(self._free))]
            if rows:
                self.rows_state.drop(rows)
                evicted = list(map(self._metas.__getitem__, rows))
                deque(map(self._metas.__setitem__, rows, repeat(None)), maxlen=0)
                self._free.extend(rows)
        take = min(need, len(self._free))
        if not take:
            return [], evicted
        rows = self._free[-take:][::-1]
        del self._free[-take:]
        self.rows_state.reserve(rows)
        self._inflight.update(zip(block_ids[:take], rows))
        return rows, evicted

    def commit(self, metas: Sequence[BlockMeta], rows: Sequence[int]) -> None:
        """The rows hold the bytes: commit and register the blocks.

        Registered children-first, so a prefix's first block is the most recent
        and eviction takes a chain from its tail.
        """
        ids = list(map(_block_id, metas))
        deque(map(self._inflight.pop, ids, repeat(None)), maxlen=0)  # the loops here run in C
        self.rows_state.commit(rows)
        self.rows_state.register(rows)
        deque(map(self._metas.__setitem__, rows, metas), maxlen=0)
        self._index.add(reversed(ids), reversed(rows))

    def abort(self, block_ids: Sequence[BlockId], rows: Sequence[int]) -> None:
        """A copy failed or was discarded: drop its blocks and give their rows back."""
        for block_id, row in zip(block_ids, rows):
            if self._inflight.get(block_id) == row:
                del self._inflight[block_id]
        live = [row for row in rows if row not in self._orphans and self.rows_state.state(row) is BlockState.MUTABLE]
        self.rows_state.drop(live)
        self._free.extend(live)
        self.release_orphans(rows)

    def remove(self, block_ids: Sequence[BlockId]) -> list[BlockMeta]:
        """Drop registered blocks (not pinned ones) whose bytes must not be served; returns their metas."""
        removed = []
        for block_id in block_ids:
            if self._index.pinned(block_id):
                continue
            row = self._index.remove(block_id)
            if row is None:
                continue
            self.rows_state.drop([row])
            removed.append(self._metas[row])
            self._metas[row] = None
            self._free.append(row)
        return removed

    def touch(self, block_ids: Sequence[BlockId]) -> None:
        self._index.touch(block_ids)

    def pin(self, block_ids: Sequence[BlockId]) -> list[int]:
        """Keep registered blocks from eviction while something reads their rows; returns the rows."""
        return self._index.pin(block_ids)

    def unpin(self, block_ids: Sequence[BlockId]) -> None:
        self._index.unpin(block_ids)

    def meta_of(self, block_id: BlockId) -> BlockMeta:
        return self._metas[self._index.slot(block_id)]

    def metas_of(self, block_ids: Sequence[BlockId]) -> list[BlockMeta]:
        """The metas of those of ``block_ids`` that are registered, in order (C-level ``map``s)."""
        rows = self._index.slots(block_ids)
        return list(map(self._metas.__getitem__, compress(rows, map(operator.is_not, rows, repeat(None)))))

    def metas(self) -> list[BlockMeta]:
        return [self._metas[row] for _, row in self._index.items()]

    def forget(self) -> None:
        """Drop every block. Rows a copy still uses (pinned, or being written) stay taken until it ends."""
        for block_id, row in self._index.items():
            self._metas[row] = None
            holders = self._index.pins(block_id)
            if holders:
                self._orphans[row] = holders  # lower tiers' writes or loads still read it: see release_orphans()
            else:
                self.rows_state.drop([row])
                self._free.append(row)
        self._index.clear()
        self._orphans.update(dict.fromkeys(self._inflight.values(), 1))  # the copy writing it
        self._inflight.clear()

    def release_orphans(self, rows: Sequence[int]) -> None:
        """A copy that started before :meth:`forget` ended: it gives back its hold on its rows (one per row it
        pinned or was writing); a row is free once no holder is left."""
        if not self._orphans:  # the usual case: no forget() happened while a copy ran
            return
        orphans = self._orphans
        for row in rows:
            holders = orphans.get(row)
            if holders is None:
                continue
            if holders > 1:
                orphans[row] = holders - 1
                continue
            del orphans[row]
            self.rows_state.drop([row])
            self._free.append(row)

    def accounting(self) -> dict:
        """Where every row is (for ``/stats`` and the soak test's bookkeeping check)."""
        return {
            "capacity": self.capacity,
            "registered": len(self._index),
            "pinned": self._index.pinned_count(),
            "free": len(self._free),
            "in_flight": len(self._inflight),
            "orphaned": len(self._orphans),
        }
