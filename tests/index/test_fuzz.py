"""Differential fuzz test: every public call of the compiled block index against ``model.IndexModel``.

Hypothesis drives a state machine over two indexes of one capacity (a host-like one, every slot free; a
disk-like one, no slot usable until ``set_free``/``restore``/``add_free``) and a model of each. Each step
makes one call on both, with inputs chosen to break it: ids repeated within a batch, ids whose keys share a
table bucket and ids that hash to its last bucket (probing wraps around), hex in either case and raw bytes,
malformed ids (wrong type, length, digits, a ``__repr__`` that is not text), slots repeated, out of range,
``None``, objects with ``__index__``, batches empty or several times the capacity, calls after ``forget``,
capacities from 0 up. Both must return the same thing or raise the same exception type. After every step:
the counts (``len``, in flight, pinned, orphaned, free), every slot's state, the LRU order with payloads,
and each pool id's membership, slot and pins agree; and every payload handed to the index is referenced
by it exactly while the model says it is kept (gone once dropped: no leaked reference, none freed early).

``KVBM_FUZZ=ci`` (the default): 200 machines of up to 50 steps, the same ones every run (~10 000 calls, ~20 s);
``KVBM_FUZZ=long``: 3000 machines of up to 100 steps, random.
"""

import gc
import hashlib
import struct
import sys
import weakref
from array import array

import blocks_under_test  # the build under test, before the index
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from index_model import MUTABLE, IndexModel, parse
from index_model import held_by as model_held_by

from sglang_kvbm._blocks import BlockIndex, held_by

CAPACITIES = [8, 3, 17, 1, 40, 5, 2, 0]  # not 0 first: Hypothesis favours the first


def _key(w0: int, w1: int, w2: int, w3: int) -> bytes:
    return struct.pack("<4Q", w0, w1, w2, w3)


def _bucket(key: bytes, table_size: int) -> int:
    w0, _, _, w3 = struct.unpack("<4Q", key)
    return (((w0 ^ w3) * 0x9E3779B97F4A7C15) % 2**64 >> 17) & (table_size - 1)


def _last_bucket_word() -> int:
    """A first word whose keys (fourth word 0) land in the last bucket of every table these capacities make."""
    x = 1
    while any(_bucket(_key(x, 0, 0, 0), size) != size - 1 for size in (16, 32, 64, 128)):
        x += 1
    return x


_WRAP = _last_bucket_word()
REAL = [hashlib.sha256(b"page %d" % n).digest() for n in range(40)]
COLLIDING = [_key(n + 1, n, 7 * n, n + 1) for n in range(8)]  # first word == fourth: bucket 0, all of them
WRAPPING = [_key(_WRAP, n, n, 0) for n in range(6)]  # the last bucket: probing wraps to bucket 0
POOL = REAL + COLLIDING + WRAPPING
POOL_HEX = [k.hex() for k in POOL]


class OddRepr(str):
    """A str id of the wrong length whose repr is not text (a lone surrogate cannot be UTF-8)."""

    def __repr__(self):
        return "\ud800"


class Index:
    """An ``__index__`` that is not an int."""

    def __init__(self, value):
        self.value = value

    def __index__(self):
        return self.value

    def __repr__(self):
        return f"Index({self.value})"


class Payload:
    __slots__ = ("n", "__weakref__")

    def __init__(self, n):
        self.n = n

    def __repr__(self):
        return f"P{self.n}"


BAD_IDS = [None, 7, "", "g" * 64, POOL_HEX[0][:63], b"\0" * 31, OddRepr("short"), "\xe9" * 64, "\u0101" * 64]
BAD_SLOTS = [-1, None, "3", 2**70, 1.0]


def outcome(call, *args):
    """``("returned", value)`` or ``("raised", exception type)``: what the fuzz test compares."""
    try:
        return ("returned", call(*args))
    except Exception as e:  # noqa: BLE001 - the type is what is compared
        return ("raised", type(e))


def _key_of(block_id):
    """The key of a well-formed id (the model's ``parse``), else None."""
    try:
        return parse(block_id)
    except (TypeError, ValueError):
        return None


def id_forms(key: bytes):
    return st.sampled_from([key.hex(), key.hex().upper(), key])


