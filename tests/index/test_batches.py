"""Each call of the compiled block index checks its whole batch before it changes anything.

One test per defect a differential fuzzer found in the first version (each fails there: a self-linked LRU,
a spin holding the GIL, a segfault, a use-after-free, a NULL string, and calls that changed slots and then
raised), plus the garbage collector's view of the payloads an index keeps.
"""

import gc
import subprocess
import sys
import textwrap
import weakref

import pytest
from blocks_under_test import IDS, index_with  # the build under test, before the index

from sglang_kvbm._blocks import BlockIndex, BlockStateError, held_by
from sglang_kvbm.core.identity import chain_hashes


def snapshot(index: BlockIndex):
    """Everything a caller can see of an index."""
    return (len(index), index.inflight_count(), index.pinned_count(), index.orphan_count(), index.free_count(),
            [index.state(s) for s in range(index.capacity)], index.items(), [index.pins(i) for i in IDS])


def test_a_slot_twice_in_commit_is_refused_and_the_lru_stays_a_list():
    index = BlockIndex(4)
    (slot,), _ = index.reserve(IDS[:1])
    before = snapshot(index)
    with pytest.raises(ValueError, match=f"slot {slot} appears twice"):
        index.commit([slot, slot], ["a", "b"])
    assert snapshot(index) == before and index.inflight_count() == 1  # no underflow, no second link
    index.commit([slot], ["a"])
    assert len(index) == 1 and index.items() == [(slot, "a")] and index.inflight_count() == 0


def test_the_sequence_that_spun_holding_the_gil_now_ends():
    """commit([s, s]) accepted, two removes, then an evicting reserve: KeyTable::erase looped forever."""
    script = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {str(__import__("pathlib").Path(__file__).parent)!r})
        import blocks_under_test  # the build under test (KVBM_BLOCKS_SO)
        from sglang_kvbm._blocks import BlockIndex
        ids = [bytes([n]) * 32 for n in range(1, 8)]
        index = BlockIndex(2)
        (s,), _ = index.reserve(ids[:1])
        try:
            index.commit([s, s], ["a", "b"])
        except ValueError:
            index.commit([s], ["a"])
        index.remove(ids[:1]); index.remove(ids[:1])
        slots, _ = index.reserve(ids[1:3]); index.commit(slots, ["b", "c"])
        print(index.reserve(ids[3:5])[1])
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "['c', 'b']", done.stderr[-2000:]


@pytest.mark.parametrize("bad", [None, "index", 3, object()])
def test_held_by_refuses_what_is_not_an_index(bad):
    index = index_with(2)
    with pytest.raises(TypeError, match="BlockIndex"):
        held_by(IDS[:2], [index, bad])
    assert held_by(IDS[:3], [index]) == b"\x01\x01"


def test_an_index_method_that_changes_the_list_cannot_make_the_call_read_freed_items():
    """An ``__index__`` that changes the list it is in: the call reads the list as it is after each one."""
    ids = chain_hashes(list(range(1100)), 1)
    index = BlockIndex(1024)
    index.reserve(ids[:1002])  # slots 0-1001 being written

    class Shrinks:
        def __index__(self):
            batch.clear()  # frees the list's array and the two ints: the first version read them anyway
            batch.extend([None, 7])
            return 5

    batch = [Shrinks(), int("1000"), int("1001")]
    index.abort(batch)  # aborts 5 and 7, never 1000 or 1001
    assert [index.state(s) for s in (5, 7, 1000, 1001)] == [0, 0, 1, 1] and index.inflight_count() == 1000

    class Grows:
        def __index__(self):
            batch.extend([1, 2, 3])
            return 0

    batch = [Grows()]
    index.abort(batch)  # the items added meanwhile are read too
    assert [index.state(s) for s in range(5)] == [0, 0, 0, 0, 1] and index.inflight_count() == 996


SURROGATE = "\ud800"


