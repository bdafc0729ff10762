"""The eviction policy of every tier: least recently used, pinned blocks exempt.

One :class:`LruIndex` per tier maps each registered block to its slot. Its
order is use order (a hit or a store makes a block most recent); the victim
is the least recent block nobody pins. A pinned block (a copy reads its slot)
leaves the order until its last pin goes, so finding a victim never walks
past pinned blocks: every operation is O(1) per block.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable, Iterable, Optional, Sequence


class LruIndex:
    def __init__(self) -> None:
        self._order: OrderedDict[Hashable, int] = OrderedDict()  # unpinned, first = least recent
        self._pinned: dict[Hashable, list[int]] = {}  # block -> [slot, pins]

    def __len__(self) -> int:
        return len(self._order) + len(self._pinned)

    def __contains__(self, block_id: Hashable) -> bool:
        return block_id in self._order or block_id in self._pinned

    def slot(self, block_id: Hashable) -> Optional[int]:
        slot = self._order.get(block_id)
        if slot is None:
            pinned = self._pinned.get(block_id)
            slot = None if pinned is None else pinned[0]
        return slot

    def slots(self, block_ids: Sequence[Hashable]) -> list[Optional[int]]:
        return list(map(self.slot, block_ids))

    def add(self, block_ids: Iterable[Hashable], slots: Iterable[int]) -> None:
        """Register blocks as most recently used, in the given order."""
        self._order.update(zip(block_ids, slots))

    def touch(self, block_ids: Iterable[Hashable]) -> None:
        """Make these blocks (those not pinned) most recently used, the first one last."""
        order = self._order
        for block_id in reversed(list(block_ids)):
            if block_id in order:
                order.move_to_end(block_id)

    def pin(self, block_ids: Iterable[Hashable]) -> list[int]:
        """Keep blocks from eviction while their slots are read; returns the slots. Every id must be held."""
        out = []
        for block_id in block_ids:
            entry = self._pinned.get(block_id)
            if entry is None:
                entry = self._pinned[block_id] = [self._order.pop(block_id), 0]
            entry[1] += 1
            out.append(entry[0])
        return out

    def unpin(self, block_ids: Iterable[Hashable]) -> None:
        """Release a pin; a block whose last pin goes is most recently used again."""
        for block_id in block_ids:
            entry = self._pinned.get(block_id)
            if entry is None:
                continue
            entry[1] -= 1
            if entry[1] <= 0:
                del self._pinned[block_id]
                self._order[block_id] = entry[0]

    def pinned(self, block_id: Hashable) -> bool:
        return block_id in self._pinned

    def pop_victim(self) -> Optional[tuple[Hashable, int]]:
        """Remove and return the least recently used unpinned block, or None."""
        if not self._order:
            return None
        return self._order.popitem(last=False)

    def remove(self, block_id: Hashable) -> Optional[int]:
        """Forget a block (pinned or not); returns its slot, or None if not held."""
        slot = self._order.pop(block_id, None)
        if slot is None:
            entry = self._pinned.pop(block_id, None)
            slot = None if entry is None else entry[0]
        return slot

    def items(self) -> list[tuple[Hashable, int]]:
        """Every held block with its slot, least recent first (pinned ones last)."""
        return list(self._order.items()) + [(b, e[0]) for b, e in self._pinned.items()]

    def clear(self) -> None:
        self._order.clear()
        self._pinned.clear()
