"""The compiled block index of each tier (see csrc/block_index.h)."""

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

    def commit(self, slots: Sequence[int], payloads: Sequence[object], /) -> None:
        """Register reserved slots, the first most recent."""

    def restore(self, slots: Sequence[int], ids: Sequence[str | bytes], payloads: Sequence[object], /) -> None:
        """Blocks found at start-up into FREE slots, least recently used first."""

    def abort(self, slots: Sequence[int], /) -> None: ...

    def release_orphans(self, slots: Sequence[int], /) -> None: ...

    def touch(self, ids: Sequence[str | bytes], /) -> None: ...

    def pin(self, ids: Sequence[str | bytes], /) -> list[int]: ...

    def unpin(self, ids: Sequence[str | bytes], /) -> None: ...

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

def held_by(ids: Sequence[str | bytes], indexes: Sequence[BlockIndex]) -> bytes:
    """
    Per id of the leading run held by any index, a byte whose bit i says indexes[i] registers it.
    """
