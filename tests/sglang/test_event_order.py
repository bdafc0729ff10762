"""Event ordering: a store never reaches the router before its parent; held stores follow their parent."""

from sglang.srt.disaggregation.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

from sglang_kvbm.integration.sglang.compat import block_stored
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


# --- removals touch only the held stores that carry a removed block --------------------------------------------

import random  # noqa: E402

from sglang_kvbm.integration.sglang import event_order  # noqa: E402


def test_removal_examines_only_the_held_stores_it_names(monkeypatch):
    """60k orphans held; each removal must look at the stores carrying its blocks, not at all 60k."""
    o = EventOrderer(max_held=1 << 17)
    o.order([stored([1_000_000 + i], i, "DISK") for i in range(60_000)])  # parents 0..59999 unknown
    assert o.held() == 60_000
    seen = []
    real = event_order._medium
    monkeypatch.setattr(event_order, "_medium", lambda e: seen.append(e) or real(e))
    for i in range(100):
        assert o.order([removed([1_000_000 + i], "DISK")]) == []
    assert len(seen) <= 3 * 100, f"100 removals examined {len(seen)} events"
    assert o.held() == 60_000 - 100
    monkeypatch.undo()
    # What is left still follows its parent; what was removed never appears.
    assert links(o.order([stored([5], None, "GPU")])) == [("BlockStored", "GPU", (5,))]
    assert links(o.order([stored([150], None, "GPU")]))[-1] == ("BlockStored", "DISK", (1_000_150,))


def test_partial_removal_of_a_held_chain_keeps_the_part_before_it_under_the_same_parent():
    o = EventOrderer()
    o.order([stored([11, 12, 13, 14], 10, "DISK"), stored([12, 13], 10, "CPU_PINNED")])
    o.order([removed([13], "DISK")])
    assert o.held() == 2
    o.order([removed([12], "DISK")])  # the DISK chain is now [11]; 12 is no longer in it
    o.order([removed([11], "DISK")])
    assert o.held() == 1  # the CPU_PINNED store of 12, 13 is untouched by DISK removals
    out = o.order([stored([10], None, "GPU")])
    assert links(out) == [("BlockStored", "GPU", (10,)), ("BlockStored", "CPU_PINNED", (12, 13))]


def _random_stream(rng: random.Random, steps: int) -> list:
    media = ["GPU", "CPU_PINNED", "DISK"]
    events = []
    for _ in range(steps):
        roll = rng.random()
        if roll < 0.55:
            start = rng.randrange(60)
            hashes = list(range(start, min(start + rng.randint(1, 4), 64)))
            parent = None if start == 0 or rng.random() < 0.1 else start - 1 - rng.randrange(2)
            events.append(stored(hashes, parent, rng.choice(media)))
        elif roll < 0.98:
            events.append(removed(rng.sample(range(64), rng.randint(1, 5)), rng.choice(media)))
        else:
            events.append(AllBlocksCleared())
    return events


def test_same_stream_out_as_the_scanning_implementation():
    """The indexed removal against the original whole-list scan, on random streams, batch by batch."""
    import importlib.util
    import pathlib

    spec = importlib.util.spec_from_file_location("scan_orderer", pathlib.Path(__file__).parent / "scan_orderer.py")
    scan = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(scan)
    for seed in range(40):
        rng = random.Random(seed)
        new, old = EventOrderer(max_held=8), scan.EventOrderer(max_held=8)
        for _ in range(60):
            batch = _random_stream(rng, rng.randint(1, 6))
            assert new.order(batch) == old.order(batch), f"seed {seed}"
            assert (new.held(), new.dropped, new.held_total) == (old.held(), old.dropped, old.held_total)


def _metas(hashes, parent, *, salt=None, lora=None, bigram=False, links=None):
    from sglang_kvbm.core.pages import one_page

    out = []
    for n, h in enumerate(hashes):
        link = (links or {}).get(n, hashes[n - 1] if n else parent)
        tokens = tuple(range(h * 10, h * 10 + 4 + bigram))
        out.append(one_page(f"id{h}", tokens, parent_id=f"id{link}", event_hash=h, event_parent=link,
                            cache_salt=salt, lora_name=lora, bigram=bigram))
    return out


def test_sink_publishes_a_copy_in_one_event_exactly_as_sglangs_recorder_coalesces_its_pages():
    """The bulk path (one BlockStored per chained copy, built in C) against SGLang's recorder fed page by page."""
    from sglang.srt.disaggregation.kv_events import StorageMedium
    from sglang.srt.mem_cache.events import KVCacheEventRecorder

    from sglang_kvbm.core.pages import one_page
    from sglang_kvbm.core.tiers import Tier
    from sglang_kvbm.integration.sglang.events import SglangEventSink

    cases = [
        _metas([1, 2, 3, 4], None),  # a chain: one event
        _metas([5, 6, 7], 4, salt="s", lora="l"),  # namespaced
        _metas([8, 9, 10], 7, links={2: 1}),  # a broken link: two events
        _metas([11, 12], 10, bigram=True),  # EAGLE pairs: page by page
        _metas([13, 14], 12) + [one_page("x", (1, 2, 3, 4), parent_id="id14")],  # a page without identity
        _metas([15], None) + _metas([16], 15, salt="other"),  # two namespaces
    ]
    for metas in cases:
        sink = SglangEventSink(True, 4)
        sink.stored(Tier.HOST, metas)
        reference = KVCacheEventRecorder(enabled=True, page_size=4)
        for meta in metas:
            if meta.event_hash is None:
                continue
            tokens = list(meta.token_ids)
            if meta.bigram:
                tokens = list(zip(tokens[:-1], tokens[1:]))
            reference.enqueue(block_stored(
                block_hashes=[meta.event_hash], parent_block_hash=meta.event_parent,
                token_ids=tokens, block_size=len(tokens), lora_id=None, medium=StorageMedium.CPU,
                cache_salt=meta.cache_salt, lora_name=meta.lora_name))
        assert sink.take() == reference.take()
    sink = SglangEventSink(True, 4)
    sink.stored(Tier.DISK, cases[0])
    sink.removed(Tier.DISK, cases[4])
    taken = sink.take()
    assert len(taken) == 2 and taken[0].block_hashes == [1, 2, 3, 4] and taken[0].block_size == 4
    assert taken[1] == BlockRemoved(block_hashes=[13, 14], medium=StorageMedium.DISK)
