"""Event ordering: a store never reaches the router before its parent; held stores follow their parent."""

from sglang.srt.disaggregation.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

from sglang_kvbm.integration.sglang.event_order import EventOrderer


def stored(hashes, parent, medium):
    return BlockStored(block_hashes=list(hashes), parent_block_hash=parent, token_ids=[0] * 4 * len(hashes),
                       block_size=4, lora_id=None, medium=medium)


def removed(hashes, medium):
    return BlockRemoved(block_hashes=list(hashes), medium=medium)


def links(events):
    return [(type(e).__name__, getattr(e, "medium", None), tuple(getattr(e, "block_hashes", ()))) for e in events]


def test_in_order_events_pass_unchanged():
    o = EventOrderer()
    events = [stored([1, 2], None, "GPU"), stored([1, 2], None, "CPU_PINNED"), removed([2], "GPU")]
    assert o.order(events) == events


def test_orphan_waits_for_its_parent_in_any_tier():
    o = EventOrderer()
    assert o.order([stored([3], 2, "DISK")]) == []  # parent 2 unknown to the router
    assert o.held() == 1
    out = o.order([stored([1], None, "GPU"), stored([2], 1, "CPU_PINNED")])
    assert links(out) == [("BlockStored", "GPU", (1,)), ("BlockStored", "CPU_PINNED", (2,)), ("BlockStored", "DISK", (3,))]
    assert o.held() == 0


def test_parent_leaving_every_tier_makes_the_next_child_wait():
    o = EventOrderer()
    o.order([stored([1, 2], None, "GPU")])
    o.order([removed([1, 2], "GPU")])
    assert o.order([stored([2], 1, "DISK")]) == []
    assert links(o.order([stored([1], None, "CPU_PINNED")]))[-1] == ("BlockStored", "DISK", (2,))


def test_held_store_whose_block_goes_first_is_never_published_nor_removed():
    o = EventOrderer()
    o.order([stored([5, 6], 4, "DISK")])
    assert o.order([removed([6], "DISK")]) == []  # the router never saw 6 on disk
    out = o.order([stored([4], None, "GPU")])
    assert links(out) == [("BlockStored", "GPU", (4,)), ("BlockStored", "DISK", (5,))]


def test_removal_of_a_block_the_tier_never_announced_is_suppressed():
    o = EventOrderer()
    o.order([stored([1], None, "GPU")])
    assert o.order([removed([1], "CPU_PINNED")]) == []
    assert links(o.order([removed([1], "GPU")])) == [("BlockRemoved", "GPU", (1,))]


def test_clear_forgets_everything_held_and_known():
    o = EventOrderer()
    o.order([stored([1], None, "GPU"), stored([9], 8, "DISK")])
    out = o.order([AllBlocksCleared(), stored([2], 1, "CPU_PINNED")])
    assert links(out) == [("AllBlocksCleared", None, ())]
    assert o.held() == 1 and not o.known(1)


def test_hold_list_is_bounded_and_counts_drops():
    o = EventOrderer(max_held=2)
    o.order([stored([i + 100], i, "DISK") for i in range(5)])
    assert o.held() == 2 and o.dropped == 3
