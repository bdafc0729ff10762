"""Speculative decoding's draft KV (EAGLE, MTP): the draft pool's page rides in the same block as the target's.

In process on SGLang's own MHA pool, allocator and default tree (EAGLE's bigram
keys on) with an EAGLE draft runner's pool beside it, handed to the tree as
``CacheInitParams.sidecar_draft_device_pools`` as SGLang does (``harness.hybrid``).
The draft's page shares the target's token slot, so it is stored in the same
block and verified by the same checksum: a request never gets target KV
without its draft KV.
"""

from __future__ import annotations

import pytest

# SGLang's sliding-window, Mamba and draft-KV pools as a hybrid model's scheduler builds them, through 0.5.23's linker
# factory: SWA on 0.5.22 is tested on real servers only (make compat); 0.5.21 refuses them at start-up (compat).
pytest.importorskip("sglang.srt.mem_cache.unified_cache.linker_factory", reason="SGLang before 0.5.23 builds these "
                    "hybrid pools without a linker factory (compat refuses or serves them; see test_startup_refusals)")

from harness.disk import data_offset, flip_bit, segment_path
from harness.hybrid import admit, build, equal, kv_bytes

# loads must land whatever the machine is doing (not this file's subject: test_disk_lanes.py tests the budget)
pytestmark = pytest.mark.usefixtures("loads_wait_for_their_reads")


PAGES = 6


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_target_and_draft_pages_come_back_equal(tmp_path, tier):
    h = build("draft", tmp_path, page_size=4, host_blocks=0 if tier == "disk" else 256,
              disk_blocks=256 if tier == "disk" else 0)
    layout = h.linker.layout
    assert layout.layers[-1][-2:] == (4, 5), "the draft's K and V ride the last layer"
    tokens = list(range(1000, 1000 + PAGES * 4 + 2))
    first = admit(h, tokens)
    stored = kv_bytes(h, first.slots[: (PAGES - 1) * 4])  # EAGLE's bigram key is one shorter: the last page is partial
    h.evict_device()
    again = admit(h, tokens, compute=False)
    assert again.device_tokens == 0 and again.loaded_tokens == (PAGES - 1) * 4 and not again.failed
    loaded = kv_bytes(h, again.loaded_slots)
    assert equal(loaded[:4], stored[:4]), "target KV"
    assert equal(loaded[4:], stored[4:]), "draft KV"


def test_corrupt_draft_bytes_on_disk_miss_the_whole_block(tmp_path):
    h = build("draft", tmp_path, page_size=4, host_blocks=0, disk_blocks=256)
    layout = h.linker.layout
    tokens = list(range(1000, 1000 + PAGES * 4 + 2))
    admit(h, tokens)
    h.evict_device()
    disk = h.linker.manager.tiers["disk"].store
    first_page = next(m.block_id for m in disk.registered_metas() if m.parent_id is None)
    flip_bit(segment_path(disk, first_page), data_offset(disk, first_page) + layout.buffer_offsets[4] + 3)  # draft K
    missed = admit(h, tokens, compute=False)
    assert missed.tier_tokens == (PAGES - 1) * 4 and missed.loaded_tokens == 0  # the whole load is refused
    assert h.linker.connector.stats.onboard_blocks_d2d == 0
    assert first_page not in {m.block_id for m in disk.registered_metas()}  # dropped: the next request recomputes


def test_eagle_pages_in_the_tiers_are_announced_as_the_tree_announces_them(tmp_path):
    """EAGLE keys pages by (token, next token): tier events carry the tree's block hashes and its pair payload."""
    h = build("draft", tmp_path, page_size=4, events=True)
    admit(h, list(range(1000, 1000 + PAGES * 4 + 2)))
    h.settle()
    pages = {}  # medium -> [(block hash, parent, its tokens)], events split page by page
    for event in h.cache.take_events():
        if type(event).__name__ != "BlockStored":
            continue
        parent, size = event.parent_block_hash, event.block_size
        for i, block_hash in enumerate(event.block_hashes):
            tokens = [tuple(t) for t in event.token_ids[i * size : (i + 1) * size]]
            pages.setdefault(str(event.medium), []).append((block_hash, parent, tokens))
            parent = block_hash
    gpu = [page for medium, each in pages.items() if "GPU" in medium for page in each]
    host = [page for medium, each in pages.items() if "CPU" in medium for page in each]
    assert len(host) == PAGES - 1 and host == gpu
    assert host[0][2][:2] == [(1000, 1001), (1001, 1002)]
