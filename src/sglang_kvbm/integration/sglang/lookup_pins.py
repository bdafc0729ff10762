"""Pins taken at lookup, for an SGLang whose ``load`` cannot be refused (0.5.21).

SGLang 0.5.21 raises when a linker's ``load`` answers False, and inserts the
loaded tail into its tree before the copy. So there a load must never be asked
for what cannot be served: ``lookup`` pins what it reports (every block, or the
longest leading run it can pin: the host-resident one when a read below host
cannot be verified in time), and reports only that. SGLang intersects the
answers across attention ranks (MIN), so every rank loads at most what it
pinned itself, and ``load`` always succeeds. Its keys are those pages, or the
subset of them the tree adopted (pages another insert added meanwhile are
left out): pinned already, so pinning them for the load cannot miss.

A pin lives from its lookup to its request's load, to the request's next
lookup (a request that waits is looked up again next round), to its cancel,
or to the batch's start (a request looked up and not admitted). Scheduler
thread only.
"""

from __future__ import annotations

import logging
from typing import Optional, Sequence

logger = logging.getLogger(__name__)


class LoadCannotBeServed(RuntimeError):
    """A load asked for blocks its lookup did not pin (a bug: SGLang 0.5.21 cannot be told)."""


class LookupPins:
    def __init__(self, connector) -> None:
        self._connector = connector
        self._pins: dict[str, tuple[frozenset, object]] = {}  # rid -> (keys pinned, plan)

    def __len__(self) -> int:
        return len(self._pins)

    def pin(self, rid: str, keys: Sequence, hit: int) -> int:
        """Pin the first ``hit`` of ``keys`` (those the tiers reported) for ``rid``; how many leading pages are."""
        self.release(rid)
        while hit:
            plan = self._connector.acquire(keys[:hit])
            if plan is not None:
                self._pins[rid] = (frozenset(keys[:hit]), plan)
                return hit
            in_host = self._connector.peek(keys[:hit])[0]  # a read below host missed: host's leading run, if shorter
            hit = in_host if in_host < hit else 0
        return 0

    def take(self, rid: str, keys: Sequence):
        """The plan for a load of ``keys`` (a subset of what ``rid``'s lookup pinned)."""
        pinned = self._pins.pop(rid, None)
        if pinned is None or not pinned[0].issuperset(keys):
            if pinned is not None:
                self._connector.cancel(pinned[1])
            raise LoadCannotBeServed(
                f"kvbm: request {rid!r} asked to load {len(keys)} pages its lookup did not pin; this SGLang cannot be "
                f"told that a load is refused"
            )
        keys_pinned, plan = pinned
        if len(keys_pinned) == len(keys):
            return plan
        narrower: Optional[object] = self._connector.acquire(list(keys))  # every one is pinned: this cannot miss
        self._connector.cancel(plan)
        if narrower is None:
            raise LoadCannotBeServed(f"kvbm: pages pinned for request {rid!r} could not be pinned again")
        return narrower

    def release(self, rid: str) -> bool:
        pinned = self._pins.pop(rid, None)
        if pinned is not None:
            self._connector.cancel(pinned[1])
        return pinned is not None

    def release_all(self) -> None:
        """Requests looked up and not loaded (not admitted this round; they are looked up again)."""
        for _, plan in self._pins.values():
            self._connector.cancel(plan)
        self._pins.clear()
