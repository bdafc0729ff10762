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

Each tier's slots follow it in the compiled block index
(:class:`sglang_kvbm._blocks.BlockIndex`, ``csrc/block_index.h``), with the
LRU order and the pins beside the states: a copy's slots are reserved
(``MUTABLE``), then registered at once when its bytes are there (``commit``
passes through ``COMMITTED``), or aborted. A call checks its whole batch
before it changes any slot: an id or a slot twice where that means nothing
(``reserve``, ``restore``, ``commit``, ``abort``, ``drop_slots``,
``set_free``, ``add_free``) is a ``ValueError``, a wrong type a
``TypeError``, a slot out of range an ``IndexError``, an illegal move a
``BlockStateError``; a refused call changes nothing. Where a repeat has a
meaning it keeps it: ``pin``/``unpin``/``release_orphans`` count each
occurrence, ``touch`` and ``remove`` act once.
"""

from __future__ import annotations

import enum

from sglang_kvbm._blocks import BlockStateError

__all__ = ["BlockState", "BlockStateError"]


class BlockState(enum.IntEnum):
    """``BlockIndex.state(slot)``."""

    FREE = 0
    MUTABLE = 1
    COMMITTED = 2
    REGISTERED = 3
