"""Sliding-window hybrids (GPT-OSS, Gemma 3/4, Llama 4, MiMo): full-attention pages and the window's SWA pages.

Proven in process on SGLang's own ``SWAKVPool``, its allocator and default tree
on CPU (``harness.hybrid``): SGLang 0.5.23 refuses ``torch_native`` attention for
these models at argument resolution (``arg_groups/model_hook.py``), and with
that check patched out stock SGLang disagrees with itself on CPU (DESIGN §3b),
so a real-server comparison would prove nothing.
"""

from __future__ import annotations

import pytest

# SGLang's sliding-window, Mamba and draft-KV pools as a hybrid model's scheduler builds them, through 0.5.23's linker
# factory: SWA on 0.5.22 is tested on real servers only (make compat); 0.5.21 refuses them at start-up (compat).
pytest.importorskip("sglang.srt.mem_cache.unified_cache.linker_factory", reason="SGLang before 0.5.23 builds these "
                    "hybrid pools without a linker factory (compat refuses or serves them; see test_startup_refusals)")

from harness.disk import data_offset, flip_bit, segment_path
from harness.hybrid import admit, build, equal, kv_bytes, swa_bytes

# loads must land whatever the machine is doing (not this file's subject: test_disk_lanes.py tests the budget)
pytestmark = pytest.mark.usefixtures("loads_wait_for_their_reads")


PAGES = 6


def prompt(start: int, pages: int, page: int) -> list[int]:
    return list(range(start, start + pages * page + 1))


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("tier", ["host", "disk"])
def test_window_pages_and_full_pages_come_back_equal(tmp_path, page_size, tier):
    window = 2 * page_size + 1  # the window spans three pages, not all of the prompt
    h = build("swa", tmp_path, page_size=page_size, window=window,
              host_blocks=0 if tier == "disk" else 256, disk_blocks=256 if tier == "disk" else 0)
    tokens = prompt(1000, PAGES, page_size)
    first = admit(h, tokens)
    assert first.loaded_tokens == 0
    window_slots = first.slots[-3 * page_size:]
    kv, swa = kv_bytes(h, first.slots), swa_bytes(h, window_slots)
    h.evict_device()
    again = admit(h, tokens, compute=False)
    assert again.device_tokens == 0 and again.loaded_tokens == PAGES * page_size and not again.failed
    assert equal(kv_bytes(h, again.loaded_slots), kv)
    assert equal(swa_bytes(h, again.loaded_slots[-3 * page_size:]), swa)
    side = h.linker.sidecars.managers["swa"]
    stats = h.linker.connector.stats
    assert stats.onboard_blocks_h2d + stats.onboard_blocks_d2d == PAGES
    assert (side.host is not None and len(side.host)) or len(side.tiers["disk"].store)


def test_one_corrupt_window_page_on_disk_misses_the_whole_load_then_an_intact_boundary_is_served(tmp_path):
    """Corrupt the SWA bytes of the last page on disk: no KV is served without its window (all or none)."""
    h = build("swa", tmp_path, window=3, host_blocks=0, disk_blocks=256)
    tokens = prompt(1000, PAGES, 1)
    first = admit(h, tokens)
    kv = kv_bytes(h, first.slots)
    h.evict_device()
    disk = h.linker.sidecars.managers["swa"].tiers["disk"].store
    victim = _last_key(h, tokens)
    flip_bit(segment_path(disk, victim), data_offset(disk, victim) + 5)
    missed = admit(h, tokens, compute=False)
    assert missed.tier_tokens == PAGES and missed.loaded_tokens == 0  # the load was refused whole: it recomputes
    assert h.linker.connector.stats.onboard_blocks_d2d == 0
    served = admit(h, tokens, compute=False)  # the bad block is gone; pages 3..5 are an intact window for boundary 5
    assert served.loaded_tokens == PAGES - 1 and not served.failed
    assert equal(kv_bytes(h, served.loaded_slots), [b[: PAGES - 1] for b in kv])


def _last_key(h, tokens) -> str:
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    return get_storage_hash_str(tokens[:PAGES], None, page_size=1)[-1]


@pytest.mark.parametrize("window, served", [(3, PAGES), (5, 0)])
def test_a_restart_reads_the_disk_blocks_of_its_own_pool_shape_only(tmp_path, window, served):
    """The same model restarted: its disk blocks (KV and window pages) serve; with another window, none do."""
    tokens = prompt(1000, PAGES, 1)
    before = build("swa", tmp_path, window=3, host_blocks=0, disk_blocks=256)
    kv = kv_bytes(before, admit(before, tokens).slots)
    before.settle()
    before.linker.close()
    after = build("swa", tmp_path, window=window, host_blocks=0, disk_blocks=256)
    again = admit(after, tokens, compute=False)
    assert again.loaded_tokens == served
    if served:
        assert equal(kv_bytes(after, again.loaded_slots), kv)


def test_every_pool_loads_on_the_layer_sglang_waits_on_before_reading_it(tmp_path):
    """The buffers each layer's load writes are the ones ``SWAKVPool`` hands that layer's forward (after its wait)."""
    h = build("swa", tmp_path)
    kv, swa = h.linker.layout, h.linker.sidecars.managers["swa"].layout
    for layer in range(kv.num_layers):
        loaded = {kv._views[b].data_ptr() for b in kv.layers[layer]} | {swa._views[b].data_ptr() for b in swa.layers[layer]}
        assert loaded == {h.kvcache.get_key_buffer(layer).data_ptr(), h.kvcache.get_value_buffer(layer).data_ptr()}
