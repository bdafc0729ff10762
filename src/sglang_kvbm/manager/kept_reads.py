"""Reads kept where they land: blocks a load brought from disk or a shared tier join this worker's host tier.

A load reads what host lacks into verified staging rows (``tiers.staging``),
which are not a tier: nothing there is announced, and staged blocks go as
soon as their rows are needed. Without more, a worker that paid for a read
from G4 holds the prefix nowhere of its own once its device evicts it; the
router scores every worker alike for it, and a return visit reads the network
again. So once a load landed (its bytes reached the device), its staged blocks
that host does not hold are copied into host rows (off the scheduler thread)
and registered there with their ``CPU_PINNED`` event, as if offloaded from the
device (``SGLANG_KVBM_KEEP_READS``, on by default):

* the host tier's own rules apply: rows are reserved like a store's, least
  recently used host blocks evicted for them (announced removed); what finds
  no row is not kept; a block is kept only where its parent is held in host,
  disk or the same batch (as for a store: else no lookup could reach it);
* no offload filter applies (a read is a reuse; KVBM's filters pass a block
  on its second sighting); the kept blocks are then offered to the lower tiers
  like every block host registers, and each tier's filter decides: a disk read
  is already on disk, a G4 read is already known to G4 (not written again),
  a G4 read may earn a disk copy;
* while the copy runs its staging rows stay pinned; a reset meanwhile discards
  it (its rows given back, nothing registered).

Scheduler thread only, except the copy, which runs on a thread of its own
(``kvbm-keep``: a memcpy between two host slabs, no CUDA).
"""

from __future__ import annotations

import dataclasses
import logging
from collections import deque
from concurrent.futures import Executor, Future
from itertools import groupby
from typing import Callable, Optional, Sequence

from sglang_kvbm.core.identity import BlockId
from sglang_kvbm.core.ports import TierEvent, TierEventKind
from sglang_kvbm.core.tiers import HOST
from sglang_kvbm.transfer import copies
from sglang_kvbm.transfer.lanes import LaneExecutor

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class _Keep:
    future: Future
    ids: tuple[BlockId, ...]
    metas: tuple
    sources: tuple[str, ...]  # per block: the tier it was read from
    staging_rows: tuple[int, ...]
    rows: tuple[int, ...]
    generation: int


class KeptReads:
    def __init__(self, host, staging, emit: Callable[[TierEvent], None], observe: Callable[[str, int, float], None],
                 reachable: Callable, generation: Callable[[], int], executor: Optional[Executor] = None):
        """``reachable(metas)``: how many leading blocks have their parent held below or among ``metas``
        (``Offloads.reachable``); ``executor`` (tests) replaces the copy thread."""
        self._host, self._staging = host, staging
        self._executor = executor or LaneExecutor("kvbm-keep")
        self._emit, self._observe = emit, observe
        self._reachable = reachable
        self._generation = generation
        self._keeps: deque[_Keep] = deque()
        self.stats = {"blocks_kept": 0, "blocks_not_kept_no_room": 0}

    def keep(self, staged_ids: Sequence[BlockId], sources: Sequence[str]) -> None:
        """A landed load's staged blocks (still pinned by it): copy those host lacks into host rows."""
        host, pool = self._host, self._staging.pool
        todo = host.missing(staged_ids)
        if not todo:
            return
        ids = [staged_ids[i] for i in todo]
        metas = pool.metas_of(ids)
        if len(metas) < len(ids):  # not registered in staging any more (cannot happen while the load pins them)
            return
        reachable = self._reachable(metas)
        ids, metas = ids[:reachable], metas[:reachable]
        if not ids:
            return
        rows, evicted = host.reserve(ids)
        if evicted:
            self._emit(TierEvent(TierEventKind.REMOVED, HOST.name, tuple(evicted), None, HOST.medium))
        if len(rows) < len(ids):
            self.stats["blocks_not_kept_no_room"] += len(ids) - len(rows)
            ids, metas = ids[: len(rows)], metas[: len(rows)]
        if not rows:
            return
        staging_rows = pool.pin(ids)  # this copy's own hold, given back when it is collected
        try:
            future = self._executor.submit(copies.staging_to_host, pool.slab, staging_rows, host.slab, rows)
        except RuntimeError:  # shut down
            pool.unpin(ids)
            host.abort(rows)
            return
        source_of = dict(zip(staged_ids, sources))
        self._keeps.append(_Keep(future, tuple(ids), tuple(metas), tuple(map(source_of.__getitem__, ids)),
                                 tuple(staging_rows), tuple(rows), self._generation()))

    def collect(self) -> None:
        """Register what finished copying (in order), announced as stored in host from the tier each was read from."""
        while self._keeps and self._keeps[0].future.done():
            keep = self._keeps.popleft()
            current = keep.generation == self._generation()
            pool = self._staging.pool
            if current:
                pool.unpin(keep.ids)
            pool.release_orphans(keep.staging_rows)
            error = None if keep.future.cancelled() else keep.future.exception()
            if not current or keep.future.cancelled() or error is not None:
                if error is not None:
                    logger.error("kvbm: keeping %d read blocks in host failed: %r", len(keep.ids), error)
                self._host.abort(keep.rows)
                continue
            self._host.commit(keep.metas, keep.rows)
            self._observe("s2h", len(keep.ids) * pool.slab.shape[1], keep.future.result())
            self.stats["blocks_kept"] += len(keep.ids)
            start = 0
            for source, group in groupby(keep.sources):
                n = len(list(group))
                self._emit(TierEvent(TierEventKind.STORED, HOST.name, keep.metas[start : start + n], source,
                                     HOST.medium))
                start += n

    def futures(self) -> list[Future]:
        return [keep.future for keep in self._keeps]

    def shutdown(self) -> None:
        """Stop the copy thread; copies not started are cancelled (their rows given back at the next collect)."""
        self._executor.shutdown(wait=True, cancel_futures=True)
