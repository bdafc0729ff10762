"""
The compiled block index of each tier (csrc/block_index.h) and page records (csrc/pages.h).
"""

import array
from collections.abc import Sequence


class BlockStateError(RuntimeError):
    pass

class BlockIndex:
    """
    Which slot of one tier holds which block: states, LRU with pins, payloads.
    """

    def __init__(self, capacity: int, all_free: bool = True) -> None: ...

    @property
    def capacity(self) -> int: ...

    def __len__(self) -> int: ...

    def __contains__(self, id: str | bytes, /) -> bool: ...

    def holds(self, id: str | bytes, /) -> bool:
        """Registered or being written here."""

    def registered(self, id: str | bytes, /) -> bool: ...

    def slot(self, id: str | bytes, /) -> int | None: ...

    def slots(self, ids: Sequence[str | bytes], /) -> list[int | None]: ...

    def run(self, ids: Sequence[str | bytes], /) -> int:
        """
        How many leading ids are registered (the ids after the first miss are not read).
        """

    def missing(self, ids: Sequence[str | bytes], /) -> list[int]:
        """Positions of the ids neither registered nor being written."""

    def flags(self, ids: Sequence[str | bytes], /) -> bytes: ...

    def reserve(self, ids: Sequence[str | bytes], /) -> tuple[list[int], list[object]]:
        """
        Slots for the leading ids that find one, evicting least recently used blocks: (slots, evicted payloads).
        """

    def reserve_missing(self, ids: Sequence[str | bytes], /) -> tuple[list[int], list[int], list[object]]:
        """
        missing + reserve in one call: (positions not held, slots for the leading ones, evicted payloads).
        """

    def commit(self, slots: Sequence[int], payloads: Sequence[object], /) -> None:
        """Register reserved slots, the first most recent."""

    def restore(self, slots: Sequence[int], ids: Sequence[str | bytes], payloads: Sequence[object], /) -> None:
        """Blocks found at start-up into FREE slots, least recently used first."""

    def abort(self, slots: Sequence[int], /) -> None: ...

    def release_orphans(self, slots: Sequence[int], /) -> None: ...

    def touch(self, ids: Sequence[str | bytes], /) -> None: ...

    def pin(self, ids: Sequence[str | bytes], /) -> array.array[int]:
        """
        The slots, as one array('i'): a load's thousands of rows make no Python int each (unpin_slots and release_orphans read it back in one copy).
        """

    def unpin(self, ids: Sequence[str | bytes], /) -> None: ...

    def unpin_slots(self, slots: Sequence[int], /) -> None:
        """unpin by the slots pin returned (a slot dropped since is left alone)."""

    def pinned(self, id: str | bytes, /) -> bool: ...

    def pins(self, id: str | bytes, /) -> int: ...

    def remove(self, ids: Sequence[str | bytes], skip_pinned: bool = False) -> list[object]: ...

    def drop_slots(self, slots: Sequence[int], /) -> list[object]: ...

    def forget(self, keep_pinned: bool) -> list: ...

    def payload(self, slot: int, /) -> object | None: ...

    def payloads(self, ids: Sequence[str | bytes], /) -> list[object]: ...

    def items(self) -> list[tuple[int, object]]: ...

    def state(self, slot: int, /) -> int: ...

    def free_count(self) -> int: ...

    def inflight_count(self) -> int: ...

    def pinned_count(self) -> int: ...

    def orphan_count(self) -> int: ...

    def set_free(self, slots: Sequence[int], /) -> None: ...

    def add_free(self, slots: Sequence[int], /) -> None: ...

def held_by(ids: Sequence[str | bytes], indexes: Sequence[BlockIndex], touch: bool = False) -> bytes:
    """
    Per id of the leading run held by any index, a byte whose bit i says indexes[i] registers it; ``touch``: indexes[0]'s blocks of that run are made most recently used, the first most, and indexes[0] remembers the run: a call given the same ids next (a load's ``pin``, the offload's ``reserve_missing``; the same objects or equal ones) skips their probes.
    """

class PageIdentityError(RuntimeError):
    pass

class Pages:
    """
    One node's pages: block ids, token ids, parent, KV-event ids (csrc/pages.h).
    """

    def __init__(self, ids: Sequence[str], token_ids: Sequence[int], page_size: int, parent_id: str | None = None, bigram: bool = False, event_hashes: Sequence[int] | None = None, event_parent: int | None = None, cache_salt: str | None = None, lora_name: str | None = None) -> None: ...

    def __len__(self) -> int: ...

    @property
    def ids(self) -> tuple[str, ...]: ...

    @property
    def page_size(self) -> int: ...

    @property
    def start(self) -> int:
        """
        Where ``describe`` found the node on its inserted key, in pages (0 for other records).
        """

    @property
    def bigram(self) -> bool: ...

    @property
    def events(self) -> bool: ...

    def page(self, index: int) -> Page: ...

    def views(self, positions: Sequence[int] | None = None) -> list[Page]:
        """
        A view of each page at ``positions`` (all by default), made in one call.
        """

    def with_events(self, event_hashes: Sequence[int], event_parent: int | None, cache_salt: str | None, lora_name: str | None) -> Pages:
        """The same pages with these KV-event ids (keys SGLang namespaces)."""

class Page:
    """Page ``index`` of a ``Pages`` record: what a tier keeps about a page."""

    @property
    def pages(self) -> Pages: ...

    @property
    def index(self) -> int: ...

    @property
    def block_id(self) -> str: ...

    @property
    def parent_id(self) -> str | None:
        """
        The block id of the page before this one in its sequence (None for a first page).
        """

    @property
    def token_ids(self) -> tuple[int, ...]:
        """Its token ids (one more for an EAGLE bigram page)."""

    @property
    def event_hash(self) -> int | None:
        """Its KV-event block hash (None: not announced)."""

    @property
    def event_parent(self) -> int | None:
        """Its parent's KV-event block hash."""

    @property
    def cache_salt(self) -> str | None: ...

    @property
    def lora_name(self) -> str | None: ...

    @property
    def bigram(self) -> bool: ...

    def __eq__(self, other: object, /) -> bool: ...

    def __hash__(self) -> int: ...

    def __repr__(self) -> str: ...

def describe(tokens: Sequence[int], length: int, page_size: int, bigram: bool, seed: bytes | None, keys: Sequence[str], events: bool) -> Pages:
    """
    The record of a node whose storage keys are ``keys``, from the key it was inserted with (``tokens``, ``length`` tokens in full pages, chained from ``seed``); PageIdentityError if the keys are not on it. Hashes without the GIL. ``events``: the KV-event ids are the keys' (keys SGLang does not namespace).
    """

def stored_run(pages: Sequence[Page]) -> tuple[list[int], int | None, list[int], str | None, str | None] | None:
    """
    One BlockStored's fields for pages that form one chain of one namespace, else None.
    """

def unchained(pages: Sequence[Page]) -> list[int]:
    """
    Positions of the pages whose parent is not the page before them (the first always).
    """

def event_hashes(pages: Sequence[Page]) -> list[int]:
    """The KV-event block hashes of the pages that have one."""

def sha256_impl() -> str: ...

def sha256(data: bytes, portable: bool = False) -> bytes:
    """SHA-256 of ``data`` (for tests: either implementation)."""
