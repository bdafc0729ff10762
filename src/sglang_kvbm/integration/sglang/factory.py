"""Composition root: one ``KvbmRadixCache`` per scheduler, built from the environment."""

from __future__ import annotations

import logging

from sglang.srt.mem_cache.registry import TreeCacheBuildContext

from sglang_kvbm.backends.local.manager import LocalBlockManager
from sglang_kvbm.config import ConfigError, KvbmConfig
from sglang_kvbm.core.connector import KvbmConnector
from sglang_kvbm.integration.sglang.events import SglangEventSink
from sglang_kvbm.integration.sglang.kv_pool import UnsupportedPoolError, paged_layout
from sglang_kvbm.integration.sglang.radix_cache import KvbmRadixCache

logger = logging.getLogger(__name__)


def create_kvbm_radix_cache(ctx: TreeCacheBuildContext) -> KvbmRadixCache:
    """The ``kvbm`` radix-cache backend: validate, size the tiers, wire the core."""
    _check_supported(ctx)
    config = KvbmConfig.from_env()
    config.require_a_tier()
    params = ctx.params
    allocator = params.token_to_kv_pool_allocator
    layout = paged_layout(allocator.get_kvcache(), params.page_size)
    host_blocks = config.host_blocks(layout.block_bytes)
    device_pages = allocator.size // params.page_size
    if host_blocks < device_pages:
        logger.warning(
            "kvbm: the host tier (%d blocks) is smaller than the device KV pool (%d pages): "
            "it can only hold what the device already holds, so it will churn without hits. "
            "Raise DYN_KVBM_CPU_CACHE_GB to at least %.2f.",
            host_blocks,
            device_pages,
            device_pages * layout.block_bytes / (1 << 30),
        )
    manager = LocalBlockManager(layout, host_blocks, pin=layout.is_cuda)
    sink = SglangEventSink()
    connector = KvbmConnector(manager, sink, min_offload_priority=config.host_offload_min_priority)
    logger.info(
        "kvbm: local backend, page %d tokens, block %d bytes (%d buffers); host tier %d blocks (%.2f GiB%s)",
        params.page_size,
        layout.block_bytes,
        len(layout.buffer_page_bytes),
        host_blocks,
        host_blocks * layout.block_bytes / (1 << 30),
        ", pinned" if layout.is_cuda else "",
    )
    return KvbmRadixCache(params, connector, sink)


def _check_supported(ctx: TreeCacheBuildContext) -> None:
    if ctx.disable_radix_cache:
        raise ConfigError("--radix-cache-backend kvbm needs the radix cache: remove --disable-radix-cache")
    if ctx.enable_hierarchical_cache:
        raise ConfigError(
            "--radix-cache-backend kvbm replaces SGLang's hierarchical cache: remove --enable-hierarchical-cache"
        )
    if ctx.is_hybrid_swa or ctx.is_hybrid_ssm:
        raise UnsupportedPoolError(
            "--radix-cache-backend kvbm does not support sliding-window or state-space (Mamba) models yet"
        )
    if ctx.tp_size > 1 or ctx.params.pp_size > 1:
        # Each rank's copies finish at different times; agreeing on hits needs a
        # collective every rank reaches, which this backend does not do yet.
        raise UnsupportedPoolError(
            "--radix-cache-backend kvbm's local backend runs with --tp-size 1 and --pp-size 1 only, for now"
        )
    if ctx.params.mtp_draft_device_pools or ctx.params.sidecar_draft_device_pools:
        raise UnsupportedPoolError("--radix-cache-backend kvbm does not support speculative draft KV pools yet")
