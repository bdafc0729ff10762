"""Mamba / linear-attention hybrids (Qwen3-Next, Qwen3.5, Nemotron-H): full-attention pages and the state at a boundary.

Proven in process on SGLang's own ``HybridLinearKVPool`` (MHA full layers,
which SGLang's own ``resolve_hybrid_device_pool_group`` refuses) with its
``MambaPool``, allocator and default tree on CPU (``harness.hybrid``). A real
server cannot be trusted here: a tiny ``Qwen3NextForCausalLM`` builds a
CUDA-only norm on CPU (``models/qwen3_next.py`` ``FusedRMSNormGated``).

The state a tier serves is the one stored for exactly the matched boundary:
Mamba states are kept per node end, under that page's key (which names the
whole prefix), so a hit lands only on boundaries that have one.
"""

from __future__ import annotations

import pytest

# SGLang's sliding-window, Mamba and draft-KV pools as a hybrid model's scheduler builds them, through 0.5.23's linker
# factory: SWA on 0.5.22 is tested on real servers only (make compat); 0.5.21 refuses them at start-up (compat).
pytest.importorskip("sglang.srt.mem_cache.unified_cache.linker_factory", reason="SGLang before 0.5.23 builds these "
                    "hybrid pools without a linker factory (compat refuses or serves them; see test_startup_refusals)")

from harness.hybrid import admit, build, equal, kv_bytes, mamba_bytes

# loads must land whatever the machine is doing (not this file's subject: test_disk_lanes.py tests the budget)
pytestmark = pytest.mark.usefixtures("loads_wait_for_their_reads")


PAGES = 6


def prompt(start: int, pages: int, page: int = 1) -> list[int]:
    return list(range(start, start + pages * page + 1))


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("tier", ["host", "disk"])
def test_state_and_pages_come_back_equal_after_device_eviction(tmp_path, page_size, tier):
    h = build("mamba", tmp_path, page_size=page_size,
              host_blocks=0 if tier == "disk" else 256, disk_blocks=256 if tier == "disk" else 0)
    tokens = prompt(1000, PAGES, page_size)
    first = admit(h, tokens)
    kv, state = kv_bytes(h, first.slots), mamba_bytes(h, first.mamba_slot)
    h.evict_device()
    again = admit(h, tokens, compute=False)
    assert again.device_tokens == 0 and again.loaded_tokens == PAGES * page_size and not again.failed
    assert equal(kv_bytes(h, again.loaded_slots), kv)
    assert again.mamba_slot is not None and equal(mamba_bytes(h, again.mamba_slot), state)


def test_a_state_evicted_on_the_device_alone_comes_back_from_the_host(tmp_path):
    h = build("mamba", tmp_path)
    tokens = prompt(1000, PAGES)
    first = admit(h, tokens)
    state = mamba_bytes(h, first.mamba_slot)
    h.evict_device(kv=False)  # SGLang evicts Mamba states apart from KV pages: the device match ends at 0
    again = admit(h, tokens, compute=False)
    assert again.device_tokens == 0 and again.loaded_tokens == PAGES
    assert equal(mamba_bytes(h, again.mamba_slot), state)


def test_after_a_split_each_boundary_restores_its_own_state_or_none(tmp_path):
    """B ends inside A's node: the tree splits it and gives the new boundary B's state.

    SGLang 0.5.23's tree does not offload that state: the split parent inherits
    ``external_cache_stored`` from A's node (``unified_tree_core.py``
    ``_needs_external_linker_offload``), so boundary 3 is never in the tiers and
    a request ending there recomputes. What must hold: A's boundary still
    restores A's state, and no boundary ever gets another one's state.
    """
    h = build("mamba", tmp_path)
    a = prompt(1000, PAGES)
    first = admit(h, a)
    state_a = mamba_bytes(h, first.mamba_slot)
    second = admit(h, a[:3] + [7])
    state_b = mamba_bytes(h, second.mamba_slot)
    assert not equal(state_a, state_b)
    c = a[:3] + list(range(5000, 5004))
    assert admit(h, c, compute=False).device_tokens == 3  # the device holds B's state at the split boundary
    h.evict_device()
    at_3 = admit(h, c, compute=False)
    assert at_3.loaded_tokens == 0 or equal(mamba_bytes(h, at_3.mamba_slot), state_b)
    at_6 = admit(h, a, compute=False)
    assert at_6.loaded_tokens == PAGES and equal(mamba_bytes(h, at_6.mamba_slot), state_a)


def test_no_state_at_a_boundary_means_no_hit_there(tmp_path):
    h = build("mamba", tmp_path)
    a = prompt(1000, PAGES)
    admit(h, a)
    h.evict_device()
    inside = admit(h, a[:4] + [9, 9, 9], compute=False)  # pages 0..3 are in the tiers, but no state at 4 (or before)
    assert inside.loaded_tokens == 0
    # POST /tiers says so too (the KV events alone would say 4 pages), and says 6 where the state is
    assert tuple(h.linker.tier_tokens(a[:4] + [9, 9, 9]).counts().values()) == (0, 0, 0)
    assert tuple(h.linker.tier_tokens(a).counts().values()) == (0, PAGES, PAGES)


def test_every_pool_loads_on_the_layer_sglang_waits_on_before_reading_it(tmp_path):
    """The buffers each layer's load writes are the ones SGLang's own accessors hand that layer's forward."""
    h = build("mamba", tmp_path)
    kv, mamba = h.linker.layout, h.linker.sidecars.managers["mamba"].layout
    for layer in range(kv.num_layers):
        loaded = {kv._views[b].data_ptr() for b in kv.layers[layer]} | {mamba._views[b].data_ptr() for b in mamba.layers[layer]}
        if layer in h.kvcache.full_attention_layer_id_mapping:
            read = {h.kvcache.get_key_buffer(layer).data_ptr(), h.kvcache.get_value_buffer(layer).data_ptr()}
        else:
            state = h.r2t.mamba2_layer_cache(layer)
            read = {state.temporal.data_ptr(), *(c.data_ptr() for c in state.conv)}
        assert read == loaded, layer


def test_a_corrupt_state_on_disk_misses_the_whole_load(tmp_path):
    """The Mamba state of the boundary fails its checksum: no page is served without it, and it is dropped."""
    from harness.disk import data_offset, flip_bit, segment_path

    h = build("mamba", tmp_path, host_blocks=0, disk_blocks=256)
    tokens = prompt(1000, PAGES)
    admit(h, tokens)
    h.evict_device()
    disk = h.linker.sidecars.managers["mamba"].tiers["disk"].store
    (state,) = [m.block_id for m in disk.registered_metas()]
    flip_bit(segment_path(disk, state), data_offset(disk, state) + 11)
    missed = admit(h, tokens, compute=False)
    assert missed.tier_tokens == PAGES and missed.loaded_tokens == 0
    assert h.linker.connector.stats.onboard_blocks_d2d == 0 and len(disk) == 0
    assert admit(h, tokens, compute=False).tier_tokens == 0  # no state anywhere: nothing restorable now
