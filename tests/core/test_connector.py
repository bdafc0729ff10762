"""The core and the block manager on plain CPU tensors (no SGLang): copies, tickets, LRU, failures."""

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from conftest import RecordingSink
from sglang_kvbm.core.connector import KvbmConnector
from sglang_kvbm.core.identity import chain_hashes
from sglang_kvbm.core.pages import one_page
from sglang_kvbm.core.ports import StoreRequest
from sglang_kvbm.core.tiers import Tier
from sglang_kvbm.manager.block_manager import LocalBlockManager
from sglang_kvbm.transfer import copies
from sglang_kvbm.transfer.indexes import index
from sglang_kvbm.transfer.kv_layout import PagedKvLayout

PAGE = 4


def make(host_blocks=16, pages=32, executor=None):
    # Two "layers" of K and V (word-aligned) plus an odd-sized buffer that forces byte copies.
    buffers = [torch.randn(pages * PAGE, 2, 8) for _ in range(4)] + [torch.randn(pages * PAGE, 1, 5)]
    layout = PagedKvLayout(buffers, PAGE, layers=[(0, 2, 4), (1, 3)])
    sink = RecordingSink()
    manager = LocalBlockManager(layout, host_blocks, executor=executor)
    return KvbmConnector(manager, sink, page_size=PAGE), manager, layout, sink


def request(tokens, pages) -> StoreRequest:
    ids = tuple(chain_hashes(tokens, PAGE))

    def describe(positions):
        return [one_page(ids[p], tuple(tokens[p * PAGE : (p + 1) * PAGE]), parent_id=ids[p - 1] if p else None)
                for p in positions]

    slots = torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in pages])
    return StoreRequest(ids, slots, describe)


def load(manager, layout, ids, pages):
    plan = manager.acquire(ids)
    assert plan is not None
    slots = torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in pages])
    batch = copies.load_batch(layout, manager.load_parts(plan, layout.pages_of(slots)))
    for layer in range(layout.num_layers):
        copies.load_layer(layout, batch, layer)
    manager.release(plan)
    return plan


def test_layout_pads_blocks_for_o_direct_and_maps_layers():
    _, _, layout, _ = make()
    assert layout.page_bytes == 4 * PAGE * 2 * 8 * 4 + PAGE * 5 * 4
    assert layout.block_bytes % 4096 == 0 and layout.block_bytes >= layout.page_bytes
    assert layout.num_layers == 2


@pytest.mark.parametrize("pages,rows", [([3, 4, 5], [0, 1, 2]), ([9, 2, 7], [5, 0, 3]), ([3, 4, 5], [7, 1, 4])])
def test_save_and_per_layer_load_move_exact_bytes(pages, rows):
    _, _, layout, _ = make()
    host = layout.host_slab(8, pin=False)
    before = [layout.read_page(p) for p in pages]
    layout.save(index(pages), host, index(rows))
    targets = [20, 21, 30]
    for layer in range(layout.num_layers):
        layout.load_layer(layer, host, index(rows), index(targets))
    for page, want in zip(targets, before):
        assert torch.equal(layout.read_page(page), want)


def test_one_layer_loads_only_its_own_buffers():
    _, _, layout, _ = make()
    host = layout.host_slab(2, pin=False)
    layout.save(index([1]), host, index([0]))
    target_before = layout.read_page(9)
    layout.load_layer(1, host, index([0]), index([9]))  # buffers 1 and 3 only
    after = layout.read_page(9)
    source = layout.read_page(1)
    spans = list(zip(layout.buffer_offsets, layout.buffer_page_bytes))
    for b, (off, n) in enumerate(spans):
        want = source if b in (1, 3) else target_before
        assert torch.equal(after[off : off + n], want[off : off + n]), b


