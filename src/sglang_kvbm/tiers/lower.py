"""What a tier below host is to the rest of the library: one protocol, and the chain a lookup walks.

Every lower tier is written from pinned host rows and read into verified
staging rows (``staging``), as KVBM's and vLLM's offload tiering do; what
differs between tiers is behind this protocol:

* **Finding a block.** An *indexed* tier (disk) knows what it holds from an
  index on the scheduler thread: :meth:`LowerTier.holds` is exact and cheap, and
  a lookup maps it over a prefix in C. A *remote* tier (a shared store) is
  shared with other workers, so what it holds is asked on its own thread: a
  lookup fetches the tail it could not serve from nearer tiers and waits a
  bounded time (``lookups``); :meth:`LowerTier.holds` only says what this
  worker knows to be there.
* **Reading.** :meth:`LowerTier.start_read` submits a read of blocks into
  staging rows on the tier's thread and returns its handle (a :class:`Read`);
  :meth:`LowerTier.finish_read`, on the scheduler thread once the read is done,
  gives each block's verified meta, or None for a miss. A block whose bytes do
  not verify is never served; the tier drops it (with its ``REMOVED`` event if
  it announces its blocks).
* **Writing.** :meth:`LowerTier.offer` is told of host blocks just registered
  or reused; the tier's own filter decides what to write, from host rows it
  pins (``HostBlockPool.pin``) until the write ends.
* **Telling.** Every change (``TierEvent``\\ s under the tier's name, with its
  ``medium`` if the router is told of it) goes to the one ordered stream
  :meth:`LowerTier.bind` gives it, so a child is never announced before its
  parent in another tier; :attr:`LowerTier.stats` are its own counters, for
  ``/stats`` and the metrics.

Tiers are named by data (:attr:`LowerTier.name`, the folder's name under ``tiers/``):
load plans, counters, hit rates, metrics, ``/tiers`` and logs use
the name. ``tiers.registry`` builds the chain from the configuration.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any, Callable, NamedTuple, Optional, Protocol, Sequence

from sglang_kvbm._blocks import BlockIndex
from sglang_kvbm.core.identity import BlockId
from sglang_kvbm.core.onboard_policy import LinearCostMeter
from sglang_kvbm.core.pages import Page
from sglang_kvbm.core.ports import TierCounts, TierEvent
from sglang_kvbm.core.tiers import Tier


class Read(NamedTuple):
    """A read under way: its future (done when the bytes are in their rows) and what the tier needs to finish it."""

    future: Future
    state: Any = None


class LowerTier(Protocol):
    name: str  # its folder's name under tiers/
    medium: Optional[Tier]  # the KV events' medium of its blocks; None: it announces none
    indexed: bool  # True: holds() is exact on the scheduler thread; False: blocks are found by reading them
    header_bytes: int  # the header row that lands beside each block's bytes
    meter: LinearCostMeter  # seconds per byte of its reads: how long a load waits for one
    stats: dict  # its own counters (``/stats`` under its name; its metrics)

    def register_dram(self, tensor: Any) -> None:
        """Host memory its transfers read or write (the host slab, staging rows and their headers)."""

    def holds(self, block_id: BlockId) -> bool:
        """Indexed: registered (servable) now. Remote: known to be there (it may have lost it since)."""

    @property
    def index(self) -> Optional[BlockIndex]:
        """Indexed tiers: the compiled index of what it registers (``lookups`` asks it, host's and staging's about
        a whole prefix in one call); None for a tier found by reading."""

    def touch(self, block_ids: Sequence[BlockId]) -> None:
        """Indexed tiers: a lookup hit these blocks (least recently used ones are evicted first)."""

    def start_read(self, block_ids: Sequence[BlockId], slab: Any, headers: Any, rows: Sequence[int], *,
                   urgent: bool) -> Optional[Read]:
        """Submit a read of these blocks into staging ``rows``; None when it cannot start (nothing submitted).

        ``urgent``: a lookup waits for it (ahead of prefetches)."""

    def finish_read(self, read: Read, block_ids: Sequence[BlockId], current: bool) -> list[Optional[Page]]:
        """Scheduler thread, ``read`` done: each block's verified meta, None for a miss (all None unless
        ``current``: the tiers were reset meanwhile)."""

    def promote(self, futures: Sequence[Future]) -> None:
        """A load waits for these reads: run them ahead of others."""

    def ask(self, block_ids: Sequence[BlockId]) -> Optional[list[bool]]:
        """Remote tiers, any thread but the scheduler's (it may block): which it holds now; None while down."""

    def stalled(self) -> bool:
        """Do not start reads now: it is marked down, or a read of it has run much longer than one should."""

    def offer(self, metas: Sequence[Page]) -> None:
        """Host blocks just registered in host, or reused from it: write those the tier's filter takes."""

    def bind(self, emit: Callable[[TierEvent], None]) -> None:
        """Scheduler thread, once, before anything else: where its changes go (the manager's ordered stream)."""

    def collect(self) -> None:
        """Scheduler thread: finish what ended (writes, rebuilds) and emit what changed."""

    def counts(self) -> Optional[TierCounts]:
        """What it holds and can hold (None when it cannot tell: a shared store)."""

    def in_flight(self) -> list[Future]:
        """Its writes under way (reads are the staging's)."""

    def registered_metas(self) -> list[Page]:
        """Every block it holds that it announced (a drop announces their removal)."""

    def rekey(self, how: str) -> None:
        """The weights were replaced (``how``): from now on its blocks are under an identity no model files give."""

    def drop(self) -> None:
        """Announce the removal of every block it announced, then forget them (the weights were replaced)."""

    def forget(self) -> None:
        """Forget every block this worker knows of (a reset or drop); writes in flight register nothing."""

    def stop(self) -> None:
        """Stop its threads: queued calls are cancelled, no more writes start (shutdown)."""

    def close(self) -> None:
        """After :meth:`stop` and a last :meth:`collect`: release what it holds open (files, a client)."""