def test_an_id_whose_repr_is_not_text_is_a_value_error_and_leaks_nothing():
    class Odd(str):
        def __repr__(self):
            return SURROGATE

    class Fails(str):
        def __repr__(self):
            raise RuntimeError("no repr")

    index = index_with(1)
    refs = sys.getrefcount(SURROGATE)
    for _ in range(100):
        with pytest.raises(ValueError, match=r"\\ud800"):
            index.holds(Odd("not 64 characters"))
    assert sys.getrefcount(SURROGATE) == refs
    with pytest.raises(ValueError, match="Fails"):
        index.registered(Fails("short"))
    with pytest.raises(TypeError, match="not NoneType"):
        index.touch([None])


def test_reserve_with_an_id_twice_evicts_nothing():
    index = index_with(4, capacity=4)  # full: a reserve must evict
    before = snapshot(index)
    with pytest.raises(ValueError, match=f"block {IDS[4]} appears twice"):
        index.reserve([IDS[4], IDS[5], IDS[4]])
    assert snapshot(index) == before  # the first version evicted first: those payloads were lost
    assert index.reserve(IDS[4:6])[1] == ["m3", "m2"]


def test_restore_refused_anywhere_in_its_batch_restores_nothing():
    index = BlockIndex(4, False)
    index.set_free([2, 3])
    index.restore([1], [IDS[9]], ["h9"])
    before = snapshot(index)
    for slots, ids in [([0, 1], IDS[:2]), ([0, 3], [IDS[0], IDS[9]]), ([0, 0], IDS[:2]), ([0, 3], [IDS[0], IDS[0]]),
                       ([0, 3], [IDS[0], "not an id"]), ([0, 9], IDS[:2])]:
        with pytest.raises((BlockStateError, ValueError, IndexError)):
            index.restore(slots, ids, ["a", "b"])
        assert snapshot(index) == before, (slots, ids)
    assert sorted(index.reserve(IDS[20:22])[0]) == [2, 3] and index.free_count() == 0  # the free slots, once each


def test_set_free_refused_keeps_the_free_list():
    index = BlockIndex(4, False)
    index.set_free([0, 1])
    index.restore([3], [IDS[0]], ["h"])
    before = snapshot(index)
    with pytest.raises(BlockStateError, match="slot 3 is in use"):
        index.set_free([2, 3])
    with pytest.raises(ValueError, match="slot 2 appears twice"):
        index.set_free([2, 2])
    assert snapshot(index) == before and index.reserve(IDS[1:3])[0] == [0, 1]


def test_add_free_lists_a_slot_once():
    index = BlockIndex(2)
    index.add_free([0, 1])  # both free already
    assert index.free_count() == 2
    with pytest.raises(ValueError, match="slot 1 appears twice"):
        index.add_free([1, 1])
    slots, _ = index.reserve(IDS[:4])
    assert slots == [0, 1]  # the first version handed slot 0 out twice


@pytest.mark.parametrize("call", ["touch", "unpin", "pin", "remove"])
def test_a_bad_id_anywhere_refuses_the_whole_batch(call):
    index = index_with(3)
    index.pin(IDS[:3])
    before = snapshot(index)
    batch = [IDS[2], IDS[1], "not an id"] if call != "touch" else ["not an id", IDS[2], IDS[1]]  # touch: back to front
    with pytest.raises(ValueError):
        getattr(index, call)(batch)
    assert snapshot(index) == before


@pytest.mark.parametrize("slots", [[-1], [8], [None], ["0"], [2**70]])
def test_release_orphans_checks_its_batch_with_no_orphans_too(slots):
    index = index_with(2)
    with pytest.raises((IndexError, TypeError)):
        index.release_orphans(slots)


def test_a_payload_that_refers_to_its_index_is_collected():
    class Meta:
        pass

    index = BlockIndex(2)
    meta = Meta()
    meta.index = index  # a payload holding its own index: a cycle only the collector can see
    slots, _ = index.reserve(IDS[:1])
    index.commit(slots, [meta])
    gone = weakref.ref(meta)
    del index, meta
    gc.collect()
    assert gone() is None
