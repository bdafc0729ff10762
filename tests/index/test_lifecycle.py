"""The compiled block index (``csrc/block_index.h``): the block state machine per slot, LRU with pins, ids.

Legal paths work; every illegal transition raises and changes nothing; eviction matches a plain model of the
policy over thousands of random operations; ids are SGLang's hex storage hashes or their 32 raw bytes.
"""

import hashlib
import random

import pytest
from blocks_under_test import IDS, index_with  # the build under test, before the index

from sglang_kvbm._blocks import BlockIndex, held_by
from sglang_kvbm.core.lifecycle import BlockState, BlockStateError


def test_full_lifecycle_of_a_batch():
    index = BlockIndex(8)
    slots, evicted = index.reserve(IDS[:3])
    assert slots == [0, 1, 2] and evicted == []  # rows go out in ascending order: a burst is contiguous
    assert [index.state(s) for s in (0, 3)] == [BlockState.MUTABLE, BlockState.FREE]
    assert index.holds(IDS[0]) and not index.registered(IDS[0]) and index.inflight_count() == 3
    index.commit(slots, ["a", "b", "c"])
    assert len(index) == 3 and index.inflight_count() == 0 and index.state(1) == BlockState.REGISTERED
    assert index.remove([IDS[1]]) == ["b"] and index.state(1) == BlockState.FREE
    assert index.reserve([IDS[1]])[0] == [1]  # a dropped block's slot is reusable


def test_a_lookup_finds_a_run_in_its_next_slots_and_only_what_a_slot_holds_now():
    """Ids stored together sit in consecutive slots, so a lookup tries the slot after the previous id's before
    the table. A block that left its slot (its bytes still there) is not found in it; one stored elsewhere since
    is found through the table, and the run goes on from there."""
    a, b, c, d = IDS[:4]
    index = BlockIndex(8)
    slots, _ = index.reserve([a, b, c])
    index.commit(slots, ["a", "b", "c"])
    assert slots == [0, 1, 2] and index.run([a, b, c]) == 3 and index.slots([a, b, c]) == [0, 1, 2]
    index.remove([b])  # slot 1 still has b's key in it: unmapped, it holds nothing
    assert index.missing([a, b, c]) == [1] and index.run([a, b, c]) == 1 and index.flags([a, b, c]) == b"\x01\x00\x01"
    assert held_by([a, b, c], [index], False) == b"\x01"
    index.commit(index.reserve([d])[0], ["d"])  # d takes slot 1 (the lowest free)
    index.commit(index.reserve([b])[0], ["b2"])  # b comes back in slot 3
    assert index.slots([a, b, c, d]) == [0, 3, 2, 1] and index.run([a, b, c]) == 3 and index.missing([a, d, b]) == []
    assert list(index.pin([a, b, c])) == [0, 3, 2] and index.payloads([a, b, c]) == ["a", "b2", "c"]


def test_abort_frees_a_copys_slots_and_leaves_registered_ones_alone():
    index = BlockIndex(4)
    slots, _ = index.reserve(IDS[:3])
    index.commit(slots[:1], ["a"])
    index.abort(slots)  # the failed copy's pages: the first was registered meanwhile (a partial commit)
    assert len(index) == 1 and not index.holds(IDS[1]) and index.free_count() == 3
    assert index.inflight_count() == 0


@pytest.mark.parametrize("illegal", ["commit FREE", "commit twice", "reserve held", "reserve twice in one call"])
def test_illegal_transitions_raise_and_change_nothing(illegal):
    index = BlockIndex(4)
    slots, _ = index.reserve(IDS[:1])  # slot 0 MUTABLE: committing it alone would be legal
    before = [index.state(s) for s in range(4)], index.free_count(), index.inflight_count()
    with pytest.raises(ValueError if illegal == "reserve twice in one call" else BlockStateError):
        if illegal == "commit FREE":
            index.commit([0, 2], ["a", "b"])  # half legal: slot 2 is FREE
        elif illegal == "commit twice":
            index.commit(slots, ["a"])
            before = [index.state(s) for s in range(4)], index.free_count(), index.inflight_count()
            index.commit(slots, ["a"])
        elif illegal == "reserve held":
            index.reserve([IDS[1], IDS[0]])  # IDS[0] is being written already
        else:
            index.reserve([IDS[1], IDS[2], IDS[1]])
    assert ([index.state(s) for s in range(4)], index.free_count(), index.inflight_count()) == before


def test_ids_are_hex_storage_hashes_or_their_bytes_and_anything_else_is_refused():
    index = index_with(1)
    assert index.registered(bytes.fromhex(IDS[0])) and index.registered(IDS[0].upper())
    for bad in ["a", IDS[0][:63], IDS[0][:63] + "g", IDS[0][:63] + "\xe1", b"\x00" * 31, 7, None]:
        with pytest.raises((ValueError, TypeError)):
            index.holds(bad)
    rng = random.Random(3)
    for _ in range(2000):  # the vectorized parse against Python's, on random digests
        raw = rng.randbytes(32)
        assert index.registered(raw.hex()) == index.registered(raw) is False
    for position in (0, 17, 63):  # every character class at a few positions: only hex digits pass
        for code in range(256):
            text = IDS[1][:position] + chr(code) + IDS[1][position + 1 :]
            ok = chr(code) in "0123456789abcdefABCDEF"
            try:
                index.holds(text)
            except ValueError:
                assert not ok, (position, code)
            else:
                assert ok, (position, code)


