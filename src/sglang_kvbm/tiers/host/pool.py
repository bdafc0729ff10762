"""Host rows holding blocks: the G2 tier, and the staging rows disk reads land in.

A fixed slab of rows, one block per row, each row following the block
lifecycle (``core.lifecycle``); registered blocks are kept in LRU order. Both
live in the compiled block index (``csrc/block_index.h``). Only the
scheduler thread calls this class. Copy threads write the rows of
``MUTABLE`` blocks and read the rows of pinned ones, nothing else; a row is
reused only after its block was dropped *and* no copy can still use it.

Pins are counted per holder (a disk write, a shared tier's write and a load may read one
row at once). When the blocks are forgotten (:meth:`HostBlockPool.forget`), a
row still pinned becomes an orphan holding that count: each holder gives its
hold back when it ends (:meth:`HostBlockPool.release_orphans`), and the row is
free only once the last one did.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from sglang_kvbm._blocks import BlockIndex
from sglang_kvbm.core.identity import BlockId
from sglang_kvbm.core.pages import Page


class HostBlockPool:
    """Rows of a host slab; registered blocks are found by id and evicted least recently used first.

    The bookkeeping is the compiled :class:`~sglang_kvbm._blocks.BlockIndex` (one call per node); each
    registered row keeps its block's :class:`Page` there.
    """

    def __init__(self, slab: torch.Tensor) -> None:
        self.slab = slab
        self.capacity = slab.shape[0]
        # Rows go out in ascending order, so a burst of stores lands in contiguous rows (fewer, larger copies).
        self.index = BlockIndex(self.capacity, True)

    def __len__(self) -> int:
        return len(self.index)

    def holds(self, block_id: BlockId) -> bool:
        """Registered, or on its way (a copy is writing it)."""
        return self.index.holds(block_id)

    def missing(self, block_ids: Sequence[BlockId]) -> list[int]:
        """Positions of the blocks neither registered nor on their way."""
        return self.index.missing(block_ids)

    def registered(self, block_id: BlockId) -> bool:
        return self.index.registered(block_id)

    def rows(self, block_ids: Sequence[BlockId]) -> list[Optional[int]]:
        """The row of each registered block (None where not registered)."""
        return self.index.slots(block_ids)

    def reserve(self, block_ids: Sequence[BlockId]) -> tuple[list[int], list[Page]]:
        """Set aside a row for each block, in order, evicting least recently used ones.

        Returns the rows (one per leading block that found one; the rest found
        none) and the metas of the blocks evicted to make room.
        """
        return self.index.reserve(block_ids)

    def reserve_missing(self, block_ids: Sequence[BlockId]) -> tuple[list[int], list[int], list[Page]]:
        """:meth:`missing` and :meth:`reserve` of those blocks in one call: ``(positions not held, rows for the
        leading ones of them, metas evicted)``."""
        return self.index.reserve_missing(block_ids)

    def commit(self, metas: Sequence[Page], rows: Sequence[int]) -> None:
        """The rows hold the bytes: commit and register the blocks.

        The first is registered most recent, so eviction takes a chain from its tail.
        """
        self.index.commit(rows, metas)

    def abort(self, rows: Sequence[int]) -> None:
        """A copy failed or was discarded: drop the blocks of its rows and give the rows back (an orphan's, once
        its last holder let go)."""
        self.index.abort(rows)

    def remove(self, block_ids: Sequence[BlockId]) -> list[Page]:
        """Drop registered blocks (not pinned ones) whose bytes must not be served; returns their metas."""
        return self.index.remove(block_ids, True)

    def touch(self, block_ids: Sequence[BlockId]) -> None:
        self.index.touch(block_ids)

    def pin(self, block_ids: Sequence[BlockId]) -> Sequence[int]:
        """Keep registered blocks from eviction while something reads their rows; returns the rows, as one
        ``array('i')`` (no Python int per row; :meth:`unpin_rows` reads it back in one copy)."""
        return self.index.pin(block_ids)

    def unpin(self, block_ids: Sequence[BlockId]) -> None:
        self.index.unpin(block_ids)

    def unpin_rows(self, rows: Sequence[int]) -> None:
        """Undo a :meth:`pin` by the rows it returned. A pinned row keeps its block until unpinned (eviction and
        :meth:`remove` skip it, :meth:`forget` orphans it), so no id is looked up again."""
        self.index.unpin_slots(rows)

    def meta_of(self, block_id: BlockId) -> Page:
        return self.index.payload(self.index.slot(block_id))

    def metas_of(self, block_ids: Sequence[BlockId]) -> list[Page]:
        """The metas of those of ``block_ids`` that are registered, in order."""
        return self.index.payloads(block_ids)

    def metas(self) -> list[Page]:
        return [meta for _, meta in self.index.items()]

    def forget(self) -> None:
        """Drop every block. Rows a copy still uses (pinned, or being written) stay taken until it ends."""
        self.index.forget(True)

    def release_orphans(self, rows: Sequence[int]) -> None:
        """A copy that started before :meth:`forget` ended: it gives back its hold on its rows (one per row it
        pinned or was writing); a row is free once no holder is left."""
        if self.index.orphan_count():  # none unless the tier forgot blocks a copy held: the rows are not read
            self.index.release_orphans(rows)

    def accounting(self) -> dict:
        """Where every row is (for ``/stats`` and the soak test's bookkeeping check)."""
        index = self.index
        return {
            "capacity": self.capacity,
            "registered": len(index),
            "pinned": index.pinned_count(),
            "free": index.free_count(),
            "in_flight": index.inflight_count(),
            "orphaned": index.orphan_count(),
        }
