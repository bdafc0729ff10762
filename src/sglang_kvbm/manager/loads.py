"""Loads from the time they are pinned to the time their rows are let go.

A load goes through three states, all kept here (scheduler thread):

* **queued** per request (``queue``), from the engine's ``load`` until the
  next forward starts them, or until the request goes away (``cancel``);
* **started** as one batch per forward (``start``), copied layer by layer by
  the loader under the forward (``layer_loader``, ``layer_counter``);
* **landing** after the forward (``finish``): on CUDA the copies may still run
  when the forward's last wait was enqueued, so a batch's plans are released
  (their host and staging rows let go) only once the event after its last
  copy is done, polled each step (``poll``), never waited on except when
  quiescing.
"""

from __future__ import annotations

import collections
from typing import Optional, Sequence


class LoadBatches:
    def __init__(self, connector, loader, counter, sidecars=None) -> None:
        """``sidecars``: the ``SidecarStores`` whose plans ride along with the KV plans (hybrid models)."""
        self._connector = connector
        self._loader = loader
        self._counter = counter
        self._sidecars = sidecars
        self._queued: dict[str, tuple] = {}  # rid -> (plan, device slots[, {sidecar: (plan, slots)}]), next forward
        self._started: dict[int, list] = {}  # counter index -> plans being copied
        self._rids: dict[int, list[str]] = {}  # counter index -> its requests
        self._landed: collections.deque[list[str]] = collections.deque()  # finished batches' requests, not popped
        self._landing: list[tuple] = []  # (done event, plans, landed, index): copies enqueued, not ended (CUDA)

    def queue(self, rid: str, plan, slots, sidecars: Optional[dict] = None) -> None:
        old = self._queued.pop(rid, None)
        if old is not None:
            self._cancel(old)
        self._queued[rid] = (plan, slots, sidecars) if sidecars else (plan, slots)

    def pending(self) -> bool:
        """Whether a load is queued for the next forward."""
        return bool(self._queued)

    def queued_plan(self, rid: str):
        """The plan of ``rid``'s load queued for the next forward, or None."""
        queued = self._queued.get(rid)
        return None if queued is None else queued[0]

    def cancel(self, rid: str) -> bool:
        """A queued load that will not run (its request went away): unpin, count nothing."""
        queued = self._queued.pop(rid, None)
        if queued is None:
            return False
        self._cancel(queued)
        return True

    def _cancel(self, load) -> None:
        self._connector.cancel(load[0])
        if len(load) > 2:
            self._sidecars.release({name: plan for name, (plan, _) in load[2].items()}, reused=False)

    def start(self, ready: Sequence = ()) -> int:
        """Hand every queued load to the loader as one batch after ``ready``; the counter index, or -1."""
        if not self._queued:
            return -1
        rids, loads, self._queued = list(self._queued), list(self._queued.values()), {}
        index = self._loader.start(loads, ready)
        self._started[index] = [(load[0], load[2] if len(load) > 2 else None) for load in loads]
        self._rids[index] = rids
        return index

    def landed(self) -> int:
        """How many started batches are over and not popped: finishes those whose layers were all handed over."""
        for index in list(self._started):
            if not self._counter.recorded_all(index):
                break
            rids = self._rids.get(index, [])
            self.finish(index)
            self._landed.append(rids)
        return len(self._landed)

    def pop_landed(self) -> list[str]:
        """The requests of the oldest batch :meth:`landed` counted."""
        return self._landed.popleft()

    def finish(self, index: int) -> bool:
        """After the forward: every layer handed to the device; True when all of them were."""
        landed = self._counter.finish(index)
        plans = self._started.pop(index, ())
        self._rids.pop(index, None)
        done = self._counter.done_event(index)
        if done is not None and not done.query():  # rows are let go once the copies that read them end
            self._landing.append((done, plans, landed, index))
        else:
            self._release(plans, landed, index)
        return landed

    def _release(self, plans, landed: bool, index: int) -> None:
        for plan, sidecars in plans:
            self._connector.release(plan, landed=landed)
            if sidecars:
                self._sidecars.release({name: p for name, (p, _) in sidecars.items()}, reused=landed)
        self._counter.forget(index)
        self._loader.forget(index)

    def poll(self, wait: bool = False) -> None:
        """Let go of the rows of loads whose copies ended (each step; ``wait`` when quiescing only)."""
        if not self._landing:
            return
        still = []
        for done, plans, landed, index in self._landing:
            if wait:
                done.synchronize()
            if done.query():
                self._release(plans, landed, index)
            else:
                still.append((done, plans, landed, index))
        self._landing = still

    def quiesce(self, timeout: Optional[float] = None) -> bool:
        """Wait until the loader handed over every batch, and (if it did) their copies ended; False on timeout."""
        idle = self._loader.wait_idle(timeout)
        self.poll(wait=idle)
        return idle

    def drop(self) -> None:
        """The cache is reset: loads not started never will be, and started ones count as not landed."""
        for load in self._queued.values():
            self._cancel(load)
        for plans in self._started.values():
            for plan, sidecars in plans:
                self._cancel((plan, None, sidecars) if sidecars else (plan,))
        for index in self._started:
            self._loader.forget(index)
        self._queued.clear()
        self._started.clear()
        self._rids.clear()
        self._landed.clear()
        self._counter.reset()

    def close(self) -> None:
        self._loader.close()
        self.poll(wait=True)
