"""What the remote tiers (stores shared by workers) share: reads of a lookup's tail on the tier's own thread.

A read asks the store which blocks of the tail it holds, gets the leading run
of them into staging rows and verifies each there (``block_objects``); the
scheduler thread only submits, and collects once the read is done. A read that
runs much longer than one should marks the tier stalled: lookups skip it until
that read ends (a lost server takes seconds per call to fail).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from typing import Callable, Optional, Sequence

from sglang_kvbm.core.identity import BlockId
from sglang_kvbm.core.pages import Page
from sglang_kvbm.tiers.lower import Read

logger = logging.getLogger(__name__)
STALLED_S = 1.0  # a read running longer than this pauses new ones


def read_leading(store, block_ids: Sequence[BlockId], slab, headers, rows: Sequence[int]
                 ) -> tuple[list[Optional[Page]], float]:
    """On the tier's thread: the leading blocks ``store`` holds, read into staging ``rows`` and verified; a meta
    per block, None for a miss."""
    started = time.perf_counter()
    held = store.contains(block_ids)
    n = held.index(False) if False in held else len(held)
    metas = store.read(block_ids[:n], [slab[r] for r in rows[:n]], [headers[r] for r in rows[:n]]) if n else []
    return metas + [None] * (len(block_ids) - n), time.perf_counter() - started


class RemoteReads:
    """A remote tier's reads in flight: submitted urgent on its thread, timed, finished on the scheduler thread."""

    def __init__(self, name: str, lane, slot_bytes: int,
                 observe: Callable[[str, int, float], None] = lambda path, nbytes, seconds: None) -> None:
        """``observe`` hears of every read's verified bytes as the transfer path ``onboard_<name>`` (metrics)."""
        self._name = name
        self._lane = lane
        self._slot_bytes = slot_bytes
        self._observe = observe
        self._started: dict[Future, float] = {}
        self.lookup_hits = self.lookup_misses = 0

    def start(self, store, block_ids: Sequence[BlockId], slab, headers, rows: Sequence[int]) -> Read:
        future = self._lane.submit_urgent(read_leading, store, tuple(block_ids), slab, headers, tuple(rows))
        self._started[future] = time.monotonic()
        return Read(future)

    def finish(self, read: Read, block_ids: Sequence[BlockId], current: bool
               ) -> tuple[list[Optional[Page]], float]:
        """Each block's verified meta (all None if it failed, or the tiers were reset meanwhile), and its seconds."""
        self._started.pop(read.future, None)
        try:
            metas, seconds = read.future.result()
        except Exception:  # the request recomputes; nothing is staged
            logger.exception("kvbm: %s read of %d blocks failed", self._name, len(block_ids))
            return [None] * len(block_ids), 0.0
        if not current:
            return [None] * len(block_ids), seconds
        found = sum(meta is not None for meta in metas)
        if found:
            self._observe(f"onboard_{self._name}", found * self._slot_bytes, seconds)
        self.lookup_hits += found  # blocks a lookup found there, and asked for in vain (KVBM's g4_lookup_*)
        self.lookup_misses += len(block_ids) - found
        return metas, seconds

    def stalled(self) -> bool:
        now = time.monotonic()
        return any(not f.done() and now - t > STALLED_S for f, t in self._started.items())
