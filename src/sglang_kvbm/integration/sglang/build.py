"""Building one worker's tiers from its KV pool and the configuration.

Everything that can be wrong with the set-up is refused here, at start-up,
with the variable or flag to change: a pool this library cannot page out byte
for byte, no tier configured, a disk directory that fails its probe, a router
block size that differs from the page size.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import math
import os
import sys
from typing import Any, Mapping, Optional

from sglang.srt.mem_cache.cache_init_params import CacheInitParams

from sglang_kvbm.config import GIB, ConfigError, KvbmConfig
from sglang_kvbm.core.content_digest import DigestCache
from sglang_kvbm.core.offload_filter import FrequencyFilter
from sglang_kvbm.core.onboard_policy import OnboardPolicy
from sglang_kvbm.integration.sglang import l3_layout
from sglang_kvbm.integration.sglang.fingerprint import model_identity, server_fingerprint
from sglang_kvbm.integration.sglang.pool_group import PoolGroup, describe_pools
from sglang_kvbm.tiers.disk.setup import probe
from sglang_kvbm.tiers.disk.store import DiskStore
from sglang_kvbm.tiers.manager import LocalBlockManager
from sglang_kvbm.tiers.sidecars import SidecarStores
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
    served_model_name: str = ""  # what G4's object names carry, as SGLang's HiCache names its L3 pages


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
    row_bytes = round(sum(each.block_bytes * share for each, share in zip(layouts, shares)))  # per KV block
    host_blocks = config.host_blocks(row_bytes)
    device_pages = allocator.size // params.page_size
    if config.has_host and host_blocks < device_pages:
        logger.warning(
            "kvbm: the host tier (%d blocks) is smaller than the device KV pool (%d pages): "
            "it can only hold what the device already holds, so it will churn without hits. "
            "Raise DYN_KVBM_CPU_CACHE_GB to at least %.3g.",
            host_blocks, device_pages, device_pages * row_bytes / GIB,
        )
    settings = {**identity.settings, "pool_group": group.shape_id()}  # every pool's shape and dtypes
    pools = [("kv", layout)] + [(s.name, s.layout) for s in group.sidecars]
    disks: list = [None] * len(pools)
    disk_blocks, policy = 0, None
    model = model_of(identity, config) if config.has_disk or config.has_g4 else None
    if config.has_disk:
        slot_bytes = [DiskStore.header_bytes_for(each.page_size) + each.block_bytes for each in layouts]
        disk_blocks = config.disk_blocks(round(sum(n * share for n, share in zip(slot_bytes, shares))))
        identities = [server_fingerprint(
            model, pool_layout, kvcache, settings=settings if name == "kv" else {**settings, "stored_pool": name},
            ranks=identity.ranks,
        ) for name, pool_layout in pools]
        found = probe(
            config.disk_cache_dir, sum(_blocks(disk_blocks, share) * n for n, share in zip(slot_bytes, shares)),
            zerofill_fallback=config.disk_zerofill_fallback,
            disable_o_direct=config.disk_disable_o_direct,
            already_ours=sum(DiskStore.existing_bytes(config.disk_cache_dir, f) for f, _ in identities),
        )
        for i, ((name, pool_layout), (fingerprint, description)) in enumerate(zip(pools, identities)):
            logger.info("kvbm: disk identity %s (%s): %s", fingerprint.hex(), name, description)
            disks[i] = DiskStore(probe=found, num_slots=_blocks(disk_blocks, shares[i]), block_bytes=pool_layout.block_bytes,
                                 fingerprint=fingerprint, page_size=pool_layout.page_size, pin=layout.is_cuda,
                                 siblings=tuple(f for f, _ in identities if f != fingerprint))
        policy = OnboardPolicy(bytes_per_token=disks[0].slot_bytes / layout.page_size)
        policy.read.record(4 << 20, (4 << 20) / found.read_bytes_per_s)  # seeded by the probe, refined by real reads
    g4 = _g4(config, identity, group, layout, kvcache, model) if config.has_g4 else None
    managers = []
    for (name, pool_layout), disk, share in zip(pools, disks, shares):
        kv = name == "kv"  # the tests' gated threads and the metrics observe the KV pool's copies
        managers.append(LocalBlockManager(
            pool_layout, _blocks(host_blocks, share), pin=layout.is_cuda, disk=disk,
            offload_filter=None if disk is None or config.disable_disk_offload_filter else FrequencyFilter(),
            policy=policy, observer=observer if kv else None,  # one disk, one read meter: sidecars wait by it too
            executor=offload_executor if kv else None, writer=disk_writer if kv else None,
            reader=disk_reader if kv else None, g4=g4 if kv else None,
            wait_floor=None if config.load_wait_ms is None else config.load_wait_ms / 1000,
            g4_filter=FrequencyFilter() if kv and g4 is not None and config.mooncake_offload_filter else None,
        ))
    manager = managers[0]
    sidecars = SidecarStores({s.name: (m, s.window) for s, m in zip(group.sidecars, managers[1:])})
    disk = manager.disk
    names = ("kv", *(s.name for s in group.sidecars))
    per_pool = ", ".join(f"{name} {m.layout.block_bytes} bytes in {len(m.layout.buffer_page_bytes)} buffers"
                         + (f", {m.host.capacity if m.host is not None else 0} host / {m.disk.num_slots if m.disk is not None else 0} disk blocks"
                            if name != "kv" else "") for name, m in zip(names, managers))
    logger.info(
        "kvbm: local backend, page %d tokens, %d bytes a KV block with its share of the other pools (%s; %d layers; "
        "`sglang-kvbm doctor --block-bytes %d --page-size %d` checks the room for it); host tier %d blocks "
        "(%.2f GiB%s); disk tier %s; G4 %s",
        params.page_size, row_bytes, per_pool, layout.num_layers, row_bytes, params.page_size, host_blocks,
        sum(m.host.capacity * m.layout.block_bytes for m in managers if m.host is not None) / GIB, ", pinned" if layout.is_cuda else "",
        "off" if disk is None else f"{disk_blocks} blocks ({sum(m.disk.num_slots * m.disk.slot_bytes for m in managers) / GIB:.2f} "
        f"GiB) in {config.disk_cache_dir}, offload filter {'off' if config.disable_disk_offload_filter else 'on'}",
        "off" if g4 is None else f"Mooncake master {config.mooncake_master}, objects {g4.prefix}_<page hash>"
        f"{g4.suffix}, write-through from host",
    )
    warn_small_pages(params.page_size, layout.block_bytes)
    return Tiers(layout, manager, policy, group, sidecars)


SMALL_PAGE = 8  # below this a block is a handful of tokens, and per-block work dominates


def warn_small_pages(page_size: int, block_bytes: int) -> None:
    """Every page is a block (one lookup entry, one pin, one event, one disk slot with its header): say what a small
    page costs and what to use instead (figures: benchmarks/README.md, section 3)."""
    if page_size >= SMALL_PAGE:
        return
    header = DiskStore.header_bytes_for(page_size)
    measured = (" (on the project's CPU benchmark: 2.6 ms of cache calls per request against 1.0 ms at "
                "--page-size 16; SGLang's HiCache 0.66 and 0.82 ms)" if page_size == 1 else "")
    logger.warning(
        "kvbm: --page-size %d makes every %s a block, and this library's scheduler-thread work is per block: a "
        "request's cache calls cost several times what they cost at --page-size 16%s; each disk block also carries "
        "a %d-byte header for %d bytes of KV. Use --page-size 16 (or 32, 64) with this library",
        page_size, "token" if page_size == 1 else f"{page_size} tokens", measured, header, block_bytes)


def _g4(config: KvbmConfig, identity: Identity, group: PoolGroup, layout: PagedKvLayout, kvcache, model: dict):
    """The shared tier's client (it connects on the G4 thread, retrying while the master does not answer)."""
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

    from sglang_kvbm.tiers.mooncake.store import G4Settings, G4Store, object_suffix

    if importlib.util.find_spec("mooncake") is None:
        raise ConfigError("SGLANG_KVBM_MOONCAKE_MASTER is set but Mooncake's client is not installed in this "
                          "environment: pip install 'sglang-kvbm[mooncake]' (or [mooncake-cuda]), or unset it")
    if group.sidecars:
        logger.warning("kvbm: G4 (SGLANG_KVBM_MOONCAKE_MASTER) holds full-attention KV only; this model's "
                       "sliding-window/Mamba state is not shared yet, so G4 is off for it")
        return None
    ranks = identity.ranks
    # One tag for every rank and pipeline stage of the worker (the router is told one): the tp and pp ranks are in
    # each name's suffix instead.
    shared = {**ranks, "tp_rank": 0, "pp_rank": 0, "dp_rank": 0, "attn_cp_rank": 0}
    fingerprint, _ = server_fingerprint(model, layout, kvcache, settings=identity.settings, ranks=shared)
    settings = G4Settings(config.mooncake_master, config.mooncake_metadata, config.mooncake_protocol,
                          int(config.mooncake_segment_gb * GIB), hostname=_advertised_host(config.mooncake_master))
    # --served-model-name names the objects (as HiCache's L3 pages); without one, the tag alone: it names the model by
    # content, where a path or directory name would part two hosts holding the same model
    name = identity.served_model_name
    mla = isinstance(kvcache, MLATokenToKVPool)
    suffix = object_suffix(int(ranks.get("tp_rank", 0)), mla=mla,
                           pp_rank=int(ranks.get("pp_rank", 0)), pp_size=int(ranks.get("pp_size", 1)))
    g4 = G4Store(settings, fingerprint=fingerprint, model_name=name, suffix=suffix,
                 page_size=layout.page_size, block_bytes=layout.block_bytes)
    if "sglang.srt.managers.scheduler" in sys.modules:  # under SGLang's scheduler: tell routers the objects' names
        l3_layout.advertise(l3_layout.layout(g4, page_size=layout.page_size, tp_size=int(ranks.get("tp_size", 1)),
                                             pp_size=int(ranks.get("pp_size", 1)), mla=mla))
    return g4


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


