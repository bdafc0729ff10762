"""Which disk slot holds which block: lifecycle per slot, LRU among registered blocks.

Scheduler thread only. A slot is reserved before its write is submitted,
registered (with the header that was written) when the write completed, and
freed when its block is evicted, invalidated or forgotten. Blocks being read
are pinned, so their slots cannot be reused under the read.
"""

from __future__ import annotations

import operator
from typing import Callable, NamedTuple, Optional, Sequence

from sglang_kvbm.core.identity import BlockId
from sglang_kvbm.core.lifecycle import BlockState, SlotLifecycle
from sglang_kvbm.core.lru import LruIndex
from sglang_kvbm.tiers.disk.format import BlockHeader


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
        self.state = SlotLifecycle(num_slots)
        self._index = LruIndex()
        self._headers: list[Optional[BlockHeader]] = [None] * num_slots
        self._inflight: dict[BlockId, int] = {}
        self._free: list[int] = []

    def __len__(self) -> int:
        return len(self._index)

    def set_free(self, slots: Sequence[int]) -> None:
        """Slots usable for new blocks (the live segments' slots not restored at start-up), highest first."""
        self._free = sorted(slots, reverse=True)

    def add_free(self, slots) -> None:
        """Slots usable again (a recreated segment's)."""
        self._free.extend(slots)

    def holds(self, block_id: BlockId) -> bool:
        return block_id in self._index or block_id in self._inflight

    def held(self, block_ids: Sequence[BlockId]) -> list[bool]:
        """``holds`` of each block, in C (``map``)."""
        return list(map(operator.or_, map(self._index.contains, block_ids), map(self._inflight.__contains__, block_ids)))

    def registered(self, block_id: BlockId) -> bool:
        return block_id in self._index

    @property
    def contains(self):
        return self._index.contains

    def slot(self, block_id: BlockId) -> Optional[int]:
        return self._index.slot(block_id)

    def header(self, slot: int) -> Optional[BlockHeader]:
        return self._headers[slot]

    def touch(self, block_ids: Sequence[BlockId]) -> None:
        self._index.touch(block_ids)

    def pin(self, block_ids: Sequence[BlockId]) -> list[int]:
        return self._index.pin(block_ids)

    def unpin(self, block_ids: Sequence[BlockId]) -> None:
        self._index.unpin(block_ids)

    def reserve(self, block_ids: Sequence[BlockId]) -> tuple[list[int], list[BlockHeader]]:
        """A slot for each leading block that finds one, evicting LRU blocks; and the headers evicted."""
        need = len(block_ids)
        evicted: list[BlockHeader] = [
            self._release(slot) for _, slot in self._index.pop_victims(max(0, need - len(self._free)))]
        take = min(need, len(self._free))
        slots = self._free[-take:][::-1] if take else []
        del self._free[len(self._free) - take :]
        self.state.reserve(slots)
        self._inflight.update(zip(block_ids[:take], slots))
        return slots, evicted

    def commit(self, headers: Sequence[BlockHeader], slots: Sequence[int]) -> None:
        for header in headers:
            self._inflight.pop(header.block_id, None)
        self.state.commit(slots)
        self.state.register(slots)
        for header, slot in zip(headers, slots):
            self._headers[slot] = header
        self._index.add((h.block_id for h in reversed(headers)), reversed(slots))

    def abort(self, block_ids: Sequence[BlockId], slots: Sequence[int], usable: Callable[[int], bool]) -> None:
        """A write failed or was discarded: its slots go back (those still in a live segment)."""
        for block_id, slot in zip(block_ids, slots):
            if self._inflight.get(block_id) == slot:
                del self._inflight[block_id]
        mutable = [s for s in slots if self.state.state(s) is BlockState.MUTABLE]
        self.state.drop(mutable)
        self._free.extend(s for s in mutable if usable(s))

    def remove(self, block_ids: Sequence[BlockId]) -> list[BlockHeader]:
        """Forget these registered blocks (pinned or not); returns their headers."""
        removed = []
        for block_id in block_ids:
            slot = self._index.remove(block_id)
            if slot is not None:
                removed.append(self._release(slot))
        return removed

    def drop_slots(self, slots: set[int]) -> list[BlockHeader]:
        """A segment file is gone: forget every block in these slots and stop handing them out."""
        lost = [b for b, s in self._index.items() if s in slots]
        removed = self.remove(lost)
        self._free = [s for s in self._free if s not in slots]
        return removed

    def restore(self, entries: Sequence[tuple[int, BlockHeader]]) -> None:
        """Blocks found at start-up, least recently used first (already verified to belong to this identity)."""
        slots = [slot for slot, _ in entries]
        self.state.reserve(slots)
        self.state.commit(slots)
        self.state.register(slots)
        for slot, header in entries:
            self._headers[slot] = header
        self._index.add([header.block_id for _, header in entries], slots)

    def entries(self) -> list[tuple[int, BlockHeader]]:
        """``(slot, header)`` of every registered block, least recently used first."""
        return [(slot, self._headers[slot]) for _, slot in self._index.items()]

    def forget(self) -> list[int]:
        """Drop every registered block; returns the slots freed (writes in flight keep theirs until they end)."""
        slots = [slot for _, slot in self._index.items()]
        self._index.clear()
        self.state.drop(slots)
        for slot in slots:
            self._headers[slot] = None
        self._inflight.clear()
        self._free.extend(slots)
        return slots

    def _release(self, slot: int) -> BlockHeader:
        header = self._headers[slot]
        self._headers[slot] = None
        self.state.drop([slot])
        self._free.append(slot)
        return header

    def free_count(self) -> int:
        return len(self._free)

    def inflight_count(self) -> int:
        return len(self._inflight)
