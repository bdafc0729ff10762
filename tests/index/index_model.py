"""What ``sglang_kvbm._blocks.BlockIndex`` promises, written as plainly as possible, for the differential fuzz test.

Lists and dicts where the index has intrusive links and an open-addressing table; the same order of checks
(so a batch with two faults raises the same error); the same slot choices (the free list is a stack, taken
from the end). Every call that changes state checks its whole batch first, so a refused call changes
nothing here by construction.
"""

from __future__ import annotations

import operator
from array import array

import blocks_under_test  # noqa: F401 - the build under test, before the index

from sglang_kvbm._blocks import BlockStateError

FREE, MUTABLE, REGISTERED = 0, 1, 3
HEX = frozenset("0123456789abcdefABCDEF")


def parse(block_id) -> bytes:
    if isinstance(block_id, str):
        if len(block_id) != 64 or not set(block_id) <= HEX:
            raise ValueError(block_id)
        return bytes.fromhex(block_id)
    if isinstance(block_id, bytes):
        if len(block_id) != 32:
            raise ValueError(block_id)
        return bytes(block_id)
    raise TypeError(type(block_id).__name__)


def keys_of(ids) -> list[bytes]:
    if isinstance(ids, (str, bytes)):
        raise TypeError("one id, not a sequence")
    return [parse(i) for i in ids]


