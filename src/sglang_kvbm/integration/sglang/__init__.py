"""SGLang integration: the ``kvbm`` radix-cache backend, and the API for custom servers.

For a server that builds SGLang's KV pool and allocator itself::

    from sglang_kvbm import KvbmConfig
    from sglang_kvbm.integration.sglang import build_cache

    cache = build_cache(params, KvbmConfig(cpu_cache_gb=8))   # params: SGLang's CacheInitParams
    hit = cache.prefix(token_ids)          # device + host/disk prefix, loaded into the pool
    ...                                    # compute the rest; then cache.insert(...) as usual
    cache.tier_tokens(token_ids)           # what each tier holds for a sequence
    cache.close()
"""

__all__ = ["KvbmRadixCache", "PrefixHit", "TierTokens", "build_cache"]


def __getattr__(name: str):
    # Lazy: SGLang loads this package's plugin module in every one of its
    # processes, and registering the backend must not import the cache.
    if name == "build_cache":
        from sglang_kvbm.integration.sglang.factory import build_cache

        return build_cache
    if name in ("KvbmRadixCache", "PrefixHit", "TierTokens"):
        from sglang_kvbm.integration.sglang import radix_cache

        return getattr(radix_cache, name)
    raise AttributeError(name)
