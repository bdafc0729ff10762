"""The block state machine, per slot: legal paths work, every illegal transition raises and changes nothing."""

import pytest

from sglang_kvbm.core.lifecycle import BlockState, BlockStateError, SlotLifecycle
from sglang_kvbm.core.lru import LruIndex


def test_full_lifecycle_of_a_batch():
    slots = SlotLifecycle(8)
    slots.reserve([1, 2, 3])
    assert [slots.state(s) for s in (0, 1)] == [BlockState.FREE, BlockState.MUTABLE]
    slots.commit([1, 2, 3])
    slots.register([1, 2, 3])
    assert slots.count(BlockState.REGISTERED) == 3
    slots.drop([2])
    assert slots.state(2) is BlockState.FREE
    slots.reserve([2])  # a dropped block's slot is reusable


@pytest.mark.parametrize("steps", [["reserve"], ["reserve", "commit"]])
def test_drop_before_register_is_allowed(steps):
    slots = SlotLifecycle(4)
    for step in steps:
        getattr(slots, step)([0, 1])
    slots.drop([0, 1])
    assert slots.count(BlockState.FREE) == 4


@pytest.mark.parametrize(
    "steps, illegal",
    [
        ([], "commit"),  # nothing reserved
        ([], "register"),
        ([], "drop"),  # dropping what is not there
        (["reserve"], "register"),  # register before commit
        (["reserve"], "reserve"),  # a slot reserved twice
        (["reserve", "commit"], "commit"),  # commit twice
        (["reserve", "commit", "register"], "commit"),
        (["reserve", "commit", "register"], "register"),
        (["reserve", "commit", "register", "drop"], "drop"),
    ],
)
def test_illegal_transitions_raise_and_change_nothing(steps, illegal):
    slots = SlotLifecycle(4)
    for step in steps:
        getattr(slots, step)([1])
    slots.reserve([3])  # slot 3 is MUTABLE: dropping it is legal, so a batch [3, 1] is half legal
    companion = 3 if illegal == "drop" else 2  # slot 2 is FREE: legal for reserve only
    before = [slots.state(s) for s in range(4)]
    with pytest.raises(BlockStateError):
        getattr(slots, illegal)([companion, 1])
    assert [slots.state(s) for s in range(4)] == before  # the whole batch is checked before any slot moves


def test_lru_evicts_least_recent_and_never_a_pinned_block():
    lru = LruIndex()
    lru.add(["a", "b", "c"], [0, 1, 2])
    lru.touch(["a"])
    assert lru.pin(["b"]) == [1]
    assert lru.pop_victim() == ("c", 2)  # b is pinned, a was touched
    assert lru.pop_victim() == ("a", 0)
    assert lru.pop_victim() is None  # only the pinned block is left
    assert "b" in lru and lru.slot("b") == 1
    lru.unpin(["b"])
    assert lru.pop_victim() == ("b", 1)


def test_lru_walks_a_pinned_block_at_most_once_and_gives_up_at_once_when_all_are_pinned():
    lru = LruIndex()
    n = 100_000
    lru.add(range(n), range(n))
    lru.pin(list(range(n - 1)))  # all but the newest pinned
    assert lru.pop_victim() == (n - 1, n - 1)
    assert [b for b, _ in lru.items()[:3]] == [0, 1, 2]  # the pinned ones, moved warm once, in order
    assert lru.pinned_count() == n - 1
    assert lru.pop_victim() is None  # every block pinned: no walk at all
    lru.unpin([5])
    assert lru.pop_victim() == (5, 5)


def test_lru_pins_count_each_holder_and_touch_orders_a_prefix_head_last():
    lru = LruIndex()
    lru.add(["a", "b", "c", "d"], [0, 1, 2, 3])
    lru.pin(["a", "b"])
    lru.pin(["b", "c", "c"])  # two loads share b; a repeated id is two pins
    assert lru.pinned_count() == 3
    lru.unpin(["b", "c"])
    assert lru.pinned_count() == 3  # b and c are still held once each
    lru.unpin(["a", "b", "c"])
    assert lru.pinned_count() == 0
    lru.pin(["d"])
    lru.unpin(["d", "d", "x"])  # more unpins than pins, and an id never pinned: no negative count survives
    assert lru.pinned_count() == 0 and not lru.pinned("d")
    lru.pin(["d", "d"])
    lru.unpin(["d", "d"])  # a repeated id in one call: two unpins
    assert not lru.pinned("d")
    lru.touch(["c", "x", "a"])  # x is not held: ignored; the head (c) ends most recent
    assert [b for b, _ in lru.items()] == ["b", "d", "a", "c"]