def test_lru_evicts_least_recent_and_never_a_pinned_block():
    index = index_with(3, capacity=3)  # most recent first: IDS[0], IDS[1], IDS[2]
    index.touch([IDS[2]])
    assert list(index.pin([IDS[1]])) == [1]
    slots, evicted = index.reserve(IDS[3:5])
    assert evicted == ["m0", "m2"] and sorted(slots) == [0, 2]  # IDS[1] pinned; IDS[2] was touched after IDS[0]
    assert index.reserve(IDS[5:6]) == ([], [])  # only the pinned block is left to evict, and it is pinned
    index.unpin([IDS[1]])
    assert index.reserve(IDS[5:6])[1] == ["m1"]


def test_lru_walks_a_pinned_block_at_most_once_and_gives_up_at_once_when_all_are_pinned():
    n = 4000
    index = index_with(n, capacity=n)  # least recent: IDS[n-1]
    index.pin(IDS[1:n])  # all but the most recent pinned
    assert index.reserve(IDS[n : n + 1])[1] == ["m0"]
    assert [p for _, p in index.items()[:3]] == [f"m{n - 1}", f"m{n - 2}", f"m{n - 3}"]  # walked warm once, in order
    assert index.pinned_count() == n - 1
    assert index.reserve(IDS[n + 1 : n + 2]) == ([], [])  # every block pinned: no walk at all
    index.unpin([IDS[5]])
    assert index.reserve(IDS[n + 1 : n + 2])[1] == ["m5"]


def test_lru_pins_count_each_holder_and_touch_orders_a_prefix_head_last():
    a, b, c, d, x = IDS[:4] + [IDS[100]]
    index = index_with(4)
    index.pin([a, b])
    index.pin([b, c, c])  # two loads share b; a repeated id is two pins
    assert index.pinned_count() == 3 and index.pins(c) == 2
    index.unpin([b, c])
    assert index.pinned_count() == 3  # b and c are still held once each
    index.unpin([a, b, c])
    assert index.pinned_count() == 0
    index.pin([d])
    index.unpin([d, d, x])  # more unpins than pins, and an id never held: no negative count survives
    assert index.pinned_count() == 0 and not index.pinned(d)
    with pytest.raises(KeyError):
        index.pin([a, x])  # x is not registered: nothing is pinned
    assert index.pinned_count() == 0
    index.touch([c, x, a])  # x is not held: ignored; the head (c) ends most recent
    assert [p for _, p in index.items()] == ["m3", "m1", "m0", "m2"]


def test_eviction_matches_a_plain_model_of_the_policy():
    """Reserve's evictions, pins, touches and removals against a list model, over thousands of random steps."""
    rng = random.Random(7)
    capacity = 64
    index, order, pins = BlockIndex(capacity), [], {}  # order: registered, least recent first
    for step in range(4000):
        op = rng.random()
        if op < 0.35:
            new = [b for b in dict.fromkeys(rng.randrange(300) for _ in range(rng.randint(1, 6)))
                   if b not in order]
            slots, evicted = index.reserve([IDS[b] for b in new])
            expected, walked, short = [], 0, len(new) - (capacity - len(order))
            while len(expected) < short and len(pins) < len(order) and walked < len(order):
                b = order.pop(0)
                if b in pins:
                    order.append(b)
                    walked += 1
                    continue
                expected.append(b)
            assert evicted == expected, step
            taken = new[: len(slots)]
            if rng.random() < 0.2:
                index.abort(slots)
            else:
                index.commit(slots, taken)
                order.extend(reversed(taken))
        elif op < 0.5 and order:
            ids = rng.sample(order, min(len(order), rng.randint(1, 4)))
            index.pin([IDS[b] for b in ids])
            for b in ids:
                pins[b] = pins.get(b, 0) + 1
        elif op < 0.65 and pins:
            ids = rng.sample(sorted(pins), min(len(pins), rng.randint(1, 3)))
            index.unpin([IDS[b] for b in ids])
            for b in ids:
                pins[b] -= 1
                if not pins[b]:
                    del pins[b]
        elif op < 0.85 and order:
            ids = rng.sample(order, min(len(order), rng.randint(1, 5)))
            index.touch([IDS[b] for b in ids])
            for b in reversed(ids):
                order.remove(b)
                order.append(b)
        elif order:
            ids = rng.sample(order, min(len(order), 2))
            removed = index.remove([IDS[b] for b in ids], skip_pinned=True)
            gone = [b for b in ids if b not in pins]
            assert removed == gone, step
            for b in gone:
                order.remove(b)
        assert [p for _, p in index.items()] == order and index.pinned_count() == len(pins), step
        assert index.free_count() == capacity - len(order), step


