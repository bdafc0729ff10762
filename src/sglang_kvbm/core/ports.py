"""The two doors out of the core: a block manager for bytes, an event sink for events.

Both are small ``typing.Protocol``\\ s so a backend (``local``, ``kvbm``) or a
publisher needs no base class. The data that crosses them is frozen.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Callable, Optional, Protocol, Sequence

from sglang_kvbm.core.identity import BlockId
from sglang_kvbm.core.pages import Page
from sglang_kvbm.core.tiers import Tier


@dataclasses.dataclass(frozen=True)
class StoreRequest:
    """Device pages to copy down, one block id per page, in prefix order.

    ``pages`` is the engine's handle on the device pages (for SGLang, the node's
    token slots); ``ready`` what a copy must wait for before it reads them (the
    forward's CUDA events). ``describe(positions)`` returns the pages at those
    positions (``core.pages``: views of one record of the node, built in one
    compiled call); it runs on a copy thread, never the scheduler's. ``block_ids`` is
    not copied: whoever builds the request does not change it afterwards.
    """

    block_ids: Sequence[BlockId]
    pages: Any
    describe: Callable[[Sequence[int]], list[Page]]
    ready: tuple = ()


class TierEventKind(enum.Enum):
    STORED = "stored"
    REMOVED = "removed"


@dataclasses.dataclass(frozen=True, slots=True)
class TierEvent:
    """A change in what a tier below the device holds, in the order it happened.

    ``tier`` is the tier's name (``host``, ``disk``, ... as the chain names them), ``source`` the name of the tier a
    stored block was copied from (``device``, ``host``; None when unknown). ``medium`` is the medium of the KV
    events the change is published as; None for a tier that announces nothing to the router (it is counted all
    the same).
    """

    kind: TierEventKind
    tier: str
    blocks: tuple[Page, ...]
    source: Optional[str] = None
    medium: Optional[Tier] = None


@dataclasses.dataclass(frozen=True, slots=True)
class PollResult:
    completed: tuple[tuple[int, bool], ...]  # (store ticket, every page now held below the device)
    events: tuple[TierEvent, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class TierCounts:
    """Pages a tier holds (registered, i.e. servable) and its capacity; ``tier`` is its name."""

    tier: str
    blocks: int
    capacity: int


class LoadPlan(Protocol):
    """Blocks pinned for one load: what the copies read, until released.

    ``by_tier``: how many of its blocks each tier served, by tier name (``host``, ``disk``, ...).
    """

    @property
    def by_tier(self) -> dict[str, int]: ...

    @property
    def blocks(self) -> int: ...


class BlockManager(Protocol):
    """The tiers below the engine's device pool: host (G2) and the chain of tiers below it.

    Contract, for every implementation:

    * :meth:`store` starts copying device pages down and returns a ticket at
      once. The caller keeps those device pages unchanged until :meth:`poll`
      reports the ticket. Pages already held are not copied again. A ticket
      completes ``True`` only when every page of the request is held below.
    * A block is visible to :meth:`lookup` and :meth:`acquire` only once its
      bytes are completely there; a ``STORED`` event reports it exactly then.
      A failed copy is never visible and never announced. A block whose parent
      is held nowhere below is not kept (it could never be hit).
    * :meth:`lookup` counts how many leading ids the tiers can serve now (and
      how many of those each tier serves, by name), and may start reading the
      ones below host into host staging. It reserves nothing: :meth:`acquire`
      checks again.
    * :meth:`peek` answers, changing nothing, how many leading ids are in the
      host tier, and how many in host or a tier below it that announces its
      blocks in KV events (what the router sees).
    * :meth:`acquire` pins *all* the named blocks for a load, or none (None).
      Bytes below host are read and verified before it returns; bytes that cannot
      be proven intact are a miss (and dropped, with their ``REMOVED`` event).
      :meth:`release` unpins them once the copies are done (``reused``: the
      load ran, which counts as a use of the blocks).
    * :meth:`reads_in_flight` says, for a lookup's ``hit``, how many leading ids
      will be servable once the reads in flight land, their futures and how
      long a load would wait for them; after :meth:`defer_reads` neither
      :meth:`lookup` nor :meth:`acquire` waits for a read (a read in flight is
      a miss to ``acquire``): the caller defers the request instead.
    * :meth:`poll` never blocks. It returns the finished store tickets, in
      submission order, and the tier events since the previous call.
    * :meth:`wait` waits for the copies submitted so far and :meth:`busy` says
      whether any is under way (shutdown, tests, tools; never the hot path).
    * :meth:`reset` forgets every block without announcing removals (the caller
      publishes one ``AllBlocksCleared``); work in flight is discarded when it ends.
    """

    def store(self, request: StoreRequest) -> int: ...

    def lookup(self, block_ids: Sequence[BlockId]) -> tuple[int, dict[str, int]]: ...

    def peek(self, block_ids: Sequence[BlockId]) -> tuple[int, int]: ...

    def acquire(self, block_ids: Sequence[BlockId]) -> Optional[LoadPlan]: ...

    def release(self, plan: LoadPlan, *, reused: bool = True) -> None: ...

    def reads_in_flight(self, block_ids: Sequence[BlockId], hit: int) -> tuple[int, list, float]: ...

    def defer_reads(self) -> None: ...

    def poll(self) -> PollResult: ...

    def counts(self) -> tuple[TierCounts, ...]: ...

    def wait(self, timeout: Optional[float] = None) -> bool: ...

    def busy(self) -> bool: ...

    def reset(self) -> None: ...

    def close(self) -> None: ...


class EventSink(Protocol):
    """Where tier events go: the worker's one KV event stream.

    Called on the scheduler thread only, in the order things happened. A
    ``stored`` call for a block always comes after its parent's (in some tier).
    """

    def stored(self, tier: Tier, blocks: Sequence[Page]) -> None: ...

    def removed(self, tier: Tier, blocks: Sequence[Page]) -> None: ...
