"""Building one worker's tiers from its KV pool and the configuration.

Everything that can be wrong with the set-up is refused here, at start-up,
with the variable or flag to change: a pool this library cannot page out byte
for byte, no tier configured, a disk directory that fails its probe, a router
block size that differs from the page size.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from typing import Any, Mapping, Optional

from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

from sglang_kvbm.config import GIB, ConfigError, KvbmConfig
from sglang_kvbm.core.content_digest import DigestCache
from sglang_kvbm.core.onboard_policy import OnboardPolicy
from sglang_kvbm.integration.sglang import l3_layout
from sglang_kvbm.integration.sglang.fingerprint import model_identity, server_fingerprint
from sglang_kvbm.integration.sglang.pool_group import PoolGroup, describe_pools
from sglang_kvbm.manager.block_manager import LocalBlockManager
from sglang_kvbm.manager.build import build_managers
from sglang_kvbm.manager.sidecars import SidecarStores
from sglang_kvbm.tiers.disk.store import DiskStore
from sglang_kvbm.tiers.registry import WorkerPools
from sglang_kvbm.transfer.kv_layout import PagedKvLayout

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Identity:
    """What a disk block's bytes depend on besides the pool's shape (see ``fingerprint``)."""

    model_path: str = ""
    revision: Optional[str] = None
    settings: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    ranks: Mapping[str, int] = dataclasses.field(default_factory=dict)
    download_dir: Optional[str] = None  # SGLang's --download-dir: where a hub id's snapshot is looked for first
    served_model_name: str = ""  # what shared objects' names carry, as SGLang's HiCache names its L3 pages


@dataclasses.dataclass
class Tiers:
    layout: PagedKvLayout
    manager: LocalBlockManager
    policy: Optional[OnboardPolicy]
    group: PoolGroup
    sidecars: SidecarStores


def build_tiers(
    params: CacheInitParams, config: KvbmConfig, identity: Identity, observer=None, offload_executor=None,
    disk_writer=None, disk_reader=None, forward_stream=None, components=(),
) -> Tiers:
    """The host and disk tiers below ``params``' device pools, as ``config`` describes them.

    A hybrid model's sidecar pools (sliding-window pages, Mamba states) get
    tiers of their own with as many blocks as the KV's: the byte budgets are
    split by each pool's share of a block.
    """
    config.require_a_tier()
    check_router_block_size(config, params.page_size)
    allocator = params.token_to_kv_pool_allocator
    kvcache = allocator.get_kvcache()
    group = describe_pools(params, components)
    layout = group.kv
    layouts = [layout] + [s.layout for s in group.sidecars]
    if layout.is_cuda:  # the copy streams are drawn apart from the scheduler's (current) and the forward's
        import torch

        for each in layouts[1:]:  # and apart from each other's: every pool's workers draw from one set
            each.share_streams(layout)
        layout.avoid_streams(torch.cuda.current_stream(layout.device), forward_stream)
    shares = [1.0] + [s.share for s in group.sidecars]
    settings = {**identity.settings, "pool_group": group.shape_id()}  # every pool's shape and dtypes
    pools = [("kv", layout)] + [(s.name, s.layout) for s in group.sidecars]
    layout_of = dict(pools)
    model: dict = {}

    def fingerprint(pool: str, rank_overrides: Mapping[str, int]) -> tuple[bytes, str]:
        if not model:  # the model's identity by content: read once, only when a tier needs it
            model.update(model_of(identity, config))
        return server_fingerprint(model, layout_of[pool], kvcache,
                                  settings=settings if pool == "kv" else {**settings, "stored_pool": pool},
                                  ranks={**identity.ranks, **rank_overrides})

    worker = WorkerPools(
        names=tuple(name for name, _ in pools), layouts=tuple(layouts), shares=tuple(shares), fingerprint=fingerprint,
        ranks=identity.ranks, served_model_name=identity.served_model_name,
        mla=isinstance(kvcache, MLATokenToKVPool),
        lanes={"disk_writer": disk_writer, "disk_reader": disk_reader},
    )
    built = build_managers(config, worker, allocator.size // params.page_size, observer=observer,
                           executor=offload_executor)
    managers = built.managers
    store = built.names.get("mooncake")
    if store is not None and "sglang.srt.managers.scheduler" in sys.modules:  # routers learn G4's names from SGLang
        l3_layout.advertise(l3_layout.layout(store, page_size=layout.page_size, mla=worker.mla,
                                             tp_size=int(identity.ranks.get("tp_size", 1)),
                                             pp_size=int(identity.ranks.get("pp_size", 1))))
    sidecars = SidecarStores({s.name: (m, s.window) for s, m in zip(group.sidecars, managers[1:])})
    per_pool = ", ".join(
        f"{name} {m.layout.block_bytes} bytes in {len(m.layout.buffer_page_bytes)} buffers"
        + (f", {m.host.capacity if m.host is not None else 0} host blocks, "
           + ", ".join(f"{c.blocks}/{c.capacity} {c.tier}" for c in m.counts() if c.tier != "host")
           if name != "kv" else "")
        for name, m in zip(worker.names, managers))
    logger.info(
        "kvbm: page %d tokens, %d bytes a KV block with its share of the other pools (%s; %d layers; "
        "`sglang-kvbm doctor --block-bytes %d --page-size %d` checks the room for it); host tier %d blocks "
        "(%.2f GiB%s); below host: %s",
        params.page_size, built.row_bytes, per_pool, layout.num_layers, built.row_bytes, params.page_size,
        built.host_blocks, sum(m.host.capacity * m.layout.block_bytes for m in managers if m.host is not None) / GIB,
        ", pinned" if layout.is_cuda else "", "; ".join(built.summary),
    )
    warn_small_pages(params.page_size, layout.block_bytes)
    return Tiers(layout, managers[0], built.policy, group, sidecars)


SMALL_PAGE = 8  # below this a block is a handful of tokens, and per-block work dominates


def warn_small_pages(page_size: int, block_bytes: int) -> None:
    """Every page is a block (one lookup entry, one pin, one event, one disk slot with its header): say what a small
    page costs and what to use instead (figures: benchmarks/README.md, section 3)."""
    if page_size >= SMALL_PAGE:
        return
    header = DiskStore.header_bytes_for(page_size)
    measured = (" (on the project's CPU benchmark, against SGLang's HiCache on the same trace: 1.7-1.8x its cache "
                "calls per request at --page-size 1, 0.85-0.88x at --page-size 16)" if page_size == 1 else "")
    logger.warning(
        "kvbm: --page-size %d makes every %s a block, and this library's scheduler-thread work is per block: a "
        "request's cache calls cost several times what they cost at --page-size 16%s; each disk block also carries "
        "a %d-byte header for %d bytes of KV. Use --page-size 16 (or 32, 64) with this library",
        page_size, "token" if page_size == 1 else f"{page_size} tokens", measured, header, block_bytes)


def model_of(identity: Identity, config: KvbmConfig) -> dict:
    """The model's identity by content (``fingerprint.model_identity``), with its cost in the log."""
    cache = DigestCache(config.digest_cache)
    model = model_identity(identity.model_path, identity.revision, identity.download_dir, cache=cache,
                           named=config.model_identity)
    files = len(model.get("content") or ())
    if cache.read_bytes:
        logger.info("kvbm: model identity: read %d files (%.2f GiB) for their SHA-256 in %.1f s (%.2f GiB/s); cached "
                    "in %s, a restart reads nothing (SGLANG_KVBM_MODEL_IDENTITY names the weights instead)", files,
                    cache.read_bytes / GIB, cache.read_seconds,
                    cache.read_bytes / GIB / max(cache.read_seconds, 1e-9), cache.path)
    else:
        logger.info("kvbm: model identity: %s (%d files, digests known)", model.get("note"), files)
    return model


def check_router_block_size(config: KvbmConfig, page_size: int) -> None:
    """Refuse a page size Dynamo's router would not match (it drops every event of another block size)."""
    if config.router_block_size is not None and config.router_block_size != page_size:
        raise ConfigError(
            f"SGLANG_KVBM_ROUTER_BLOCK_SIZE={config.router_block_size} but --page-size is {page_size}: events carry "
            f"one page per block, and the router drops every event of another block size (hit rate 0). "
            f"Start the router with --block-size {page_size} or SGLang with --page-size {config.router_block_size}"
        )
