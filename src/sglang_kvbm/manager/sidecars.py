"""Pools stored beside the KV blocks (sliding-window pages, Mamba states), keyed by the same block ids.

Each sidecar pool has tiers of its own (a :class:`LocalBlockManager` over its
own layout: host rows of its block size, a disk store with its own identity),
because its blocks come and go on their own schedule: a node offers every
sliding-window page it still holds, and one Mamba state, at its last page. What
ties them to the KV blocks is here:

* **one offload**: a KV offload and its sidecar parts complete as one, in the
  engine's order, and succeed only if every part did (``store`` / ``completed``
  / ``pop``);
* **a boundary is restorable** only if every sidecar holds the blocks its
  window needs there (``restorable``): the last ``window`` pages before it for
  sliding-window layers, the boundary's own state for Mamba;
* **all or none**: a load pins every pool's blocks or none (``acquire``).

Sidecar blocks carry no KV events: SGLang's tree publishes per-page events for
the full-attention KV only, and so do the tiers.
"""

from __future__ import annotations

import collections
import itertools
from typing import Optional, Sequence

from sglang_kvbm.core.identity import BlockId
from sglang_kvbm.core.ports import StoreRequest
from sglang_kvbm.manager.block_manager import LocalBlockManager


class SidecarStores:
    def __init__(self, stores: dict[str, tuple[LocalBlockManager, int]]) -> None:
        """``stores``: name -> (its tiers, pages a boundary needs)."""
        self.managers = {name: manager for name, (manager, _) in stores.items()}
        self.windows = {name: window for name, (_, window) in stores.items()}
        self._entries: collections.deque[dict[str, int]] = collections.deque()  # name -> ticket, per KV offload
        self._results: dict[tuple[str, int], bool] = {}

    def __bool__(self) -> bool:
        return bool(self.managers)

    # -- offloads ----------------------------------------------------------------------

    def store(self, requests: dict[str, StoreRequest]) -> None:
        """The sidecar parts of one KV offload the engine just made (an empty dict: it has none)."""
        self._entries.append({name: self.managers[name].store(request) for name, request in requests.items()})

    def completed(self) -> int:
        """How many of the oldest offloads' sidecar parts have all finished (polls first)."""
        self.poll()
        done = 0
        for entry in self._entries:
            if not all((name, ticket) in self._results for name, ticket in entry.items()):
                break
            done += 1
        return done

    def pop(self) -> bool:
        entry = self._entries.popleft()
        return all([self._results.pop((name, ticket)) for name, ticket in entry.items()])

    def poll(self) -> None:
        for name, manager in self.managers.items():
            for ticket, ok in manager.poll().completed:  # sidecar tiers announce nothing
                self._results[(name, ticket)] = ok

    # -- lookups and loads ---------------------------------------------------------------

    def restorable(self, block_ids: Sequence[BlockId], hit: int, *, every: bool = False) -> list[int]:
        """The boundaries (in pages, 1..``hit``) every sidecar can restore: the longest only, or ``every`` one
        (ranks that intersect their answers); starts reading the longest one's disk blocks."""
        if every:
            ok = [True] * hit
            for name, manager in self.managers.items():
                window = self.windows[name]
                runs = itertools.accumulate(manager.servable(block_ids[:hit]), lambda run, held: run + 1 if held else 0)
                ok = [was and run >= min(p, window) for p, (was, run) in enumerate(zip(ok, runs), 1)]
            # the last 32 and the powers of two below: ranks intersect subsets of what each can restore
            lengths = [p for p, good in enumerate(ok, 1) if good and (p > hit - 32 or p & (p - 1) == 0)]
        else:
            lengths = [p] if (p := self.longest(block_ids, hit)) else []
        if lengths:
            for name, ids in self.parts(block_ids, lengths[-1]).items():
                self.managers[name].lookup(ids)  # keeps them warm, and reads disk-only ones into staging now
        return lengths

    def longest(self, block_ids: Sequence[BlockId], hit: int) -> int:
        """The longest restorable boundary (0: none), checking each sidecar's window back from ``hit`` (usually
        one window); reads nothing, changes nothing."""
        p = hit
        while p > 0:
            for name, manager in self.managers.items():
                window = block_ids[max(0, p - self.windows[name]) : p]
                held = manager.servable(window)
                if not all(held):  # the next candidate ends before the last block missing here
                    p = max(0, p - self.windows[name]) + len(held) - 1 - held[::-1].index(False)
                    if self.windows[name] == 1 and p:  # one state per boundary: find the last one in one call
                        held = manager.servable(block_ids[:p])
                        p = len(held) - held[::-1].index(True) if any(held) else 0
                    break
            else:
                return p
        return 0

    def parts(self, block_ids: Sequence[BlockId], pages: int) -> dict[str, Sequence[BlockId]]:
        """The blocks each sidecar loads for a boundary of ``pages`` pages."""
        return {name: block_ids[max(0, pages - window) : pages] for name, window in self.windows.items()}

    def acquire(self, parts: dict[str, Sequence[BlockId]]) -> Optional[dict]:
        """Pin every sidecar's blocks for a load, or none (None)."""
        plans = {}
        for name, ids in parts.items():
            plan = self.managers[name].acquire(ids) if ids else None
            if plan is None:
                self.release(plans, reused=False)
                return None
            plans[name] = plan
        return plans

    def release(self, plans: dict, *, reused: bool = True) -> None:
        for name, plan in plans.items():
            self.managers[name].release(plan, reused=reused)

    # -- lifecycle -------------------------------------------------------------------------

    def busy(self) -> bool:
        return any(manager.busy() for manager in self.managers.values())

    def wait(self, timeout: Optional[float] = None) -> bool:
        return all([manager.wait(timeout) for manager in self.managers.values()])

    def reset(self) -> None:
        for manager in self.managers.values():
            manager.reset()
        self._entries.clear()
        self._results.clear()

    def drop(self) -> None:
        """Forget every block; offloads in flight still complete, as not held (see ``LocalBlockManager.drop``)."""
        for manager in self.managers.values():
            manager.drop()
        self.poll()

    def close(self) -> None:
        for manager in self.managers.values():
            manager.close()