def test_store_poll_lookup_load_roundtrip():
    connector, manager, layout, sink = make()
    tokens = list(range(24))
    pages = [5, 6, 7, 20, 21, 22]
    original = [layout.read_page(p) for p in pages]
    assert connector.offload(request(tokens, pages))
    assert connector.flush(timeout=30)
    assert connector.completed_offloads() == 1 and connector.pop_completed_offload() is True
    ids = chain_hashes(tokens, PAGE)
    assert sink.calls == [("stored", Tier.HOST, ids)]
    assert connector.lookup("r", ids + chain_hashes(list(range(30)), PAGE)[6:]) == 6
    load(manager, layout, ids, [0, 1, 2, 3, 4, 8])
    for page, want in zip([0, 1, 2, 3, 4, 8], original):
        assert torch.equal(layout.read_page(page), want)
    assert connector.stats.offload_blocks_d2h == 6


def test_held_pages_are_not_copied_again():
    connector, manager, _, _ = make()
    assert connector.offload(request(list(range(8)), [1, 2]))
    assert connector.offload(request(list(range(8)), [1, 2]))  # in flight: held
    connector.flush(timeout=30)
    assert connector.offload(request(list(range(8)), [3, 4]))  # registered: held
    connector.flush(timeout=30)
    assert manager.offloads.stats.stores_submitted == 1
    assert [connector.pop_completed_offload() for _ in range(connector.completed_offloads())] == [True] * 3


def test_lru_evicts_a_chain_from_its_tail():
    connector, manager, _, sink = make(host_blocks=4)
    a, b = list(range(16)), list(range(100, 108))
    connector.offload(request(a, [1, 2, 3, 4]))
    connector.flush(timeout=30)
    connector.offload(request(b, [5, 6]))
    connector.flush(timeout=30)
    ids_a = chain_hashes(a, PAGE)
    assert [c for c in sink.calls if c[0] == "removed"] == [("removed", Tier.HOST, [ids_a[3], ids_a[2]])]
    assert connector.lookup("r", ids_a) == 2  # the head of the chain survives


def test_failed_copy_is_dropped_unseen():
    connector, manager, _, sink = make()
    bad = request(list(range(8)), [1, 2])
    bad = StoreRequest(bad.block_ids, torch.tensor([4, 5, 6, 7, 40_000, 40_001, 40_002, 40_003]), bad.describe)
    assert connector.offload(bad)  # page 10000 does not exist: the copy raises
    connector.flush(timeout=30)
    assert connector.completed_offloads() == 1 and connector.pop_completed_offload() is False
    assert sink.calls == []
    assert connector.lookup("r", list(bad.block_ids)) == 0
    assert manager.offloads.stats.store_failures == 1
    assert manager.host.accounting()["free"] == manager.host.capacity


def test_no_room_stores_a_prefix_only_and_says_so():
    gate = threading.Event()
    executor = ThreadPoolExecutor(max_workers=1)
    executor.submit(gate.wait, 60)
    connector, manager, _, _ = make(host_blocks=3, executor=executor)
    try:
        assert connector.offload(request(list(range(20)), [1, 2, 3, 4, 5]))
        assert manager.host.accounting()["free"] == 0
        assert manager.offloads.stats.blocks_not_stored_no_room == 2
        assert connector.offload(request(list(range(50, 54)), [9]))  # all rows in flight: nothing to evict
    finally:
        gate.set()
    connector.flush(timeout=30)
    assert [connector.pop_completed_offload() for _ in range(connector.completed_offloads())] == [False, False]
    assert connector.lookup("r", chain_hashes(list(range(20)), PAGE)) == 3


def test_priority_below_the_threshold_is_not_taken():
    connector, manager, _, _ = make()
    connector = KvbmConnector(manager, RecordingSink(), page_size=PAGE, min_offload_priority=50)
    assert not connector.offload(request(list(range(8)), [1, 2]), priority=10)
    assert connector.offload(request(list(range(8)), [1, 2]), priority=50)


@pytest.mark.parametrize("host_blocks", [0, -1])
def test_host_pool_must_have_room(host_blocks):
    with pytest.raises(ValueError):
        make(host_blocks=host_blocks)
