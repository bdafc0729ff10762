"""Building one worker's tiers from its KV pool and the configuration.

Everything that can be wrong with the set-up is refused here, at start-up,
with the variable or flag to change: a pool this library cannot page out byte
for byte, no tier configured, a disk directory that fails its probe, a router
block size that differs from the page size.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Mapping, Optional

from sglang.srt.mem_cache.cache_init_params import CacheInitParams

from sglang_kvbm.backends.local.disk.setup import probe
from sglang_kvbm.backends.local.disk.store import DiskStore
from sglang_kvbm.backends.local.manager import LocalBlockManager
from sglang_kvbm.config import GIB, ConfigError, KvbmConfig
from sglang_kvbm.core.offload_filter import FrequencyFilter
from sglang_kvbm.core.onboard_policy import OnboardPolicy
from sglang_kvbm.integration.sglang.fingerprint import server_fingerprint
from sglang_kvbm.integration.sglang.kv_pool import paged_layout
from sglang_kvbm.kv_layout import PagedKvLayout

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Identity:
    """What a disk block's bytes depend on besides the pool's shape (see ``fingerprint``)."""

    model_path: str = ""
    revision: Optional[str] = None
    settings: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    ranks: Mapping[str, int] = dataclasses.field(default_factory=dict)
    download_dir: Optional[str] = None  # SGLang's --download-dir: where a hub id's snapshot is looked for first


@dataclasses.dataclass
class Tiers:
    layout: PagedKvLayout
    manager: LocalBlockManager
    policy: Optional[OnboardPolicy]


def build_tiers(
    params: CacheInitParams, config: KvbmConfig, identity: Identity, observer=None, offload_executor=None,
    disk_writer=None, disk_reader=None, forward_stream=None,
) -> Tiers:
    """The host and disk tiers below ``params``' device pool, as ``config`` describes them."""
    config.require_a_tier()
    check_router_block_size(config, params.page_size)
    allocator = params.token_to_kv_pool_allocator
    kvcache = allocator.get_kvcache()
    layout = paged_layout(kvcache, params.page_size)
    if layout.is_cuda:  # the copy streams are drawn apart from the scheduler's (current) and the forward's
        import torch

        layout.avoid_streams(torch.cuda.current_stream(layout.device), forward_stream)
    host_blocks = config.host_blocks(layout.block_bytes)
    device_pages = allocator.size // params.page_size
    if config.has_host and host_blocks < device_pages:
        logger.warning(
            "kvbm: the host tier (%d blocks) is smaller than the device KV pool (%d pages): "
            "it can only hold what the device already holds, so it will churn without hits. "
            "Raise DYN_KVBM_CPU_CACHE_GB to at least %.3g.",
            host_blocks, device_pages, device_pages * layout.block_bytes / GIB,
        )
    disk = policy = offload_filter = None
    if config.has_disk:
        fingerprint, description = server_fingerprint(
            identity.model_path, layout, kvcache, revision=identity.revision,
            settings=identity.settings, ranks=identity.ranks, download_dir=identity.download_dir,
        )
        disk, policy = _build_disk(config, layout, fingerprint, description)
        offload_filter = None if config.disable_disk_offload_filter else FrequencyFilter()
    manager = LocalBlockManager(
        layout, host_blocks, pin=layout.is_cuda, disk=disk, offload_filter=offload_filter, policy=policy,
        observer=observer, executor=offload_executor, writer=disk_writer, reader=disk_reader,
    )
    logger.info(
        "kvbm: local backend, page %d tokens, block %d bytes (%d buffers, %d layers); host tier %d blocks (%.2f GiB%s); "
        "disk tier %s",
        params.page_size, layout.block_bytes, len(layout.buffer_page_bytes), layout.num_layers, host_blocks,
        host_blocks * layout.block_bytes / GIB, ", pinned" if layout.is_cuda else "",
        "off" if disk is None else f"{disk.num_slots} blocks ({disk.num_slots * disk.slot_bytes / GIB:.2f} GiB) "
        f"in {disk.directory}, offload filter {'off' if offload_filter is None else 'on'}",
    )
    return Tiers(layout, manager, policy)


def _build_disk(config: KvbmConfig, layout: PagedKvLayout, fingerprint: bytes, description: dict):
    slot_bytes = DiskStore.header_bytes_for(layout.page_size) + layout.block_bytes
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
        probe=found, num_slots=blocks, block_bytes=layout.block_bytes, fingerprint=fingerprint, page_size=layout.page_size,
        pin=layout.is_cuda,
    )
    policy = OnboardPolicy(bytes_per_token=slot_bytes / layout.page_size)
    policy.read.record(4 << 20, (4 << 20) / found.read_bytes_per_s)  # seeded by the probe, refined by real reads
    return disk, policy


def check_router_block_size(config: KvbmConfig, page_size: int) -> None:
    """Refuse a page size Dynamo's router would not match (it drops every event of another block size)."""
    if config.router_block_size is not None and config.router_block_size != page_size:
        raise ConfigError(
            f"SGLANG_KVBM_ROUTER_BLOCK_SIZE={config.router_block_size} but --page-size is {page_size}: events carry "
            f"one page per block, and the router drops every event of another block size (hit rate 0). "
            f"Start the router with --block-size {page_size} or SGLang with --page-size {config.router_block_size}"
        )
