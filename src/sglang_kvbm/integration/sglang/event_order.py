"""Keep the worker's event stream linkable: no store goes out before its parent.

Dynamo's indexer drops a ``BlockStored`` whose parent it does not know (in any
tier), and every store below it. A lower-tier store can lose its parent in the
meantime: a page's disk write finishes after its parent left the device and the
host. Such a store is held back here and released the moment its parent is
stored again in any tier (or dropped, if its own block goes first), so that
what the router holds is always what the worker could serve.

It sees every event of the worker (SGLang's ``GPU`` events and this library's)
as the cache hands them to the publisher, tracks which tiers hold each block
id, and rewrites the batch: in-order events pass, orphans wait. The wait list
is bounded; what overflows it is dropped and counted (the block is then simply
not routed to, never routed to wrongly).

Held stores are indexed by the block hashes they carry, so a removal touches
only the stores holding a removed block (a scan of every held store took 33 ms
per removal at 60k held, on the scheduler's thread). What the router knows is
one set of block hashes per medium: marking a store's blocks, and finding which
of a removal's blocks were published, are set operations in C, not a Python
step per block (this ran on every event of every step).
"""

from __future__ import annotations

import collections
import logging
from typing import Iterable, Optional

from sglang.srt.disaggregation.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

from sglang_kvbm.core.tiers import DEVICE
from sglang_kvbm.integration.sglang.compat import block_stored, event_lora_name

logger = logging.getLogger(__name__)
_DEVICE = DEVICE.medium.value  # the tree's own events: this medium, or none at all


class EventOrderer:
    def __init__(self, max_held: int = 1 << 16) -> None:
        self._known: dict[str, set[int]] = collections.defaultdict(set)  # medium -> block hashes the router has there
        self._held: dict[int, list[BlockStored]] = collections.defaultdict(list)  # parent -> waiting stores
        # block hash -> {parent: how many stores waiting under that parent carry it}
        self._held_by_hash: dict[int, dict[int, int]] = {}
        self._held_count = 0
        self._max_held = max_held
        self.dropped = 0
        self.held_total = 0

    def order(self, events: Iterable) -> list:
        out: list = []
        for event in events:
            if isinstance(event, BlockStored):
                self._store(event, out)
            elif isinstance(event, BlockRemoved):
                self._remove(event, out)
            elif isinstance(event, AllBlocksCleared):
                self._known.clear()
                self._held.clear()
                self._held_by_hash.clear()
                self._held_count = 0
                out.append(event)
            else:
                out.append(event)
        return out

    def known(self, block_hash: int) -> bool:
        return any(block_hash in hashes for hashes in self._known.values())

    def held(self) -> int:
        return self._held_count

    def _store(self, event: BlockStored, out: list) -> None:
        parent = event.parent_block_hash
        if parent is not None and _medium(event) != _DEVICE and not self.known(parent):
            self._hold(parent, event)
            return
        out.append(event)
        self._mark(event)
        self._release(event.block_hashes, out)

    def _mark(self, event: BlockStored) -> None:
        self._known[_medium(event)].update(event.block_hashes)

    def _release(self, hashes: Iterable[int], out: list) -> None:
        if not self._held:  # the usual case: nothing waits
            return
        stack = list(filter(self._held.__contains__, hashes))
        while stack:
            waiting_for = stack.pop()
            waiting = self._held.pop(waiting_for, None)
            if not waiting:
                continue
            self._held_count -= len(waiting)
            for child in waiting:
                self._index(waiting_for, child, -1)
                out.append(child)
                self._mark(child)
                stack.extend(filter(self._held.__contains__, child.block_hashes))

    def _hold(self, parent: int, event: BlockStored) -> None:
        if self._held_count >= self._max_held:
            self.dropped += 1
            logger.warning("kvbm: event hold-back list full; a %s store is dropped from the stream", _medium(event))
            return
        self._held[parent].append(event)
        self._index(parent, event, +1)
        self._held_count += 1
        self.held_total += 1

    def _remove(self, event: BlockRemoved, out: list) -> None:
        medium = _medium(event)
        known = self._known[medium]
        published = list(filter(known.__contains__, event.block_hashes))
        known.difference_update(published)
        if self._held_by_hash:
            removed = set(filter(self._held_by_hash.__contains__, event.block_hashes))
            if removed:
                self._forget_held(removed, medium)
        if published:
            out.append(BlockRemoved(block_hashes=published, medium=event.medium))

    def _forget_held(self, removed: set[int], medium: str) -> None:
        """A held store whose block left its tier before it could be published: it never happened."""
        parents = set()
        for block_hash in removed:
            parents.update(self._held_by_hash.get(block_hash, ()))
        for parent in parents:
            waiting = self._held[parent]
            keep = []
            for child in waiting:
                if _medium(child) == medium and removed.intersection(child.block_hashes):
                    self._index(parent, child, -1)
                    hashes = [h for h in child.block_hashes if h not in removed]
                    if not hashes:
                        continue
                    # Part of a coalesced chain left: keep the part before the first removed block.
                    cut = next(i for i, h in enumerate(child.block_hashes) if h in removed)
                    if cut == 0:
                        continue
                    child = _prefix(child, cut)
                    self._index(parent, child, +1)
                keep.append(child)
            self._held_count -= len(waiting) - len(keep)
            if keep:
                self._held[parent] = keep
            else:
                del self._held[parent]

    def _index(self, parent: int, event: BlockStored, delta: int) -> None:
        """Count ``event`` (waiting under ``parent``) in, or out of, the index of held stores by block hash."""
        for block_hash in event.block_hashes:
            parents = self._held_by_hash.setdefault(block_hash, {})
            count = parents.get(parent, 0) + delta
            if count > 0:
                parents[parent] = count
            else:
                del parents[parent]
                if not parents:
                    del self._held_by_hash[block_hash]


def _medium(event) -> str:
    medium: Optional[object] = event.medium
    if medium is None:
        return _DEVICE
    return getattr(medium, "value", medium)


def _prefix(event: BlockStored, blocks: int) -> BlockStored:
    size = event.block_size
    return block_stored(
        block_hashes=event.block_hashes[:blocks],
        parent_block_hash=event.parent_block_hash,
        token_ids=event.token_ids[: blocks * size],
        block_size=size,
        lora_id=event.lora_id,
        medium=event.medium,
        cache_salt=event.cache_salt,
        session_id=event.session_id,
        lora_name=event_lora_name(event),
    )
