"""The original EventOrderer (a scan of every held store per removal), kept as the oracle for test_event_order.py."""

from __future__ import annotations

import collections
import logging
from typing import Iterable, Optional

from sglang.srt.disaggregation.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

from sglang_kvbm.integration.sglang.compat import block_stored, event_lora_name

logger = logging.getLogger(__name__)


class EventOrderer:
    def __init__(self, max_held: int = 1 << 16) -> None:
        self._known: dict[int, set[str]] = {}  # block hash -> media the router has it in
        self._held: dict[int, list[BlockStored]] = collections.defaultdict(list)  # parent -> waiting stores
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
                self._held_count = 0
                out.append(event)
            else:
                out.append(event)
        return out

    def known(self, block_hash: int) -> bool:
        return block_hash in self._known

    def held(self) -> int:
        return self._held_count

    def _store(self, event: BlockStored, out: list) -> None:
        parent = event.parent_block_hash
        if parent is not None and parent not in self._known and _medium(event) != "GPU":
            self._hold(parent, event)
            return
        out.append(event)
        self._mark(event)
        self._release(event.block_hashes, out)

    def _mark(self, event: BlockStored) -> None:
        medium = _medium(event)
        for block_hash in event.block_hashes:
            self._known.setdefault(block_hash, set()).add(medium)

    def _release(self, hashes: Iterable[int], out: list) -> None:
        stack = list(hashes)
        while stack:
            waiting = self._held.pop(stack.pop(), None)
            if not waiting:
                continue
            self._held_count -= len(waiting)
            for child in waiting:
                out.append(child)
                self._mark(child)
                stack.extend(child.block_hashes)

    def _hold(self, parent: int, event: BlockStored) -> None:
        if self._held_count >= self._max_held:
            self.dropped += 1
            logger.warning("kvbm: event hold-back list full; a %s store is dropped from the stream", _medium(event))
            return
        self._held[parent].append(event)
        self._held_count += 1
        self.held_total += 1

    def _remove(self, event: BlockRemoved, out: list) -> None:
        medium = _medium(event)
        published = []
        removed = set(event.block_hashes)
        for block_hash in event.block_hashes:
            media = self._known.get(block_hash)
            if media is not None and medium in media:
                published.append(block_hash)
                media.discard(medium)
                if not media:
                    del self._known[block_hash]
        if removed:
            self._forget_held(removed, medium)
        if published:
            out.append(BlockRemoved(block_hashes=published, medium=event.medium))

    def _forget_held(self, removed: set[int], medium: str) -> None:
        """A held store whose block left its tier before it could be published: it never happened."""
        for parent in list(self._held):
            waiting = self._held[parent]
            keep = []
            for child in waiting:
                if _medium(child) == medium and removed.intersection(child.block_hashes):
                    hashes = [h for h in child.block_hashes if h not in removed]
                    if not hashes:
                        continue
                    # Part of a coalesced chain left: keep the part before the first removed block.
                    cut = next(i for i, h in enumerate(child.block_hashes) if h in removed)
                    if cut == 0:
                        continue
                    child = _prefix(child, cut)
                keep.append(child)
            self._held_count -= len(waiting) - len(keep)
            if keep:
                self._held[parent] = keep
            else:
                del self._held[parent]


def _medium(event) -> str:
    medium: Optional[object] = event.medium
    if medium is None:
        return "GPU"
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
