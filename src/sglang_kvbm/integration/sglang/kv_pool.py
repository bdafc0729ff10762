"""SGLang's device KV pool as a :class:`~sglang_kvbm.kv_layout.PagedKvLayout`."""

from __future__ import annotations

from sglang.srt.mem_cache.memory_pool import KVCache, MHATokenToKVPool, MLATokenToKVPool

from sglang_kvbm.kv_layout import PagedKvLayout


class UnsupportedPoolError(TypeError):
    """The model's KV pool is a kind this library cannot page out byte for byte."""


def paged_layout(kvcache: KVCache, page_size: int) -> PagedKvLayout:
    """Every per-layer buffer of an MHA or MLA pool, paged by SGLang's page size.

    Exact types only: subclasses (FP4/MXFP8 quantized pools, hybrid SWA or
    Mamba pools) carry scale or state buffers a page copy would miss, so they
    are refused here rather than served half-copied.
    """
    kind = type(kvcache)
    if kind is MHATokenToKVPool:
        if getattr(kvcache, "is_quantized_kv_cache", False):
            raise UnsupportedPoolError(
                "--radix-cache-backend kvbm does not support quantized KV caches yet; "
                "drop --kv-cache-dtype or use another cache backend"
            )
        tokens_per_row = 1 if kvcache.kv_cache_layout == "nhd" else page_size
        n = len(kvcache.k_buffer)
        layers = [(layer, n + layer) for layer in range(n)]  # layer l reads K buffer l and V buffer l
        return PagedKvLayout(list(kvcache.k_buffer) + list(kvcache.v_buffer), page_size, tokens_per_row, layers)
    if kind is MLATokenToKVPool:
        return PagedKvLayout(list(kvcache.kv_buffer), page_size, 1, [(layer,) for layer in range(len(kvcache.kv_buffer))])
    raise UnsupportedPoolError(
        f"--radix-cache-backend kvbm supports MHATokenToKVPool and MLATokenToKVPool; "
        f"this model uses {kind.__name__} (hybrid, sliding-window, state-space and quantized "
        f"pools are not supported yet)"
    )
