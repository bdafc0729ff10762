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
from itertools import compress, islice, repeat
from typing import Hashable, Iterable, Optional, Sequence


class LruIndex:
    def __init__(self) -> None:
        self._slots: OrderedDict[Hashable, int] = OrderedDict()  # first = least recent
        self._pins: Counter = Counter()  # pinned blocks only: a count that reaches zero is deleted

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
        self._pins.update(block_ids)  # Counter's counting loop is C
        return slots

    def unpin(self, block_ids: Sequence[Hashable]) -> None:
        """Undo one ``pin`` of each block (ids not pinned are ignored); a count that reaches zero is deleted."""
        pins = self._pins
        held = list(filter(pins.__contains__, block_ids))
        if max(map(pins.__getitem__, held), default=0) == 1:  # the usual case: one holder each
            deque(map(pins.pop, held, repeat(None)), maxlen=0)
            return
        # In C, one element at a time (a repeated id reads the count its previous occurrence wrote).
        deque(map(pins.__setitem__, held, map(operator.sub, map(pins.__getitem__, held), repeat(1))), maxlen=0)
        deque(map(pins.pop, compress(held, map(operator.gt, repeat(1), map(pins.get, held, repeat(0)))), repeat(None)),
              maxlen=0)  # counts at zero (or below, after more unpins than pins)

    def pinned(self, block_id: Hashable) -> bool:
        return block_id in self._pins

    def pins(self, block_id: Hashable) -> int:
        """How many holders pin this block now (each ``pin`` not yet undone)."""
        return self._pins.get(block_id, 0)

    def pop_victim(self) -> Optional[tuple[Hashable, int]]:
        """Remove and return the least recently used unpinned block, or None if every block is pinned."""
        victims = self.pop_victims(1)
        return victims[0] if victims else None

    def pop_victims(self, n: int) -> list[tuple[Hashable, int]]:
        """Up to ``n`` victims, least recent first; pinned blocks met on the way are made most recent."""
        slots, pins = self._slots, self._pins
        if n <= 0:
            return []
        head = list(islice(slots, min(n, len(slots) - len(pins))))  # the least recent, in C
        if not any(map(pins.__contains__, head)):  # the usual case: the cold end is not in use
            return list(zip(head, map(slots.pop, head)))
        out: list[tuple[Hashable, int]] = []
        walked = 0  # pinned blocks met: each is moved warm and not met again this call
        while len(out) < n and len(pins) < len(slots) and walked < len(slots):
            block_id, slot = slots.popitem(last=False)
            if block_id in pins:
                slots[block_id] = slot  # in use: warm again
                walked += 1
                continue
            out.append((block_id, slot))
        return out

    def remove(self, block_id: Hashable) -> Optional[int]:
        """Forget a block (pinned or not); returns its slot, or None if not held."""
        self._pins.pop(block_id, None)
        return self._slots.pop(block_id, None)

    def items(self) -> list[tuple[Hashable, int]]:
        """Every held block with its slot, least recent first."""
        return list(self._slots.items())

    def pinned_count(self) -> int:
        return len(self._pins)

    def clear(self) -> None:
        self._slots.clear()
        self._pins.clear()