def test_held_by_reports_each_index_per_block_up_to_the_first_held_nowhere():
    host, disk = index_with(2), BlockIndex(8)
    slots, _ = disk.reserve(IDS[1:4])
    disk.commit(slots, ["d1", "d2", "d3"])
    assert held_by(IDS[:6], [host, disk]) == bytes([1, 3, 2, 2])
    assert held_by(IDS[4:], [host, disk]) == b""


def test_a_load_after_its_lookup_finds_the_slots_the_blocks_are_in_now():
    """``held_by(touch=True)`` remembers the run it found for the calls that follow on the same ids (a
    load's ``pin``, ``metas_of``); a slot remembered is taken only while it still registers that block."""
    index = index_with(4, capacity=4)
    ids = list(IDS[:4])
    assert held_by(ids, [index], True) == bytes([1, 1, 1, 1])
    rows = index.slots(ids)
    assert list(index.pin(ids[:3])) == rows[:3] and index.payloads(ids) == ["m0", "m1", "m2", "m3"]
    index.unpin(ids[:3])
    assert index.remove(ids[1:2], True) == ["m1"]  # gone: its slot free
    with pytest.raises(KeyError):
        index.pin(ids)
    slot, _ = index.reserve(IDS[4:5])  # the slot holds another block now
    index.commit(slot, ["m4"])
    assert slot == rows[1:2] and index.payloads(ids) == ["m0", "m2", "m3"]
    with pytest.raises(KeyError):
        index.pin(ids[:2])
    assert index.remove(ids[:1], True) == ["m0"]  # back in another slot
    slot, _ = index.reserve(ids[1:2])
    index.commit(slot, ["m1 again"])
    assert slot == rows[:1] and list(index.pin(ids[1:3])) == [rows[0], rows[2]]


def test_the_offload_of_what_a_lookup_found_takes_its_slots_from_equal_ids_while_they_still_hold_them():
    """The tree hands the offload of a loaded node its keys as new strings, equal to the ones its lookup found
    (at page size 1, most of an offload's ids): ``reserve_missing`` takes the remembered slots by content, so
    those are held, and a block that left since (its slot reused) is missing again."""
    index = index_with(4, capacity=8)
    found = list(IDS[:4])
    assert held_by(found + [IDS[4]], [index], True) == bytes([1, 1, 1, 1])
    offered = [i.upper() for i in found] + [bytes.fromhex(i) for i in IDS[4:6]]  # equal, not the same objects
    assert index.reserve_missing(offered)[:2] == ([4, 5], [4, 5])
    index.abort([4, 5])
    assert index.remove(found[2:3], True) == ["m2"]  # gone: its slot free, then another block in it
    slot, _ = index.reserve(IDS[7:8])
    index.commit(slot, ["m7"])
    todo, rows, _ = index.reserve_missing([(i + " ")[:-1] for i in found])
    assert todo == [2] and index.holds(found[2]) and index.registered(IDS[7]) and rows != slot
    assert list(index.pin([i.upper() for i in found[:2]])) == index.slots(found[:2])


def test_forget_keeps_a_pinned_or_written_slot_until_its_holders_let_go():
    index = index_with(3, capacity=4)
    index.pin([IDS[0]])
    index.pin([IDS[0]])  # two holders (a disk write and a G4 write read one host row)
    writing, _ = index.reserve(IDS[3:4])
    assert sorted(index.forget(True)) == [1, 2]  # the unpinned blocks' slots are free at once
    assert len(index) == 0 and not index.holds(IDS[0]) and index.orphan_count() == 2
    index.release_orphans([0])  # the first holder ends
    assert index.reserve(IDS[10:13])[0] == [1, 2]  # the orphans' rows are not handed out
    index.abort(writing)  # the write of the forgotten generation ends
    index.release_orphans([0])  # so does the second holder
    assert index.orphan_count() == 0 and sorted(index.reserve(IDS[20:22])[0]) == [0, 3]


def test_a_segment_gone_takes_its_slots_out_until_it_is_recreated():
    index = BlockIndex(8, False)  # a disk index: no slot usable before the segments are known
    assert index.reserve(IDS[:1]) == ([], [])
    index.restore([5], [IDS[0]], ["h0"])
    index.set_free([0, 1, 2, 3])
    writing, _ = index.reserve(IDS[1:3])
    assert writing == [0, 1]
    assert index.drop_slots([0, 1, 5]) == ["h0"]  # the segment with slots 0, 1 and 5 is gone
    index.abort(writing)
    assert index.free_count() == 2 and index.reserve(IDS[3:6])[0] == [2, 3]
    index.add_free([0, 1, 5])  # recreated
    assert sorted(index.reserve(IDS[6:9])[0]) == [0, 1, 5]


def test_digest_bytes_and_hex_are_one_key():
    digest = hashlib.sha256(b"page").digest()
    index = BlockIndex(2)
    index.commit(index.reserve([digest])[0], ["p"])
    assert index.slot(digest.hex()) == 0 and index.payloads([digest.hex(), IDS[0]]) == ["p"]
