"""SGLang's own hybrid pools, allocator and default tree on CPU, with the kvbm linker attached the server's way.

The pools come from SGLang's test kit (``sglang.test.kits.unified_radix_cache``:
``SWAKVPool``, ``HybridLinearKVPool`` + ``MambaPool``, an MHA pool with an
EAGLE-style draft pool beside it); the linker is made by SGLang's
``create_unified_cache_linker`` and adopted with ``init_cache_linker``, as
``mem_cache/registry.py`` does. :func:`admit` is what the scheduler does for
one request (match, load the tiers' part layer by layer, "compute" the rest
with fresh random bytes, insert), so every byte a tier serves can be checked
against what was stored.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import time
from array import array
from typing import Optional

import torch
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InitLoadBackParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.unified_cache.components.base import ComponentType
from sglang.srt.mem_cache.unified_cache.linker_factory import create_unified_cache_linker
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs

from sglang_kvbm.config import KvbmConfig
from sglang_kvbm.integration.sglang.build import Identity
from sglang_kvbm.integration.sglang.compat import device_prefix_len, path_device_indices

_rids = itertools.count()
_gen = torch.Generator().manual_seed(0)


@dataclasses.dataclass
class Hybrid:
    kind: str
    cache: object
    allocator: object
    r2t: object
    kvcache: object
    draft: Optional[object]
    page_size: int
    window: int

    @property
    def linker(self):
        return self.cache.linker.cache_linker

    def settle(self) -> None:
        """Every offload in flight lands and the tree hears of it (what the scheduler's next steps do)."""
        assert self.linker.quiesce(30)
        self.cache.check_hicache_events()

    def evict_device(self, *, kv: bool = True, mamba: bool = True) -> None:
        self.settle()
        self.cache.evict(EvictParams(num_tokens=10_000 if kv else 0, swa_num_tokens=10_000 if kv else 0,
                                     mamba_num=1_000 if mamba else 0))
        # Freed memory keeps its bytes: scribble over everything evicted, so only a real load can restore it.
        if kv:
            assert self.cache.evictable_size() == 0 and self.cache.protected_size() == 0
            pools = [getattr(self.kvcache, "full_kv_pool", self.kvcache), getattr(self.kvcache, "swa_kv_pool", None),
                     self.draft]
            for buf in [b for pool in pools if pool is not None for b in pool.k_buffer + pool.v_buffer]:
                buf.fill_(-7.0)
        if mamba and self.kind == "mamba":
            state = self.r2t.mamba_pool.mamba_cache
            for buf in [state.temporal, *state.conv]:
                buf.fill_(-7.0)


def build(kind: str, tmp_path, *, page_size: int = 1, host_blocks: int = 256, disk_blocks: int = 0,
          window: int = 8, config: Optional[dict] = None, events: bool = False, requests: int = 10) -> Hybrid:
    """``kind``: ``swa`` (sliding-window hybrid), ``mamba`` (MHA + Mamba), ``draft`` (MHA + an EAGLE draft pool),
    ``dense`` (MHA alone, four layers like the hybrids: the baseline of ``benchmarks/hybrid_path.py``)."""
    import sglang.test.kits.unified_radix_cache.fixtures as fixtures
    from sglang.test.kits.unified_radix_cache.config import CacheConfig

    # ``requests``: how many requests the pools have room for (admit leaves what it loaded without computing held)
    common = dict(page_size=page_size, kv_size=max(512, 128 * requests), max_context_len=512, head_num=2, head_dim=8,
                  dtype=torch.float32, max_num_reqs=requests)
    if kind == "swa":
        cfg = CacheConfig(components=(ComponentType.FULL, ComponentType.SWA), sliding_window_size=window,
                          num_layers=4, full_attention_layer_ids=(1, 3), **common)
    elif kind == "mamba":
        cfg = CacheConfig(components=(ComponentType.FULL, ComponentType.MAMBA), num_layers=4,
                          full_attention_layer_ids=(1, 3), mamba_cache_size=max(24, 3 * requests),
                          enable_mamba_extra_buffer=page_size > 1, **common)
    elif kind == "dense":
        cfg = CacheConfig(components=(ComponentType.FULL,), num_layers=4, **common)
    elif kind == "draft":
        cfg = CacheConfig(components=(ComponentType.FULL,), num_layers=2, is_eagle=True, **common)
    else:
        raise ValueError(kind)
    original_device, original_allocator = fixtures.get_device, fixtures.TokenToKVPoolAllocator
    fixtures.get_device = lambda *a, **k: "cpu"  # the kit asks for an accelerator
    if page_size > 1 and kind != "swa":  # the kit pairs MHA/Mamba pools with a token allocator: use SGLang's paged one
        fixtures.TokenToKVPoolAllocator = lambda size, dtype, device, kvcache, need_sort: PagedTokenToKVPoolAllocator(
            size, page_size, dtype, device, kvcache, need_sort)
    try:
        cache, allocator, r2t = fixtures.build_fixture(cfg, enable_kv_cache_events=events)
    finally:
        fixtures.get_device, fixtures.TokenToKVPoolAllocator = original_device, original_allocator
    params = cache.cache_init_params
    kvcache = allocator.get_kvcache()
    draft = None
    if kind == "draft":  # an EAGLE draft runner's own pool: the target's token slots, buffers of its own
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

        draft = MHATokenToKVPool(size=cfg.kv_size, page_size=page_size, dtype=cfg.dtype, head_num=2, head_dim=8,
                                 layer_num=1, device="cpu", enable_memory_saver=False)
        params.sidecar_draft_device_pools = (draft,)
    kvbm = KvbmConfig(cpu_cache_blocks=host_blocks or None, disk_cache_blocks=disk_blocks or None,
                      disk_cache_dir=str(tmp_path / "disk"), disable_disk_offload_filter=True, **(config or {}))
    linker = create_unified_cache_linker(
        ServerArgs(model_path="dummy", page_size=page_size), params, backend="dynamic",
        config={"linker": "KvbmLinker", "linker_module_path": "sglang_kvbm.integration.sglang.linker",
                "linker_extra_config": {"config": kvbm, "identity": Identity("tiny-" + kind)}},
        components=set(cache.components))
    cache.init_cache_linker(linker)  # mem_cache/registry.py: adopt, then register the layer counter
    kvcache.register_layer_transfer_counter(linker.layer_done_counter)
    return Hybrid(kind, cache, allocator, r2t, kvcache, draft, page_size, window)


# -- what the forward writes ------------------------------------------------------------------


def _random(t: torch.Tensor) -> torch.Tensor:
    return torch.randn(t.shape, generator=_gen).to(t.dtype)


def _alloc(h: Hybrid, n: int) -> torch.Tensor:
    if h.kind == "swa":  # alloc_extend's pairing of full and sliding-window slots
        aligned = -(-n // h.page_size) * h.page_size
        full = h.allocator.full_attn_allocator.alloc(aligned)
        swa = h.allocator.swa_attn_allocator.alloc(aligned)
        assert full is not None and swa is not None, "pool exhausted"
        h.allocator.full_to_swa_index_mapping[full] = swa
        return full[:n]
    slots = h.allocator.alloc(n)
    assert slots is not None, "pool exhausted"
    return slots


def _fill(h: Hybrid, slots: torch.Tensor) -> None:
    for buf in full_buffers(h):
        buf[slots] = _random(buf[slots])
    if h.kind == "swa":
        swa = swa_slots(h, slots)
        for buf in h.kvcache.swa_kv_pool.k_buffer + h.kvcache.swa_kv_pool.v_buffer:
            buf[swa] = _random(buf[swa])


def full_buffers(h: Hybrid) -> list:
    pool = getattr(h.kvcache, "full_kv_pool", h.kvcache)
    draft = h.draft.k_buffer + h.draft.v_buffer if h.draft is not None else []
    return pool.k_buffer + pool.v_buffer + draft


def swa_slots(h: Hybrid, slots: torch.Tensor) -> torch.Tensor:
    return h.allocator.full_to_swa_index_mapping[slots].to(torch.int64)


def swa_bytes(h: Hybrid, slots: torch.Tensor) -> list:
    swa = swa_slots(h, slots)
    return [buf[swa].clone() for buf in h.kvcache.swa_kv_pool.k_buffer + h.kvcache.swa_kv_pool.v_buffer]


def kv_bytes(h: Hybrid, slots: torch.Tensor) -> list:
    return [buf[slots].clone() for buf in full_buffers(h)]


def mamba_bytes(h: Hybrid, slot: torch.Tensor) -> list:
    cache = h.r2t.mamba_pool.mamba_cache
    s = slot.to(torch.int64).reshape(-1)
    return [cache.temporal[:, s].clone()] + [conv[:, s].clone() for conv in cache.conv]


def equal(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


# -- the scheduler's part ----------------------------------------------------------------------


@dataclasses.dataclass
class Admitted:
    device_tokens: int
    tier_tokens: int  # what match reported the tiers hold (host_hit_length)
    loaded_tokens: int
    failed: bool
    slots: Optional[torch.Tensor] = None  # the prefix's token slots, after compute and insert
    loaded_slots: Optional[torch.Tensor] = None  # the slots the tiers' part landed in
    mamba_slot: Optional[torch.Tensor] = None


def admit(h: Hybrid, tokens: list[int], *, compute: bool = True, timings: Optional[dict] = None) -> Admitted:
    """``timings``: seconds spent in the cache calls, added up by step (``match``, ``load``: init_load_back and
    the start of the layer-wise load, ``wait``: finishing it, ``insert``)."""
    cache, page = h.cache, h.page_size
    clock = _Clock(timings)
    cache.check_hicache_events()
    req = Req(rid=f"r{next(_rids)}", origin_input_text="", origin_input_ids=array("q", tokens),
              sampling_params=SamplingParams(temperature=0, max_new_tokens=1))
    h.r2t.alloc([req])
    usable = (len(tokens) - 1) // page * page
    key = RadixKey(array("q", tokens[:usable]))
    with clock("match"):
        match = cache.match_prefix(MatchPrefixParams(key=key, req=req))
    req.prefix_len, req.last_node = device_prefix_len(match), match.last_device_node
    req.host_hit_length = match.host_hit_length
    req.swa_host_hit_length, req.mamba_host_hit_length = match.swa_host_hit_length, match.mamba_host_hit_length
    device = device_prefix_len(match)
    lock = cache.inc_lock_ref(match.last_device_node).to_dec_params()
    loaded, loaded_slots, failed = 0, None, []
    if match.host_hit_length > 0:
        with clock("load"):
            loaded, _ = cache.init_load_back(InitLoadBackParams(best_match_node=match.best_match_node,
                                                                host_hit_length=match.host_hit_length, req=req))
            if loaded:
                cache.ready_to_load_host_cache()
        if loaded:
            loaded_slots = cache.linker.private_load_indices[req.rid].clone()
            with clock("wait"):
                failed = cache.finish_external_linker_loads([req])
    result = Admitted(device, match.host_hit_length, loaded, bool(failed), loaded_slots=loaded_slots)
    if h.kind == "mamba" and req.kv is not None and req.kv.holds_mamba:
        result.mamba_slot = req.kv.mamba_pool_idx.reshape(1).clone()
    if failed or not compute:
        cache.dec_lock_ref(match.last_device_node, lock)
        return result
    path = path_device_indices(cache, match.last_device_node)[:device].to(torch.int64)
    prefix = torch.cat([path, loaded_slots.to(torch.int64)]) if loaded else path
    new = _alloc(h, usable - len(prefix)).to(torch.int64) if usable > len(prefix) else torch.empty(0, dtype=torch.int64)
    if new.numel():
        _fill(h, new)
    values = torch.cat([prefix, new])
    params = InsertParams(key=key, value=values, prev_prefix_len=device)
    if h.kind == "mamba":
        slot = req.kv.mamba_pool_idx.reshape(1)
        if new.numel():  # the recurrent state after the whole prompt
            cache_state = h.r2t.mamba_pool.mamba_cache
            cache_state.temporal[:, slot] = _random(cache_state.temporal[:, slot])
            for conv in cache_state.conv:
                conv[:, slot] = _random(conv[:, slot])
        params.mamba_value = slot
        result.mamba_slot = slot.clone()
    if h.kind == "swa":
        params.set_evicted_seqlen(ComponentType.SWA, req.kv.get_evicted_seqlen(ComponentType.SWA))
    with clock("insert"):
        cache.insert(params)
    result.slots = values
    cache.dec_lock_ref(match.last_device_node, lock)
    return result


class _Clock:
    def __init__(self, into: Optional[dict]) -> None:
        self.into = into

    @contextlib.contextmanager
    def __call__(self, step: str):
        started = time.perf_counter()
        try:
            yield
        finally:
            if self.into is not None:
                self.into[step] = self.into.get(step, 0.0) + time.perf_counter() - started
