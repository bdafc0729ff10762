"""Which disk slot holds which block: lifecycle per slot, LRU among registered blocks.

Scheduler thread only. A slot is reserved before its write is submitted,
registered (with the header that was written) when the write completed, and
freed when its block is evicted, invalidated or forgotten. Blocks being read
are pinned, so their slots cannot be reused under the read. The bookkeeping is
the compiled block index (``csrc/block_index.h``), each registered slot
keeping its header there; a slot of a segment that is gone is never handed
out again until the segment is recreated.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

from sglang_kvbm._blocks import BlockIndex
from sglang_kvbm.core.identity import BlockId
from sglang_kvbm.tiers.format import BlockHeader


class Reservation(NamedTuple):
    block_id: BlockId
    slot: int
    generation: int


class DiskEntry(NamedTuple):
    slot: int
    header: BlockHeader


class DiskSlotIndex:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.index = BlockIndex(num_slots, False)  # no slot usable before the segments are known (``set_free``)

    def __len__(self) -> int:
        return len(self.index)

    def set_free(self, slots: Sequence[int]) -> None:
        """Slots usable for new blocks (the live segments' slots not restored at start-up), lowest first out."""
        self.index.set_free(slots)

    def add_free(self, slots: Sequence[int]) -> None:
        """A recreated segment's slots: usable again (those free now at once, those being written once aborted)."""
        self.index.add_free(slots)

    def holds(self, block_id: BlockId) -> bool:
        return self.index.holds(block_id)

    def missing(self, block_ids: Sequence[BlockId]) -> list[int]:
        """Positions of the blocks neither registered nor being written."""
        return self.index.missing(block_ids)

    def registered(self, block_id: BlockId) -> bool:
        return self.index.registered(block_id)

    def slot(self, block_id: BlockId) -> Optional[int]:
        return self.index.slot(block_id)

    def header(self, slot: int) -> Optional[BlockHeader]:
        return self.index.payload(slot)

    def touch(self, block_ids: Sequence[BlockId]) -> None:
        self.index.touch(block_ids)

    def pin(self, block_ids: Sequence[BlockId]) -> Sequence[int]:
        return self.index.pin(block_ids)

    def unpin(self, block_ids: Sequence[BlockId]) -> None:
        self.index.unpin(block_ids)

    def reserve(self, block_ids: Sequence[BlockId]) -> tuple[list[int], list[BlockHeader]]:
        """A slot for each leading block that finds one, evicting LRU blocks; and the headers evicted."""
        return self.index.reserve(block_ids)

    def commit(self, headers: Sequence[BlockHeader], slots: Sequence[int]) -> None:
        self.index.commit(slots, headers)

    def abort(self, slots: Sequence[int]) -> None:
        """A write failed or was discarded: its slots go back (those still in a live segment)."""
        self.index.abort(slots)

    def remove(self, block_ids: Sequence[BlockId]) -> list[BlockHeader]:
        """Forget these registered blocks (pinned or not); returns their headers."""
        return self.index.remove(block_ids, False)

    def drop_slots(self, slots: Sequence[int]) -> list[BlockHeader]:
        """A segment file is gone: forget every block in these slots and stop handing them out."""
        return self.index.drop_slots(slots)

    def restore(self, entries: Sequence[tuple[int, BlockHeader]]) -> None:
        """Blocks found at start-up, least recently used first (already verified to belong to this identity)."""
        self.index.restore([slot for slot, _ in entries], [h.block_id for _, h in entries], [h for _, h in entries])

    def entries(self) -> list[tuple[int, BlockHeader]]:
        """``(slot, header)`` of every registered block, least recently used first."""
        return self.index.items()

    def forget(self) -> list[int]:
        """Drop every registered block; returns the slots freed (writes in flight keep theirs until they end)."""
        return self.index.forget(False)

    def free_count(self) -> int:
        return self.index.free_count()

    def inflight_count(self) -> int:
        return self.index.inflight_count()
