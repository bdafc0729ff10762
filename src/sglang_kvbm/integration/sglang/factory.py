"""The ``kvbm`` radix-cache factory, on SGLang releases that build only their own linkers (0.5.21, 0.5.22).

It does what SGLang's ``create_unified_radix_cache`` does for its Mooncake and
MORI linkers: SGLang's default tree (``UnifiedRadixCache``) over the
scheduler's pools, with the tree components the model needs, this library's
linker adopted by it, and the linker's layer counter registered with the KV
pool (the forward waits on it) and the model worker. The launcher turned
``--enable-unified-cache-external-linker`` on beside it (``flags``), so the
scheduler polls the tree each step and starts the layer-wise loads of every
prefill batch, as it does for any linker.
"""

from __future__ import annotations


def build_tree(ctx):
    from sglang.srt.mem_cache.unified_cache.components import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
    from sglang.srt.runtime_context import get_memory

    from sglang_kvbm.config import ConfigError
    from sglang_kvbm.integration.sglang.linker import KvbmLinker

    server_args, params = ctx.server_args, ctx.params
    if not get_memory().enable_unified_cache_external_linker:  # the resolved value, as SGLang's own factory reads it
        raise ConfigError(
            "--radix-cache-backend kvbm reached the scheduler without --enable-unified-cache-external-linker: the "
            "launcher did not load the kvbm plugin (is SGLANG_PLUGINS set without 'kvbm'?). Load it, or add "
            "--enable-unified-cache-external-linker yourself"
        )
    components = [ComponentType.FULL]
    if ctx.is_hybrid_swa:
        components.append(ComponentType.SWA)
    if ctx.is_hybrid_ssm:
        components.append(ComponentType.MAMBA)  # refused by the linker, naming the release that carries it
    params.tree_components = tuple(components)
    cache = UnifiedRadixCache(params)
    forward_stream = getattr(getattr(ctx.tp_worker, "model_runner", None), "forward_stream", None)
    linker = KvbmLinker(server_args, params, components=set(cache.components),
                        extra_config={"kvbm_config": getattr(server_args, "kvbm_config", None)},
                        forward_stream=forward_stream)
    cache.init_cache_linker(linker)
    counter = cache.linker.layer_done_counter
    params.token_to_kv_pool_allocator.get_kvcache().register_layer_transfer_counter(counter)
    ctx.tp_worker.register_hicache_layer_transfer_counter(counter)
    return cache
