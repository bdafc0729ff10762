"""The block lifecycle every tier follows, as KVBM defines it, kept per slot.

A block is one fixed-size page of KV in one slot of one tier (a host row, a
disk slot)::

    FREE --reserve--> MUTABLE --commit--> COMMITTED --register--> REGISTERED
      ^                  |                    |                       |
      +------------------+--------drop--------+-----------------------+

* ``MUTABLE``: the tier has set the slot aside for a page; its bytes are not
  (all) there yet. Nobody may read it.
* ``COMMITTED``: the bytes are written and the identity is fixed.
* ``REGISTERED``: published: lookups may return it, events announce it, and it
  may be offloaded to the tier below.
* ``drop``: the tier let the block go (evicted, failed, reset); the slot is free.

A failed copy drops a block before it was ever registered, so a page that did
not arrive whole is never visible. Every other transition raises
:class:`BlockStateError`: a wrong transition is a bug in the caller, reported
where it happens rather than later as wrong KV.

Transitions take a batch of slots (a copy moves many pages at once) and check
the whole batch before changing any of it.
"""

from __future__ import annotations

import enum
from collections import deque
from itertools import repeat
from typing import Sequence


class BlockStateError(RuntimeError):
    """An illegal lifecycle transition."""


class BlockState(enum.IntEnum):
    FREE = 0
    MUTABLE = 1
    COMMITTED = 2
    REGISTERED = 3


class SlotLifecycle:
    """The :class:`BlockState` of each of ``num_slots`` slots."""

    def __init__(self, num_slots: int) -> None:
        self._state = bytearray(num_slots)

    def __len__(self) -> int:
        return len(self._state)

    def state(self, slot: int) -> BlockState:
        return BlockState(self._state[slot])

    def count(self, state: BlockState) -> int:
        return self._state.count(state)

    def reserve(self, slots: Sequence[int]) -> None:
        self._move(slots, BlockState.FREE, BlockState.MUTABLE)

    def commit(self, slots: Sequence[int]) -> None:
        self._move(slots, BlockState.MUTABLE, BlockState.COMMITTED)

    def register(self, slots: Sequence[int]) -> None:
        self._move(slots, BlockState.COMMITTED, BlockState.REGISTERED)

    def drop(self, slots: Sequence[int]) -> None:
        """Free the slots of blocks in any state but FREE (dropping twice is a bug)."""
        states = bytes(map(self._state.__getitem__, slots))
        if states.count(BlockState.FREE):
            slot = next(s for s in slots if self._state[s] == BlockState.FREE)
            raise BlockStateError(f"slot {slot}: dropped a block that is not there (already FREE)")
        deque(map(self._state.__setitem__, slots, repeat(BlockState.FREE)), maxlen=0)  # in C

    def drop_all(self) -> None:
        self._state = bytearray(len(self._state))

    def _move(self, slots: Sequence[int], expected: BlockState, to: BlockState) -> None:
        states = bytes(map(self._state.__getitem__, slots))
        if states.count(expected) != len(states):
            slot = next(s for s in slots if self._state[s] != expected)
            raise BlockStateError(
                f"slot {slot}: cannot go {BlockState(self._state[slot]).name} -> {to.name} (only from {expected.name})"
            )
        deque(map(self._state.__setitem__, slots, repeat(to)), maxlen=0)  # in C