def test_lru_pop_victims_matches_a_plain_model_of_the_policy():
    """The batch eviction (C fast path when the cold end is unpinned, else the walk) against a list model."""
    import random

    rng = random.Random(7)
    lru, order, pins = LruIndex(), [], {}  # order: least recent first
    for step in range(3000):
        op = rng.random()
        if op < 0.3:
            new = [b for b in (rng.randrange(200) for _ in range(rng.randint(1, 8))) if b not in order]
            new = list(dict.fromkeys(new))
            lru.add(new, [b + 1000 for b in new])
            order.extend(new)
        elif op < 0.45 and order:
            ids = rng.sample(order, min(len(order), rng.randint(1, 5)))
            lru.pin(ids)
            for b in ids:
                pins[b] = pins.get(b, 0) + 1
        elif op < 0.6 and pins:
            ids = rng.sample(sorted(pins), min(len(pins), rng.randint(1, 3)))
            lru.unpin(ids)
            for b in ids:
                pins[b] -= 1
                if not pins[b]:
                    del pins[b]
        elif op < 0.75 and order:
            ids = rng.sample(order, min(len(order), rng.randint(1, 5)))
            lru.touch(ids)
            for b in reversed(ids):
                order.remove(b)
                order.append(b)
        else:
            n = rng.randint(1, 10)
            expected, walked = [], 0
            while len(expected) < n and len(pins) < len(order) and walked < len(order):
                b = order.pop(0)
                if b in pins:
                    order.append(b)
                    walked += 1
                    continue
                expected.append((b, b + 1000))
            assert lru.pop_victims(n) == expected, step
        assert [b for b, _ in lru.items()] == order and lru.pinned_count() == len(pins)


def test_a_host_row_pinned_by_two_holders_is_reused_only_after_both_let_go():
    """A disk write and a G4 write pin one row; the tiers are forgotten; the first to end must not free the row."""
    from sglang_kvbm.core.ports import BlockMeta
    from sglang_kvbm.tiers.host.pool import HostBlockPool
    from sglang_kvbm.transfer.host_memory import aligned_empty

    pool = HostBlockPool(aligned_empty((2, 4096)))
    rows, _ = pool.reserve(["x"])
    pool.commit([BlockMeta("x", (1, 2), None, None)], rows)
    held = pool.pin(["x"])  # the disk write
    assert pool.pin(["x"]) == held  # the G4 write
    pool.forget()
    pool.release_orphans(held)  # the disk write ends
    assert pool.accounting()["orphaned"] == 1
    got, _ = pool.reserve(["y", "z"])
    assert held[0] not in got and len(got) == 1  # the G4 write still reads its row
    pool.release_orphans(held)  # the G4 write ends
    assert pool.accounting()["orphaned"] == 0 and pool.reserve(["w"])[0] == held


def test_pinned_host_memory_is_unregistered_before_it_is_unmapped(monkeypatch):
    """``aligned_empty(pin=True)`` hands ``cuda_copies.pin`` the object whose finalizer runs ``cudaHostUnregister``;
    that finalizer must run while the range is still mapped (a finalizer on the ``mmap`` itself runs after its
    munmap). CUDA cannot run here: ``pin`` is replaced by what it does besides registering (the finalizer)."""
    import gc
    import weakref

    from sglang_kvbm.transfer import cuda_copies
    from sglang_kvbm.transfer.host_memory import aligned_empty

    def mapped(address: int) -> bool:
        with open("/proc/self/maps") as maps:
            for line in maps:
                start, end = (int(x, 16) for x in line.split()[0].split("-"))
                if start <= address < end:
                    return True
        return False

    seen = []
    monkeypatch.setattr(cuda_copies, "pin", lambda memory, base: weakref.finalize(
        memory, lambda: seen.append(mapped(base))))
    slab = aligned_empty((4, 4096), pin=True)
    view = slab[1:3]
    base = slab.data_ptr()
    del slab
    gc.collect()
    assert seen == [] and mapped(base)  # a view keeps the memory
    del view
    gc.collect()
    assert seen == [True]
