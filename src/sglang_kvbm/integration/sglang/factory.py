"""Composition root: one ``KvbmRadixCache`` per scheduler, built from the environment."""

from __future__ import annotations

import atexit
import logging
from typing import Any, Optional

from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.registry import TreeCacheBuildContext

from sglang_kvbm.backends.local.disk_setup import probe
from sglang_kvbm.backends.local.disk_store import DiskStore
from sglang_kvbm.backends.local.manager import LocalBlockManager
from sglang_kvbm.config import GIB, ConfigError, KvbmConfig
from sglang_kvbm.core.connector import KvbmConnector
from sglang_kvbm.core.offload_filter import FrequencyFilter
from sglang_kvbm.core.onboard_policy import OnboardPolicy
from sglang_kvbm.core.tiers import ROUTER_MEDIA, Tier
from sglang_kvbm.integration.sglang.endpoint import metrics_snapshot, start_http
from sglang_kvbm.integration.sglang.events import SglangEventSink
from sglang_kvbm.integration.sglang.fingerprint import server_fingerprint
from sglang_kvbm.integration.sglang.kv_pool import UnsupportedPoolError, paged_layout
from sglang_kvbm.integration.sglang.prefill_meter import attach_prefill_meter
from sglang_kvbm.integration.sglang.radix_cache import KvbmRadixCache
from sglang_kvbm.kv_layout import PagedKvLayout
from sglang_kvbm.metrics import KvbmMetrics

logger = logging.getLogger(__name__)


def create_kvbm_radix_cache(ctx: TreeCacheBuildContext) -> KvbmRadixCache:
    """The ``kvbm`` radix-cache backend: validate, size the tiers, wire the core."""
    _check_supported(ctx)
    # --kvbm-config exists on SGLang with this project's version patch applied.
    config = KvbmConfig.from_sources(json_text=getattr(ctx.server_args, "kvbm_config", None))
    _check_events(ctx, config, ctx.params.page_size)
    model_config = getattr(ctx, "model_config", None)
    return build_cache(
        ctx.params,
        config,
        model_path=str(getattr(model_config, "model_path", "") or getattr(ctx.server_args, "model_path", "")),
        revision=getattr(model_config, "revision", None),
        tp_rank=ctx.tp_rank,
        tp_size=ctx.tp_size,
        tp_worker=ctx.tp_worker,
    )


def build_cache(
    params: CacheInitParams,
    config: KvbmConfig,
    *,
    model_path: str = "",
    revision: Optional[str] = None,
    tp_rank: int = 0,
    tp_size: int = 1,
    tp_worker: Any = None,
) -> KvbmRadixCache:
    """A :class:`KvbmRadixCache` over the pools in ``params``, with the tiers ``config`` describes.

    ``model_path`` (with ``revision``, TP rank and size) names the disk tier's
    identity; ``tp_worker``, when given, lets the onboard policy measure prefill.
    """
    config.require_a_tier()
    allocator = params.token_to_kv_pool_allocator
    kvcache = allocator.get_kvcache()
    layout = paged_layout(kvcache, params.page_size)
    host_blocks = config.host_blocks(layout.block_bytes)
    device_pages = allocator.size // params.page_size
    if config.has_host and host_blocks < device_pages:
        logger.warning(
            "kvbm: the host tier (%d blocks) is smaller than the device KV pool (%d pages): "
            "it can only hold what the device already holds, so it will churn without hits. "
            "Raise DYN_KVBM_CPU_CACHE_GB to at least %.3g.",
            host_blocks,
            device_pages,
            device_pages * layout.block_bytes / GIB,
        )
    disk = policy = offload_filter = None
    if config.has_disk:
        fingerprint, description = server_fingerprint(
            model_path, layout, kvcache, revision=revision, tp_rank=tp_rank, tp_size=tp_size
        )
        disk, policy = _build_disk(config, layout, fingerprint, description)
        if tp_worker is not None:
            attach_prefill_meter(tp_worker, policy.prefill)
        offload_filter = None if config.disable_disk_offload_filter else FrequencyFilter()
    cache: Optional[KvbmRadixCache] = None
    metrics = KvbmMetrics(lambda: metrics_snapshot(cache, manager)) if config.metrics else None
    manager = LocalBlockManager(
        layout,
        host_blocks,
        pin=layout.is_cuda,
        disk=disk,
        offload_filter=offload_filter,
        policy=policy,
        observer=metrics,
    )
    sink = SglangEventSink()
    connector = KvbmConnector(manager, sink, min_offload_priority=config.host_offload_min_priority)
    logger.info(
        "kvbm: local backend, page %d tokens, block %d bytes (%d buffers); host tier %d blocks (%.2f GiB%s); "
        "disk tier %s",
        params.page_size,
        layout.block_bytes,
        len(layout.buffer_page_bytes),
        host_blocks,
        host_blocks * layout.block_bytes / GIB,
        ", pinned" if layout.is_cuda else "",
        "off" if disk is None else f"{disk.num_slots} blocks ({disk.num_slots * disk.slot_bytes / GIB:.2f} GiB) "
        f"in {disk.directory}, offload filter {'off' if offload_filter is None else 'on'}",
    )
    cache = KvbmRadixCache(params, connector, sink)
    if config.metrics:
        cache.endpoint = start_http(cache, manager, config, metrics)
        cache.add_closer(cache.endpoint.close)
    atexit.register(cache.close)  # flush the disk index and stop the copy threads
    return cache


def _build_disk(config: KvbmConfig, layout: PagedKvLayout, fingerprint: bytes, description: dict):
    page_size = layout.page_size
    slot_bytes = DiskStore.header_bytes_for(page_size) + layout.block_bytes
    blocks = config.disk_blocks(slot_bytes)
    found = probe(
        config.disk_cache_dir,
        blocks * slot_bytes,
        zerofill_fallback=config.disk_zerofill_fallback,
        disable_o_direct=config.disk_disable_o_direct,
        already_ours=DiskStore.existing_bytes(config.disk_cache_dir, fingerprint),
    )
    logger.info("kvbm: disk identity %s: %s", fingerprint.hex(), description)
    disk = DiskStore(
        probe=found, num_slots=blocks, block_bytes=layout.block_bytes, fingerprint=fingerprint, page_size=page_size
    )
    policy = OnboardPolicy(bytes_per_token=slot_bytes / page_size)
    policy.read.record(4 << 20, (4 << 20) / found.read_bytes_per_s)  # seeded by the probe, refined by real reads
    return disk, policy


def _check_events(ctx, config: KvbmConfig, page_size: int) -> None:
    """Refuse set-ups whose events Dynamo's router would drop or never match."""
    bad = [tier.medium for tier in Tier if tier.medium not in ROUTER_MEDIA]
    if bad:
        raise ConfigError(f"tier media {bad} are not accepted by Dynamo's indexer, which drops such events")
    if config.router_block_size is not None and config.router_block_size != page_size:
        raise ConfigError(
            f"SGLANG_KVBM_ROUTER_BLOCK_SIZE={config.router_block_size} but --page-size is {page_size}: events carry "
            f"one page per block, and the router drops every event of another block size (hit rate 0). "
            f"Start the router with --block-size {page_size} or SGLang with --page-size {config.router_block_size}"
        )
    if getattr(ctx.server_args, "kv_events_config", None):
        logger.info(
            "kvbm: KV events carry one page per block, block_size=%d, media GPU/CPU_PINNED/DISK: "
            "run Dynamo's router or indexer with --block-size %d",
            page_size,
            page_size,
        )


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
