"""The eviction policy of every tier: least recently used, pinned blocks exempt.

One :class:`LruIndex` per tier maps each registered block to its slot, in use
order (a hit or a store makes a block most recent); the victim is the least
recent block nobody pins. Pins are counts beside the order: a pinned block met
at the cold end is moved to the warm end, so a victim search walks a pinned
block at most once per pin (amortized O(1) per eviction), and a search with
every block pinned returns at once. Membership and slot lookups are one
dictionary operation per block, in C where a batch allows (``map``); nothing
walks the tier.
"""

from __future__ import annotations

import operator
from collections import Counter, OrderedDict, deque
from itertools import compress
from typing import Hashable, Iterable, Optional, Sequence


class LruIndex:
    def __init__(self) -> None:
        self._slots: OrderedDict[Hashable, int] = OrderedDict()  # first = least recent
        self._pins: Counter = Counter()
        self._pinned = 0  # blocks whose pin count is above zero

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, block_id: Hashable) -> bool:
        return block_id in self._slots

    @property
    def contains(self):
        """The bound membership test, for ``map`` over a batch."""
        return self._slots.__contains__

    def slot(self, block_id: Hashable) -> Optional[int]:
        return self._slots.get(block_id)

    def slots(self, block_ids: Sequence[Hashable]) -> list[Optional[int]]:
        return list(map(self._slots.get, block_ids))

    def add(self, block_ids: Iterable[Hashable], slots: Iterable[int]) -> None:
        """Register blocks as most recently used, in the given order."""
        self._slots.update(zip(block_ids, slots))

    def touch(self, block_ids: Sequence[Hashable]) -> None:
        """Make these blocks most recently used, the first one last (a prefix's head outlives its tail)."""
        slots = self._slots
        deque(map(slots.move_to_end, filter(slots.__contains__, reversed(block_ids))), maxlen=0)  # in C

    def pin(self, block_ids: Sequence[Hashable]) -> list[int]:
        """Keep blocks from eviction while their slots are read; returns the slots. Every id must be held."""
        slots = list(map(self._slots.__getitem__, block_ids))
        pins = self._pins
        self._pinned += len(set(compress(block_ids, map(operator.not_, map(pins.get, block_ids)))))  # 0 or None
        pins.update(block_ids)  # Counter's counting loop is C
        return slots

    def unpin(self, block_ids: Sequence[Hashable]) -> None:
        pins = self._pins
        for block_id in block_ids:
            count = pins.get(block_id)
            if count:
                pins[block_id] = count - 1
                self._pinned -= count == 1

    def pinned(self, block_id: Hashable) -> bool:
        return self._pins.get(block_id, 0) > 0

    def pop_victim(self) -> Optional[tuple[Hashable, int]]:
        """Remove and return the least recently used unpinned block, or None if every block is pinned."""
        slots, pins = self._slots, self._pins
        if self._pinned >= len(slots):
            return None
        for _ in range(len(slots)):
            block_id = next(iter(slots))
            count = pins.get(block_id)
            if count is not None:
                if count > 0:
                    slots.move_to_end(block_id)  # in use: warm again, and not met again this search
                    continue
                del pins[block_id]  # a pin count that went back to zero
            return block_id, slots.pop(block_id)
        return None

    def pop_victims(self, n: int) -> list[tuple[Hashable, int]]:
        """Up to ``n`` victims, least recent first (``pop_victim`` ``n`` times, in one call)."""
        slots, pins = self._slots, self._pins
        out: list[tuple[Hashable, int]] = []
        walked = 0  # pinned blocks met: each is moved warm and not met again this call
        while len(out) < n and self._pinned < len(slots) and walked < len(slots):
            block_id, slot = slots.popitem(last=False)
            count = pins.get(block_id)
            if count:
                slots[block_id] = slot  # in use: warm again
                walked += 1
                continue
            if count is not None:
                del pins[block_id]  # a pin count that went back to zero
            out.append((block_id, slot))
        return out

    def remove(self, block_id: Hashable) -> Optional[int]:
        """Forget a block (pinned or not); returns its slot, or None if not held."""
        self._pinned -= self._pins.pop(block_id, 0) > 0
        return self._slots.pop(block_id, None)

    def items(self) -> list[tuple[Hashable, int]]:
        """Every held block with its slot, least recent first."""
        return list(self._slots.items())

    def pinned_count(self) -> int:
        return self._pinned

    def clear(self) -> None:
        self._slots.clear()
        self._pins.clear()
        self._pinned = 0
