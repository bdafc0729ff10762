"""G2: a fixed slab of host rows, one block per row, LRU among registered blocks.

Only the scheduler thread calls this class. The offload worker writes the rows
of blocks that are still ``MUTABLE`` and nothing else; a row is reused only
after its block was dropped *and* no copy can still be writing it.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Optional, Sequence

import torch

from sglang_kvbm.core.identity import BlockId
from sglang_kvbm.core.lifecycle import Block, BlockState
from sglang_kvbm.core.ports import BlockMeta

logger = logging.getLogger(__name__)

Reserved = tuple[int, Block]  # (row, block)


class HostBlockPool:
    """Host rows holding blocks; registered ones are kept in LRU order."""

    def __init__(self, slab: torch.Tensor) -> None:
        self.slab = slab
        self.capacity = slab.shape[0]
        # Popped from the end, so rows are handed out in ascending order and a
        # burst of stores lands in contiguous rows (fewer, larger copies).
        self._free: list[int] = list(range(self.capacity - 1, -1, -1))
        self._registered: OrderedDict[BlockId, Reserved] = OrderedDict()  # first = least recent
        self._inflight: dict[BlockId, Reserved] = {}
        # Registered blocks a disk write is reading: not evictable until unpinned.
        self._pins: dict[BlockId, int] = {}
        self._orphans: set[int] = set()  # rows of forgotten blocks a disk write still reads

    def __len__(self) -> int:
        return len(self._registered)

    def holds(self, block_id: BlockId) -> bool:
        """Registered, or on its way (a copy is in flight)."""
        return block_id in self._registered or block_id in self._inflight

    def reserve(self, metas: Sequence[BlockMeta]) -> tuple[list[Reserved], list[BlockMeta]]:
        """Set aside a row for each block, in order, evicting least-recent registered blocks.

        Returns the reserved ``(row, block)`` pairs (a prefix of ``metas``: it
        stops at the first block that finds no row) and the metas of the blocks
        evicted to make room.
        """
        reserved: list[Reserved] = []
        evicted: list[BlockMeta] = []
        for meta in metas:
            if not self._free:
                victim_id = next((bid for bid in self._registered if bid not in self._pins), None)
                if victim_id is None:
                    break
                row, victim = self._registered.pop(victim_id)
                victim.drop()
                evicted.append(victim.meta)
                self._free.append(row)
            row = self._free.pop()
            block = Block(meta)
            self._inflight[meta.block_id] = (row, block)
            reserved.append((row, block))
        return reserved, evicted

    def commit(self, reserved: Sequence[Reserved]) -> list[BlockMeta]:
        """The rows hold the bytes: commit and register the blocks; returns their metas.

        Registered children-first, so a prefix's first block is the most recent
        and eviction takes a chain from its tail.
        """
        for row, block in reversed(reserved):
            self._inflight.pop(block.block_id, None)
            block.commit()
            block.register()
            self._registered[block.block_id] = (row, block)
        return [block.meta for _, block in reserved]

    def abort(self, reserved: Sequence[Reserved]) -> None:
        """A copy failed or was discarded: drop its blocks and give their rows back."""
        for row, block in reserved:
            if self._inflight.get(block.block_id, (None, None))[1] is block:
                del self._inflight[block.block_id]
            if block.state is not BlockState.DROPPED:
                block.drop()
            self._free.append(row)

    def lookup(self, block_ids: Sequence[BlockId]) -> int:
        """Leading registered blocks of ``block_ids``; marks them most recently used."""
        hit = 0
        for block_id in block_ids:
            if block_id not in self._registered:
                break
            hit += 1
        self.touch(block_ids[:hit])
        return hit

    def registered(self, block_id: BlockId) -> bool:
        return block_id in self._registered

    def touch(self, block_ids: Sequence[BlockId]) -> None:
        for block_id in reversed(block_ids):
            if block_id in self._registered:
                self._registered.move_to_end(block_id)

    def pin(self, block_ids: Sequence[BlockId]) -> list[int]:
        """Keep registered blocks from eviction while something reads their rows; returns the rows."""
        rows = []
        for block_id in block_ids:
            rows.append(self._registered[block_id][0])
            self._pins[block_id] = self._pins.get(block_id, 0) + 1
        return rows

    def unpin(self, block_ids: Sequence[BlockId]) -> None:
        for block_id in block_ids:
            left = self._pins.get(block_id, 0) - 1
            if left > 0:
                self._pins[block_id] = left
            else:
                self._pins.pop(block_id, None)

    def row_of(self, block_id: BlockId) -> Optional[int]:
        entry = self._registered.get(block_id)
        return None if entry is None else entry[0]

    def meta_of(self, block_id: BlockId) -> BlockMeta:
        return self._registered[block_id][1].meta

    def rows_of(self, block_ids: Sequence[BlockId]) -> Optional[list[int]]:
        """Rows of these blocks if every one is registered, else None."""
        rows = []
        for block_id in block_ids:
            entry = self._registered.get(block_id)
            if entry is None:
                return None
            rows.append(entry[0])
        return rows

    def forget(self) -> None:
        """Drop every block. Rows being copied (in either direction) stay taken until their copy ends."""
        for block_id, (row, block) in self._registered.items():
            block.drop()
            if block_id in self._pins:
                self._orphans.add(row)  # a disk write still reads it: see release_orphans()
            else:
                self._free.append(row)
        self._registered.clear()
        self._pins.clear()
        for _, block in self._inflight.values():
            block.drop()
        self._inflight.clear()

    def release_orphans(self, rows: Sequence[int]) -> None:
        """A disk write that started before :meth:`forget` finished: its rows are free now."""
        for row in rows:
            if row in self._orphans:
                self._orphans.discard(row)
                self._free.append(row)

    def inflight_rows(self) -> int:
        """Rows a copy is still writing (including ones orphaned by a reset)."""
        return len(self._inflight) + len(self._orphans)

    def free_rows(self) -> int:
        return len(self._free)