class IndexModel:
    def __init__(self, capacity: int, all_free: bool = True):
        self.cap = capacity
        self.state = [FREE] * capacity
        self.key: list[bytes | None] = [None] * capacity
        self.usable = [all_free] * capacity
        self.pin_count = [0] * capacity
        self.orphan = [0] * capacity
        self.payload: list[object] = [None] * capacity
        self.free = list(range(capacity - 1, -1, -1)) if all_free else []  # taken from the end
        self.lru: list[int] = []  # registered slots, least recent first
        self.table: dict[bytes, int] = {}  # blocks registered or being written
        self.inflight = 0

    # -- checks -------------------------------------------------------------------------------------
    def slots_of(self, seq) -> list[int]:
        out = []
        for item in seq:
            value = item if type(item) is int else operator.index(item)
            if not 0 <= value < self.cap:
                raise IndexError(value)
            out.append(value)
        return out

    @staticmethod
    def once(values, what):
        if len(set(values)) != len(values):
            raise ValueError(f"{what} appears twice")

    def registered_slot(self, key: bytes) -> int:
        s = self.table.get(key, -1)
        return s if s >= 0 and self.state[s] == REGISTERED else -1

    @property
    def pinned(self) -> int:
        return sum(1 for s in self.lru if self.pin_count[s])

    @property
    def orphans(self) -> int:
        return sum(1 for n in self.orphan if n)

    # -- lookups --------------------------------------------------------------------------------------
    def holds(self, block_id) -> bool:
        return parse(block_id) in self.table

    def registered(self, block_id) -> bool:
        return self.registered_slot(parse(block_id)) >= 0

    def slot(self, block_id):
        s = self.registered_slot(parse(block_id))
        return s if s >= 0 else None

    def pins(self, block_id) -> int:
        s = self.registered_slot(parse(block_id))
        return self.pin_count[s] if s >= 0 else 0

    def slots(self, ids):
        return [self.slot(i) for i in list(ids)]

    def run(self, ids) -> int:
        ids = list(ids)
        for n, block_id in enumerate(ids):
            if self.registered_slot(parse(block_id)) < 0:
                return n  # the tail is not read
        return len(ids)

    def missing(self, ids):
        return [n for n, block_id in enumerate(list(ids)) if parse(block_id) not in self.table]

    def flags(self, ids) -> bytes:
        return bytes(int(self.registered(i)) for i in list(ids))

    def payloads(self, ids):
        return [self.payload[s] for s in (self.registered_slot(parse(i)) for i in list(ids)) if s >= 0]

    def items(self):
        return [(s, self.payload[s]) for s in self.lru]

    # -- a copy's slots ---------------------------------------------------------------------------------
    def reserve(self, ids):
        keys = keys_of(ids)
        self.once(keys, "block")
        if any(k in self.table for k in keys):
            raise BlockStateError("held already")
        return self._take(keys)

    def reserve_missing(self, ids):
        keys = keys_of(ids)
        todo = [n for n, key in enumerate(keys) if key not in self.table]
        wanted = [keys[n] for n in todo]
        self.once(wanted, "block")
        return (todo, *self._take(wanted))

    def _take(self, keys):
        evicted: list = []
        if len(self.free) < len(keys):
            self._evict(len(keys) - len(self.free), evicted)
        got = []
        for key in keys[: min(len(keys), len(self.free))]:
            s = self.free.pop()
            self.state[s], self.key[s], self.table[key] = MUTABLE, key, s
            got.append(s)
        self.inflight += len(got)
        return got, evicted

    def commit(self, slot_seq, payloads):
        slots = self.slots_of(slot_seq)
        self.once(slots, "slot")
        payloads = list(payloads)
        if len(payloads) != len(slots):
            raise ValueError("one payload per slot")
        for s in slots:
            if self.state[s] != MUTABLE or self.orphan[s] or not self._mapped(s):
                raise BlockStateError(s)
        for s, p in reversed(list(zip(slots, payloads))):
            self.state[s], self.payload[s] = REGISTERED, p
            self.lru.append(s)
        self.inflight -= len(slots)

    def restore(self, slot_seq, ids, payloads):
        slots = self.slots_of(slot_seq)
        self.once(slots, "slot")
        keys = keys_of(ids)
        payloads = list(payloads)
        if not len(keys) == len(payloads) == len(slots):
            raise ValueError("one id and one payload per slot")
        self.once(keys, "block")
        for s in slots:
            if self.state[s] != FREE or self.orphan[s]:
                raise BlockStateError(s)
        if any(k in self.table for k in keys):
            raise BlockStateError("held already")
        for s, key, p in zip(slots, keys, payloads):
            self.state[s], self.usable[s], self.key[s], self.table[key], self.payload[s] = REGISTERED, True, key, s, p
            self.lru.append(s)
        self.free = [s for s in self.free if s not in slots]

    def abort(self, slot_seq):
        slots = self.slots_of(slot_seq)
        self.once(slots, "slot")
        for s in slots:
            if self.orphan[s]:
                self._release_orphan(s)
            elif self.state[s] == MUTABLE:
                self._unmap(s)
                self.inflight -= 1
                self._release(s)

    def release_orphans(self, slot_seq):
        for s in self.slots_of(slot_seq):
            if self.orphan[s]:
                self._release_orphan(s)

    # -- reads ---------------------------------------------------------------------------------------------
    def touch(self, ids):
        for key in reversed(keys_of(ids)):
            s = self.registered_slot(key)
            if s >= 0:
                self.lru.remove(s)
                self.lru.append(s)

    def pin(self, ids):
        got = []
        for key in keys_of(ids):
            s = self.registered_slot(key)
            if s < 0:
                raise KeyError(key.hex())
            got.append(s)
        for s in got:
            self.pin_count[s] += 1
        return array("i", got)  # the slots as one int32 buffer

    def unpin(self, ids):
        for key in keys_of(ids):
            s = self.registered_slot(key)
            if s >= 0 and self.pin_count[s]:
                self.pin_count[s] -= 1

    def unpin_slots(self, slot_seq):
        for s in self.slots_of(slot_seq):
            if self.state[s] == REGISTERED and not self.orphan[s] and self.pin_count[s]:
                self.pin_count[s] -= 1

    # -- dropping ------------------------------------------------------------------------------------------
    def remove(self, ids, skip_pinned=False):
        out = []
        for key in keys_of(ids):
            s = self.registered_slot(key)
            if s >= 0 and not (skip_pinned and self.pin_count[s]):
                out.append(self._drop_registered(s))
        return out

    def drop_slots(self, slot_seq):
        slots = self.slots_of(slot_seq)
        self.once(slots, "slot")
        out = []
        for s in slots:
            self.usable[s] = False
            if self.state[s] == REGISTERED and not self.orphan[s]:
                out.append(self._drop_registered(s))
        self.free = [s for s in self.free if s not in slots]
        return out

    def forget(self, keep_pinned):
        freed = []
        for s in self.lru:
            self.payload[s] = None
            if keep_pinned and self.pin_count[s]:
                self.orphan[s] = self.pin_count[s]
            else:
                self.state[s] = FREE
                freed.append(s)
                self._list(s)
            self.pin_count[s] = 0
        for s in sorted(self.table.values()):
            if self.state[s] == MUTABLE:
                self.orphan[s] = 1
        self.table.clear()
        self.lru.clear()
        self.inflight = 0
        return freed

    # -- free slots ------------------------------------------------------------------------------------------
    def set_free(self, slot_seq):
        slots = self.slots_of(slot_seq)
        self.once(slots, "slot")
        if any(self.state[s] != FREE for s in slots):
            raise BlockStateError("in use")
        self.free = sorted(slots, reverse=True)
        for s in slots:
            self.usable[s] = True

    def add_free(self, slot_seq):
        slots = self.slots_of(slot_seq)
        self.once(slots, "slot")
        for s in slots:
            self.usable[s] = True
            if self.state[s] == FREE and not self.orphan[s] and s not in self.free:
                self.free.append(s)

    # -- private -----------------------------------------------------------------------------------------------
    def _mapped(self, s) -> bool:
        return self.key[s] is not None and self.table.get(self.key[s]) == s

    def _unmap(self, s):
        if self._mapped(s):
            del self.table[self.key[s]]

    def _list(self, s):
        if self.usable[s] and s not in self.free:
            self.free.append(s)

    def _release(self, s):
        self.state[s] = FREE
        self._list(s)

    def _release_orphan(self, s):
        self.orphan[s] -= 1
        if not self.orphan[s]:
            self._release(s)

    def _drop_registered(self, s):
        payload, self.payload[s] = self.payload[s], None
        self.lru.remove(s)
        self._unmap(s)
        self.pin_count[s] = 0
        self._release(s)
        return payload

    def _evict(self, n, out):
        walked = 0
        while len(out) < n and self.pinned < len(self.lru) and walked < len(self.lru):
            s = self.lru[0]
            if self.pin_count[s]:
                self.lru.append(self.lru.pop(0))
                walked += 1
                continue
            out.append(self._drop_registered(s))


def held_by(ids, indexes, touch=False) -> bytes:
    """``indexes``: models (anything else is refused as the compiled call refuses it)."""
    indexes = list(indexes)
    if len(indexes) > 8:
        raise ValueError("at most 8 indexes")
    if not all(isinstance(m, IndexModel) for m in indexes):
        raise TypeError("indexes are BlockIndex objects")
    if touch and not indexes:
        raise ValueError("touch needs an index")
    out = bytearray()
    for block_id in list(ids):
        key = parse(block_id)
        mask = sum(1 << t for t, m in enumerate(indexes) if m.registered_slot(key) >= 0)
        if not mask:
            break
        out.append(mask)
    if touch:
        indexes[0].touch(list(ids)[: len(out)])
    return bytes(out)
