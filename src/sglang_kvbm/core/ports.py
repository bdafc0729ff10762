"""The two doors out of the core: a block manager for bytes, an event sink for events.

Both are small ``typing.Protocol``\\ s so a backend (``local``, ``kvbm``) or a
publisher needs no base class. The data that crosses them is frozen.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Optional, Protocol, Sequence

from sglang_kvbm.core.identity import BlockId
from sglang_kvbm.core.tiers import Tier


@dataclasses.dataclass(frozen=True, slots=True)
class EventIdentity:
    """How KV events name a page: Dynamo's router links blocks by these ids.

    The adapter fills this from the engine's own event code, so a page carries
    the same ``block_hash`` in every tier it is published from.
    """

    block_hash: int
    parent_block_hash: Optional[int]
    cache_salt: Optional[str] = None
    lora_name: Optional[str] = None


@dataclasses.dataclass(frozen=True, slots=True)
class BlockMeta:
    """Everything a tier keeps about a page besides its bytes."""

    block_id: BlockId
    token_ids: tuple[int, ...]
    event: Optional[EventIdentity] = None


@dataclasses.dataclass(frozen=True, slots=True)
class PageStore:
    """A device page to wrap as a block (and copy down)."""

    meta: BlockMeta
    device_page: int


class TierEventKind(enum.Enum):
    STORED = "stored"
    REMOVED = "removed"


@dataclasses.dataclass(frozen=True, slots=True)
class TierEvent:
    """A change in what a lower tier holds, in publication order.

    ``source`` is the tier a stored block was copied from (None when unknown).
    """

    kind: TierEventKind
    tier: Tier
    blocks: tuple[BlockMeta, ...]
    source: Optional[Tier] = None


@dataclasses.dataclass(frozen=True, slots=True)
class LoadResult:
    """Where the blocks of a successful load came from."""

    host_blocks: int
    disk_blocks: int


@dataclasses.dataclass(frozen=True, slots=True)
class PollResult:
    completed: tuple[int, ...]  # store tickets whose device pages may now be released
    events: tuple[TierEvent, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class TierCounts:
    """Pages a tier holds (registered, i.e. servable) and its capacity."""

    tier: Tier
    blocks: int
    capacity: int


class BlockManager(Protocol):
    """The tiers below SGLang's device pool (G2 host, G3 disk).

    Contract, for every implementation:

    * :meth:`store` starts copying device pages down and returns at once with a
      ticket, or None when nothing was submitted (every page already held, or
      no room). The caller keeps the device pages unchanged until the ticket is
      reported by :meth:`poll`. Pages are taken in order; once one cannot be
      stored, none after it is (a block without its parent can never be hit).
    * A block is visible to :meth:`lookup` and :meth:`load` only once its bytes
      are completely there; a ``STORED`` event reports it exactly then. A failed
      copy is never visible and never announced.
    * :meth:`lookup` counts how many leading ids of a prefix the tiers can serve
      now. It takes no reservation: :meth:`load` checks again.
    * :meth:`peek` answers, changing nothing (no LRU touch, no policy), how many
      leading ids are in the host tier, and how many in host or disk.
    * :meth:`load` copies *all* the named blocks into the device pages or none,
      and returns None for none. Bytes that cannot be proven intact are a miss.
      When it returns, the device pages hold the KV (stream-ordered on CUDA).
    * :meth:`poll` never blocks. It returns the finished store tickets and the
      tier events since the previous call.
    * :meth:`wait` blocks until every copy submitted so far has finished, and
      :meth:`in_flight` counts those not yet reported by :meth:`poll` (for
      shutdown and tests; the scheduler never calls them).
    * :meth:`reset` forgets every block without announcing removals (the caller
      publishes one ``AllBlocksCleared``); work in flight is discarded when it ends.
    """

    keeps_token_ids: bool  # whether stored blocks need their token ids (e.g. announced again after a restart)

    def store(self, pages: Sequence[PageStore]) -> Optional[int]: ...

    def lookup(self, block_ids: Sequence[BlockId]) -> int: ...

    def peek(self, block_ids: Sequence[BlockId]) -> tuple[int, int]: ...

    def load(self, block_ids: Sequence[BlockId], device_pages: Sequence[int]) -> Optional[LoadResult]: ...

    def poll(self) -> PollResult: ...

    def counts(self) -> tuple[TierCounts, ...]: ...

    def wait(self, timeout: Optional[float] = None) -> bool: ...

    def in_flight(self) -> int: ...

    def reset(self) -> None: ...

    def close(self) -> None: ...


class EventSink(Protocol):
    """Where tier events go: the worker's one KV event stream.

    Called on the scheduler thread only, in the order things happened. A
    ``stored`` call for a block always comes after its parent's (in some tier).
    """

    def stored(self, tier: Tier, blocks: Sequence[BlockMeta]) -> None: ...

    def removed(self, tier: Tier, blocks: Sequence[BlockMeta]) -> None: ...
