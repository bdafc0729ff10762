"""The block lifecycle every tier follows, as KVBM defines it.

A block is one fixed-size page of KV in one tier::

    MUTABLE --commit--> COMMITTED --register--> REGISTERED
       |                    |                       |
       +--------------------+-------drop------------+--> DROPPED

* ``MUTABLE``: the tier has set aside room for the page; its bytes are not
  (all) there yet. Nobody may read it.
* ``COMMITTED``: the bytes are written and the identity is fixed.
* ``REGISTERED``: published: lookups may return it, events announce it, and it
  may be offloaded to the tier below.
* ``DROPPED``: the tier let it go (evicted, failed, reset). Terminal.

A failed copy drops a block before it was ever registered, so a page that
did not arrive whole is never visible. Every other transition raises
:class:`BlockStateError`: a wrong transition is a bug in the caller, and is
reported where it happens rather than later as wrong KV.
"""

from __future__ import annotations

import enum

from sglang_kvbm.core.ports import BlockMeta


class BlockStateError(RuntimeError):
    """An illegal lifecycle transition."""


class BlockState(enum.IntEnum):
    MUTABLE = 0
    COMMITTED = 1
    REGISTERED = 2
    DROPPED = 3


class Block:
    """One page in one tier, with its lifecycle state."""

    __slots__ = ("meta", "state")

    def __init__(self, meta: BlockMeta) -> None:
        self.meta = meta
        self.state = BlockState.MUTABLE

    @property
    def block_id(self) -> str:
        return self.meta.block_id

    def commit(self) -> None:
        self._move(BlockState.MUTABLE, BlockState.COMMITTED)

    def register(self) -> None:
        self._move(BlockState.COMMITTED, BlockState.REGISTERED)

    def drop(self) -> None:
        if self.state is BlockState.DROPPED:
            raise BlockStateError(f"block {self.block_id[:16]} dropped twice")
        self.state = BlockState.DROPPED

    def _move(self, expected: BlockState, to: BlockState) -> None:
        if self.state is not expected:
            raise BlockStateError(
                f"block {self.block_id[:16]}: cannot go {self.state.name} -> {to.name} "
                f"(only from {expected.name})"
            )
        self.state = to

    def __repr__(self) -> str:
        return f"Block({self.block_id[:16]}, {self.state.name})"
