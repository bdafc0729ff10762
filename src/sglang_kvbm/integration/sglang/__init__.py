"""SGLang integration: the ``kvbm`` linker on SGLang's default tree, and the API for custom servers.

With SGLang's scheduler: ``--radix-cache-backend kvbm`` (see ``plugin`` and ``flags``).
For a server that builds SGLang's KV pool and allocator itself::

    from sglang_kvbm import KvbmConfig
    from sglang_kvbm.integration.sglang import build_cache

    cache = build_cache(params, KvbmConfig(cpu_cache_gb=8))   # params: SGLang's CacheInitParams
    hit = cache.prefix(token_ids)          # device + host/disk prefix, loaded into the pool, locked
    ...                                    # compute the rest; cache.insert(tokens, slots)
    cache.release(hit)
    cache.tier_tokens(token_ids)           # what each tier holds for a sequence
    cache.close()
"""

__all__ = ["KvbmCache", "KvbmLinker", "PrefixHit", "TierTokens", "build_cache"]


def __getattr__(name: str):
    # Lazy: SGLang loads this package's plugin module in every one of its
    # processes, and registering must not import torch or the linker.
    if name in ("build_cache", "KvbmCache", "PrefixHit"):
        from sglang_kvbm.integration.sglang import custom

        return getattr(custom, name)
    if name == "KvbmLinker":
        from sglang_kvbm.integration.sglang.linker import KvbmLinker

        return KvbmLinker
    if name == "TierTokens":
        from sglang_kvbm.integration.sglang.tier_query import TierTokens

        return TierTokens
    raise AttributeError(name)
