"""SGLang's device KV pool as a :class:`~sglang_kvbm.transfer.kv_layout.PagedKvLayout`."""

from __future__ import annotations

import dataclasses

import torch
from sglang.srt.mem_cache.memory_pool import KVCache, MHATokenToKVPool, MLATokenToKVPool

from sglang_kvbm.transfer.kv_layout import PagedKvLayout


class UnsupportedPoolError(TypeError):
    """The model's KV pool is a kind this library cannot page out byte for byte."""


@dataclasses.dataclass(frozen=True)
class PoolBuffers:
    """A token pool's per-layer buffers: ``layers[i]`` lists the buffers the pool's own layer ``i`` reads."""

    buffers: tuple[torch.Tensor, ...]
    layers: tuple[tuple[int, ...], ...]
    tokens_per_row: int  # 1: a row per token slot (NHD, MLA); page_size: a row per page (HND)


def pool_buffers(kvcache: KVCache, page_size: int) -> PoolBuffers:
    """Every per-layer buffer of an MHA or MLA pool, by the pool's own layer index.

    Exact types only: subclasses (hybrid SWA or Mamba pools) carry state
    buffers a page copy would miss, so they are refused here rather than served
    half-copied (hybrid pools are described around their MHA/MLA sub-pools, see
    ``pool_group``). A quantized MHA pool (``--kv-cache-dtype`` FP8 or FP4
    recipes) is paged with its per-token scale buffers: layer ``l`` reads K, V,
    and their scales, stored in the same block, so a block's KV and scales load
    together or not at all. Its dequant workspace is scratch, not KV, and is not stored.
    """
    kind = type(kvcache)
    if kind is MHATokenToKVPool:
        n = len(kvcache.k_buffer)
        buffers = list(kvcache.k_buffer) + list(kvcache.v_buffer)
        layers = [(layer, n + layer) for layer in range(n)]  # layer l reads K buffer l and V buffer l
        if getattr(kvcache, "is_quantized_kv_cache", False):
            for scales in _token_scales(kvcache):
                layers = [(*ids, len(buffers) + layer) for layer, ids in enumerate(layers)]
                buffers += list(scales)
        tokens_per_row = 1 if kvcache.kv_cache_layout == "nhd" else page_size
        return PoolBuffers(tuple(buffers), tuple(layers), tokens_per_row)
    if kind is MLATokenToKVPool:
        return PoolBuffers(tuple(kvcache.kv_buffer), tuple((layer,) for layer in range(len(kvcache.kv_buffer))), 1)
    raise UnsupportedPoolError(
        f"--radix-cache-backend kvbm stores MHATokenToKVPool and MLATokenToKVPool pages (alone, or as the full, "
        f"sliding-window or draft pools of a hybrid model); this model uses {kind.__name__}: run it without "
        f"--radix-cache-backend kvbm"
    )


def paged_layout(kvcache: KVCache, page_size: int) -> PagedKvLayout:
    """A plain MHA or MLA pool as one paged layout (tools and tests; the linker describes pools with ``pool_group``)."""
    parts = pool_buffers(kvcache, page_size)
    return PagedKvLayout(parts.buffers, page_size, parts.tokens_per_row, parts.layers)


def _token_scales(kvcache) -> list:
    """A quantized MHA pool's scale buffers (K's, V's), one row per token slot like its K and V; or refuse."""
    name = getattr(getattr(kvcache, "quant_method", None), "name", type(getattr(kvcache, "quant_method", None)).__name__)
    if getattr(kvcache, "native_k_scale_buffer", None) is not None or getattr(kvcache, "native_v_scale_buffer", None) is not None:
        raise UnsupportedPoolError(
            f"--radix-cache-backend kvbm does not store the page-major native FP4 scales of KV cache recipe {name!r} "
            f"yet (per-token scales are: fp8_e4m3, fp4_mx_block16, nvfp4 off SM100); use another --kv-cache-dtype "
            f"or another cache backend"
        )
    scales = [kvcache.k_scale_buffer, kvcache.v_scale_buffer]
    if all(s is None for s in scales):
        return []  # e.g. cpu_fp8_e4m3: K and V are the whole state
    rows = kvcache.k_buffer[0].shape[0]
    if any(s is None or len(s) != len(kvcache.k_buffer) or s[0].shape[0] != rows for s in scales) or \
            kvcache.kv_cache_layout != "nhd":
        raise UnsupportedPoolError(
            f"--radix-cache-backend kvbm cannot page the scale buffers of KV cache recipe {name!r} with its K and V "
            f"(one scale row per token slot, in the NHD layout, is what it stores); use another cache backend"
        )
    return scales
