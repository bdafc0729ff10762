"""The core over the real local backend, on plain CPU tensors (no SGLang)."""

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from conftest import RecordingSink
from sglang_kvbm.backends.local.manager import LocalBlockManager
from sglang_kvbm.core.connector import KvbmConnector
from sglang_kvbm.core.identity import chain_hashes
from sglang_kvbm.core.ports import BlockMeta, PageStore
from sglang_kvbm.core.tiers import Tier
from sglang_kvbm.kv_layout import PagedKvLayout, runs

PAGE = 4


def make(host_blocks=16, pages=32, executor=None):
    buffers = [torch.randn(pages * PAGE, 2, 8) for _ in range(3)] + [torch.randn(pages * PAGE, 1, 5)]
    layout = PagedKvLayout(buffers, PAGE)
    sink = RecordingSink()
    manager = LocalBlockManager(layout, host_blocks, executor=executor)
    return KvbmConnector(manager, sink), manager, layout, sink


def stores(tokens, pages):
    ids = chain_hashes(tokens, PAGE)
    return [PageStore(BlockMeta(i, tuple(tokens[k * PAGE : (k + 1) * PAGE])), p) for k, (i, p) in enumerate(zip(ids, pages))]


def test_runs_coalesce_contiguous_pairs():
    assert list(runs([3, 4, 5, 9, 10, 2], [0, 1, 2, 3, 4, 7])) == [(0, 3, 0, 3), (3, 9, 3, 2), (5, 2, 7, 1)]


def test_layout_pads_blocks_for_o_direct():
    _, _, layout, _ = make()
    assert layout.page_bytes == 3 * PAGE * 2 * 8 * 4 + PAGE * 5 * 4
    assert layout.block_bytes % 4096 == 0 and layout.block_bytes >= layout.page_bytes


def test_store_poll_lookup_load_roundtrip():
    connector, manager, layout, sink = make()
    tokens = list(range(24))
    released = []
    assert connector.store(stores(tokens, [5, 6, 7, 20, 21, 22]), on_offloaded=lambda: released.append(1))
    original = [layout.read_page(p) for p in [5, 6, 7, 20, 21, 22]]
    assert connector.flush(timeout=30)
    assert released == [1]
    ids = chain_hashes(tokens, PAGE)
    assert sink.calls == [("stored", Tier.HOST, ids)]
    assert connector.lookup(ids + chain_hashes(list(range(30)), PAGE)[6:]) == 6
    assert connector.load(ids, [0, 1, 2, 3, 4, 8])
    for page, want in zip([0, 1, 2, 3, 4, 8], original):
        assert torch.equal(layout.read_page(page), want)
    assert connector.stats.onboard_blocks_h2d == 6 and connector.stats.offload_blocks_d2h == 6


def test_already_wrapped_pages_are_not_copied_again():
    connector, manager, _, _ = make()
    pages = stores(list(range(8)), [1, 2])
    assert connector.store(pages, on_offloaded=lambda: None)
    assert not connector.store(pages, on_offloaded=lambda: None)
    connector.flush(timeout=30)
    connector.evicted([p.meta.block_id for p in pages])
    assert not connector.store(pages, on_offloaded=lambda: None)  # re-wrapped, but the host tier has them
    assert manager.stats.stores_submitted == 1


def test_lru_evicts_a_chain_from_its_tail():
    connector, manager, _, sink = make(host_blocks=4)
    a = list(range(16))
    b = list(range(100, 108))
    connector.store(stores(a, [1, 2, 3, 4]), on_offloaded=lambda: None)
    connector.flush(timeout=30)
    connector.store(stores(b, [5, 6]), on_offloaded=lambda: None)
    connector.flush(timeout=30)
    ids_a = chain_hashes(a, PAGE)
    removed = [c for c in sink.calls if c[0] == "removed"]
    assert removed == [("removed", Tier.HOST, [ids_a[3], ids_a[2]])]
    assert connector.lookup(ids_a) == 2  # the head of the chain survives


def test_failed_copy_is_dropped_unseen():
    connector, manager, layout, sink = make()
    pages = stores(list(range(8)), [1, 10_000])  # page 10000 does not exist: the copy raises
    released = []
    assert connector.store(pages, on_offloaded=lambda: released.append(1))
    connector.flush(timeout=30)
    assert released == [1]  # the device pages are released either way
    assert sink.calls == []
    assert connector.lookup([p.meta.block_id for p in pages]) == 0
    assert manager.stats.store_failures == 1
    assert manager.host.free_rows() == manager.host.capacity


def test_no_room_stores_a_prefix_only():
    gate = threading.Event()
    executor = ThreadPoolExecutor(max_workers=1)
    executor.submit(gate.wait, 60)
    connector, manager, _, _ = make(host_blocks=3, executor=executor)
    try:
        pages = stores(list(range(20)), [1, 2, 3, 4, 5])
        assert connector.store(pages, on_offloaded=lambda: None)
        assert manager.host.free_rows() == 0
        assert manager.stats.blocks_not_stored_no_room == 2
        # All three rows are in flight: nothing can be evicted for a new store.
        assert not connector.store(stores(list(range(50, 54)), [9]), on_offloaded=lambda: None)
    finally:
        gate.set()
    connector.flush(timeout=30)
    assert connector.lookup([p.meta.block_id for p in pages]) == 3


@pytest.mark.parametrize("host_blocks", [0, -1])
def test_host_pool_must_have_room(host_blocks):
    with pytest.raises(ValueError):
        make(host_blocks=host_blocks)