class IndexMachine(RuleBasedStateMachine):
    @initialize(capacity=st.sampled_from(CAPACITIES))
    def start(self, capacity):
        self.cap = capacity
        self.pairs = [(BlockIndex(capacity, True), IndexModel(capacity, True)),
                      (BlockIndex(capacity, False), IndexModel(capacity, False))]
        self.live: dict[int, Payload] = {}  # every payload handed to an index and not yet seen to leave
        self.count = 0
        self.looked_up = None  # (index and model, ids) of the last ``held_by(..., touch=True)``

    # -- drawing inputs --------------------------------------------------------------------------------
    def pair(self, data):
        return self.pairs[data.draw(st.integers(0, 1), label="index")]

    def ids(self, data, model, want="new"):
        """A batch of ids: distinct ones ``want``ed (``new`` to the model, ``registered`` there, or any pool id),
        now and then one from anywhere, a repeat or a bad id; 0, a few, or several times the capacity. Often the
        keys of a window of slots in slot order, those held there now and those that left (a run stored together,
        looked up again: the index tries each id's predecessor's next slot before its table)."""
        held = {model.key[s] for s in model.lru} if want == "registered" else set(model.table)
        base = [k for k in POOL if (k in held) == (want == "registered")] if want != "any" else POOL
        if self.cap and data.draw(st.integers(0, 2), label="in slot order?") == 0:
            first = data.draw(st.integers(0, self.cap - 1))
            window = range(first, data.draw(st.integers(first + 1, self.cap)))
            keys = list(dict.fromkeys(model.key[s] for s in window if model.key[s] is not None
                                      and (want == "any" or (model.key[s] in held) == (want == "registered"))))
        else:
            size = data.draw(st.sampled_from([0, 1, 2, 3, 5, 8, 3 * self.cap + 3, 40]), label="batch")  # 40: 3 groups
            keys = data.draw(st.lists(st.sampled_from(base or POOL), min_size=min(size, len(base or POOL)),
                                      max_size=size, unique=True))
        if keys and data.draw(st.integers(0, 5), label="one from anywhere?") == 0:
            keys[data.draw(st.integers(0, len(keys) - 1))] = data.draw(st.sampled_from(POOL))
        batch = [data.draw(id_forms(k)) for k in keys]
        odd = data.draw(st.integers(0, 9), label="odd id?")
        if odd == 0:
            batch.insert(data.draw(st.integers(0, len(batch))), data.draw(st.sampled_from(BAD_IDS)))
        elif odd == 1 and batch:
            batch.insert(data.draw(st.integers(0, len(batch))), data.draw(st.sampled_from(batch)))
        return batch if data.draw(st.booleans(), label="list?") else tuple(batch)

    def slots(self, data, prefer):
        """A batch of distinct slots, mostly ``prefer``red (the model's slots in the state the call wants), now and
        then one out of range, of the wrong type, as an ``__index__`` object, or repeated; or the batch as an
        ``array('i')`` (what ``pin`` returns: read as one buffer), one out of range, or an ``array('q')`` (a buffer
        of another item type: read item by item)."""
        if not self.cap:
            batch = []
        else:
            base = sorted(prefer) or list(range(self.cap))
            batch = data.draw(st.lists(st.sampled_from(base), max_size=len(base), unique=True), label="slots")
            if batch and data.draw(st.integers(0, 3), label="one from anywhere?") == 0:
                batch[data.draw(st.integers(0, len(batch) - 1))] = data.draw(st.integers(0, self.cap - 1))
        odd = data.draw(st.integers(0, 9), label="odd slot?")
        if odd == 0:
            batch.insert(data.draw(st.integers(0, len(batch))), data.draw(st.sampled_from(BAD_SLOTS + [self.cap])))
        elif odd == 1 and batch:
            batch = [Index(s) for s in batch]
        elif odd == 2 and batch:
            batch.insert(data.draw(st.integers(0, len(batch))), data.draw(st.sampled_from(batch)))
        elif odd == 3:
            return array("i", batch)
        elif odd == 4:
            return array("i", batch + [data.draw(st.sampled_from([-1, self.cap]))])
        elif odd == 5:
            return array("q", batch)
        return batch

    def payloads(self, n):
        made = [Payload(self.count + i) for i in range(n)]
        self.count += n
        for p in made:
            self.live[id(p)] = p
        return made

    @staticmethod
    def slots_in(model, *states):
        return [s for s in range(model.cap) if model.state[s] in states and not model.orphan[s]]

    # -- the differential call -------------------------------------------------------------------------
    @staticmethod
    def both(index, model, name, *args):
        """The call on both; what it returned (or None if it raised), the same from each."""
        want, got = outcome(getattr(model, name), *args), outcome(getattr(index, name), *args)
        assert got == want, f"{name}{args!r}: index {got!r}, model {want!r}"
        return want[1] if want[0] == "returned" else None

    # -- rules: a copy's slots -------------------------------------------------------------------------
    @rule(data=st.data())
    def reserve(self, data):
        index, model = self.pair(data)
        self.both(index, model, "reserve", self.ids(data, model))

    @rule(data=st.data())
    def copy(self, data):
        """What a tier does: reserve slots for new blocks, then register them all (or the copy fails)."""
        index, model = self.pair(data)
        reserved = self.both(index, model, "reserve", self.ids(data, model))
        if reserved and data.draw(st.integers(0, 4), label="fails?"):
            self.both(index, model, "commit", reserved[0], self.payloads(len(reserved[0])))
        elif reserved:
            self.both(index, model, "abort", reserved[0])

    @rule(data=st.data())
    def offload(self, data):
        """An offload's first tier: the ids of a node, some held already, reserved where missing, then registered."""
        index, model = self.pair(data)
        reserved = self.both(index, model, "reserve_missing", self.ids(data, model, want="any"))
        if reserved and reserved[1]:
            self.both(index, model, "commit", reserved[1], self.payloads(len(reserved[1])))

    @rule(data=st.data())
    def commit(self, data):
        index, model = self.pair(data)
        slots = self.slots(data, self.slots_in(model, MUTABLE))
        n = len(slots) + data.draw(st.sampled_from([0, 0, 0, 0, 1, -1]), label="payloads off by")
        self.both(index, model, "commit", slots, self.payloads(max(n, 0)))

    @rule(data=st.data())
    def restore(self, data):
        index, model = self.pair(data)
        slots = self.slots(data, self.slots_in(model, 0))
        ids = list(self.ids(data, model))[: len(slots)]
        ids += [data.draw(id_forms(k)) for k in data.draw(st.lists(st.sampled_from(POOL), min_size=len(slots) - len(ids),
                                                                    max_size=len(slots) - len(ids)))]
        self.both(index, model, "restore", slots, ids, self.payloads(len(slots)))

    @rule(data=st.data())
    def abort(self, data):
        index, model = self.pair(data)
        writing = [s for s in range(model.cap) if model.state[s] == MUTABLE or model.orphan[s]]
        self.both(index, model, "abort", self.slots(data, writing))

    @rule(data=st.data())
    def release_orphans(self, data):
        index, model = self.pair(data)
        self.both(index, model, "release_orphans", self.slots(data, [s for s in range(model.cap) if model.orphan[s]]))

    # -- rules: reads and drops ------------------------------------------------------------------------
    @rule(data=st.data(), call=st.sampled_from(["touch", "pin", "unpin", "remove", "remove_unpinned"]))
    def registered_blocks(self, data, call):
        index, model = self.pair(data)
        ids = self.ids(data, model, want="registered")
        if call == "remove_unpinned":
            self.both(index, model, "remove", ids, True)
        else:
            self.both(index, model, call, ids)

    @rule(data=st.data())
    def unpin_slots(self, data):
        """A load's rows let go by the slots its pin returned (some pinned twice, some dropped or freed since)."""
        index, model = self.pair(data)
        pinned = [s for s in range(model.cap) if model.pin_count[s]]
        self.both(index, model, "unpin_slots", self.slots(data, pinned))

    @rule(data=st.data(), call=st.sampled_from(["drop_slots", "set_free", "add_free"]))
    def slot_sets(self, data, call):
        index, model = self.pair(data)
        self.both(index, model, call, self.slots(data, range(model.cap)))

    @precondition(lambda self: self.count)  # after something was committed, now and then
    @rule(data=st.data(), keep_pinned=st.booleans())
    def forget(self, data, keep_pinned):
        index, model = self.pair(data)
        self.both(index, model, "forget", keep_pinned)

    @rule(data=st.data(), call=st.sampled_from(["slots", "run", "missing", "flags", "payloads"]))
    def lookups(self, data, call):
        index, model = self.pair(data)
        self.both(index, model, call, self.ids(data, model, want="any"))

    @rule(data=st.data(), shape=st.sampled_from(["both", "disk", "none", "other", "empty"]), touch=st.booleans())
    def held_by(self, data, shape, touch):
        (host, host_model), (disk, disk_model) = self.pairs
        ids = self.ids(data, host_model, want="registered")
        indexes, models = {"both": ([host, disk], [host_model, disk_model]), "disk": ([disk], [disk_model]),
                           "none": ([host, None], [host_model, None]), "other": ([host, "x"], [host_model, "x"]),
                           "empty": ([], [])}[shape]
        want, got = outcome(model_held_by, ids, models, touch), outcome(held_by, ids, indexes, touch)
        assert got == want, f"held_by({ids!r}, {shape}, touch={touch}): index {got!r}, model {want!r}"
        if touch and want[0] == "returned":  # indexes[0] remembers the run found: ``after_lookup`` hands it back
            self.looked_up = (self.pairs[shape == "disk"], ids) if shape != "empty" else None

    @precondition(lambda self: self.pairs[0][1].lru)  # host registers blocks
    @rule(data=st.data())
    def lookup(self, data):
        """A request's lookup in host: ids host registers (now and then one it does not), run found and touched."""
        (host, model), keys = self.pairs[0], [self.pairs[0][1].key[s] for s in self.pairs[0][1].lru]
        keys = data.draw(st.lists(st.sampled_from(keys), min_size=1, max_size=len(keys), unique=True), label="hit")
        keys += data.draw(st.lists(st.sampled_from(POOL), max_size=2), label="past the hit")
        ids = [data.draw(id_forms(k)) for k in keys]
        want, got = outcome(model_held_by, ids, [model], True), outcome(held_by, ids, [host], True)
        assert got == want, f"held_by({ids!r}, [host], touch=True): index {got!r}, model {want!r}"
        self.looked_up = ((host, model), ids)

    @precondition(lambda self: self.looked_up)
    @rule(data=st.data(), call=st.sampled_from(["pin", "unpin", "touch", "remove", "payloads", "reserve_missing"]))
    def after_lookup(self, data, call):
        """A load's calls on the ids its lookup (``held_by(..., touch=True)``) found (and the offload's
        ``reserve_missing`` of the node they became), as the lookup handed them or equal new objects (another
        case, raw bytes) or a prefix or with one replaced, and the index changed in between or not: a slot
        taken from what the lookup remembered must be the one the model finds now."""
        (index, model), ids = self.looked_up
        since = data.draw(st.sampled_from(["nothing", "left", "reused"]), label="its blocks since") if ids else ""
        if since in ("left", "reused"):  # some of its blocks left; their slots stay free, or new blocks take them
            gone = data.draw(st.lists(st.sampled_from(ids), max_size=len(ids), unique=True), label="gone")
            self.both(index, model, "remove", gone, False)
            new = [k.hex() for k in POOL if k not in model.table][: len(gone)] if since == "reused" else []
            rows = self.both(index, model, "reserve", new)
            if rows:
                self.both(index, model, "commit", rows[0], self.payloads(len(rows[0])))
        ids = list(ids)[: data.draw(st.integers(0, len(ids)), label="prefix")]
        if data.draw(st.booleans(), label="equal new objects"):  # the tree hands an offload new strings
            ids = [data.draw(id_forms(k)) if (k := _key_of(i)) is not None else i for i in ids]
        if ids and data.draw(st.integers(0, 3), label="one replaced?") == 0:
            ids[data.draw(st.integers(0, len(ids) - 1))] = data.draw(st.sampled_from(POOL_HEX))
        self.both(index, model, call, ids)

    # -- after every step ------------------------------------------------------------------------------
    @invariant()
    def agree(self):
        for index, model in self.pairs:
            counts = len(index), index.inflight_count(), index.pinned_count(), index.orphan_count(), index.free_count()
            assert counts == (len(model.lru), model.inflight, model.pinned, model.orphans, len(model.free))
            assert [index.state(s) for s in range(self.cap)] == model.state
            assert [index.payload(s) for s in range(self.cap)] == model.payload
            assert index.items() == model.items()
            assert index.flags(POOL) == model.flags(POOL) and index.missing(POOL) == model.missing(POOL)
            assert index.slots(POOL) == model.slots(POOL)
            assert [index.pins(k) for k in POOL] == [model.pins(k) for k in POOL]

    @invariant()
    def payloads_referenced_while_kept(self):
        kept = {id(model.payload[s]) for _, model in self.pairs for s in model.lru}
        for key in list(self.live):
            held = key in kept
            # the dict's reference, getrefcount's argument, and the model's and the index's while kept
            # (counted outside the assert: pytest's rewritten assert keeps its own reference)
            refs = sys.getrefcount(self.live[key])
            if refs > 2 + 2 * held:
                gc.collect()  # a cycle of the test's own (a traceback's frames) may still hold it
                refs = sys.getrefcount(self.live[key])
            assert refs == 2 + 2 * held, self.live[key]
            if not held:
                gone = weakref.ref(self.live.pop(key))
                assert gone() is None


TestBlockIndexAgainstModel = IndexMachine.TestCase
TestBlockIndexAgainstModel.settings = blocks_under_test.FUZZ