def _advertised_host(master: str) -> str:
    """The address other Mooncake clients reach this one at: MOONCAKE_LOCAL_HOSTNAME (SGLang's name for it), else
    127.0.0.1 beside a local master, else this host's address."""
    import socket

    if os.environ.get("MOONCAKE_LOCAL_HOSTNAME"):
        return os.environ["MOONCAKE_LOCAL_HOSTNAME"]
    if master.rpartition(":")[0] in ("127.0.0.1", "localhost"):
        return "127.0.0.1"
    return socket.gethostbyname(socket.gethostname())


def _blocks(kv_blocks: int, share: float) -> int:
    """A pool's blocks in a tier of ``kv_blocks`` KV blocks (at least 16 sidecar blocks: a few nodes' worth)."""
    return kv_blocks if share == 1.0 or not kv_blocks else max(16, math.ceil(kv_blocks * share))


def check_router_block_size(config: KvbmConfig, page_size: int) -> None:
    """Refuse a page size Dynamo's router would not match (it drops every event of another block size)."""
    if config.router_block_size is not None and config.router_block_size != page_size:
        raise ConfigError(
            f"SGLANG_KVBM_ROUTER_BLOCK_SIZE={config.router_block_size} but --page-size is {page_size}: events carry "
            f"one page per block, and the router drops every event of another block size (hit rate 0). "
            f"Start the router with --block-size {page_size} or SGLang with --page-size {config.router_block_size}"
        )
