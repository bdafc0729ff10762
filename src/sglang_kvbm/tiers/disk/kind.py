"""The disk tier's entry in ``tiers.registry``: one probed directory, a store per pool, KVBM's read policy."""

from __future__ import annotations

import logging

from sglang_kvbm.base.values import GIB
from sglang_kvbm.core.offload_filter import FrequencyFilter
from sglang_kvbm.core.onboard_policy import OnboardPolicy
from sglang_kvbm.tiers.registry import KindPlan, TierKind, WorkerPools, pool_blocks

logger = logging.getLogger(__name__)
NAME = "disk"


def enabled(config) -> bool:
    return config.has_disk


def server_identities(pools: WorkerPools) -> set[bytes]:
    """Every disk identity of this server: each pool's, at every TP rank and PP stage (each rank claims its own
    directory under the same root, and must not reclaim its siblings' while they have not claimed theirs yet: a
    restarted TP server would otherwise find its other ranks' disk tiers gone)."""
    ranks = pools.ranks
    tp_size, pp_size = int(ranks.get("tp_size", 1)), int(ranks.get("pp_size", 1))
    return {pools.fingerprint(name, {"tp_rank": tp, "pp_rank": pp})[0]
            for name in pools.names for tp in range(tp_size) for pp in range(pp_size)}


def build(config, pools: WorkerPools) -> KindPlan:
    """A store per pool in one probed directory, each under its pool's identity (they never read each other's)."""
    # Here, not at the top: the command line and doctor import every kind (tiers.registry), and the store needs
    # torch and numpy.
    from sglang_kvbm.tiers.disk.setup import probe, warn_placement
    from sglang_kvbm.tiers.disk.store import DiskStore
    from sglang_kvbm.tiers.disk.tier import DiskTier

    slot_bytes = [DiskStore.header_bytes_for(each.page_size) + each.block_bytes for each in pools.layouts]
    kv_blocks = config.disk_blocks(round(sum(n * share for n, share in zip(slot_bytes, pools.shares))))
    identities = [pools.fingerprint(name, {}) for name in pools.names]
    server = server_identities(pools)
    warn_placement(config.disk_cache_dir)  # tmpfs, ramfs or the default /tmp: works, but not as a disk tier should
    found = probe(
        config.disk_cache_dir, sum(pool_blocks(kv_blocks, share) * n for n, share in zip(slot_bytes, pools.shares)),
        zerofill_fallback=config.disk_zerofill_fallback,
        disable_o_direct=config.disk_disable_o_direct,
        already_ours=sum(DiskStore.existing_bytes(config.disk_cache_dir, f) for f, _ in identities),
    )
    pin = pools.kv.is_cuda
    stores = []
    for name, layout, share, (fingerprint, description) in zip(pools.names, pools.layouts, pools.shares, identities):
        logger.info("kvbm: disk identity %s (%s): %s", fingerprint.hex(), name, description)
        stores.append(DiskStore(probe=found, num_slots=pool_blocks(kv_blocks, share), block_bytes=layout.block_bytes,
                                fingerprint=fingerprint, page_size=layout.page_size, pin=pin,
                                siblings=tuple(f for f in server if f != fingerprint)))
    policy = OnboardPolicy(bytes_per_token=stores[0].slot_bytes / pools.kv.page_size,
                           always=config.disk_onboard == "always")
    policy.read.record(4 << 20, (4 << 20) / found.read_bytes_per_s)  # seeded by the probe, refined by real reads

    def factory(store: DiskStore, kv: bool):
        def make(manager) -> DiskTier:
            return DiskTier(store, manager.host,
                            offload_filter=None if config.disable_disk_offload_filter else FrequencyFilter(),
                            meter=policy.read,  # one disk, one read meter: sidecars wait by it too
                            generation=manager.generation, observe=manager.observe,
                            writer=pools.lanes.get("disk_writer") if kv else None,
                            reader=pools.lanes.get("disk_reader") if kv else None,
                            worker_init=manager.layout.worker_init())
        return make

    summary = (f"{kv_blocks} blocks ({sum(s.num_slots * s.slot_bytes for s in stores) / GIB:.2f} GiB) in "
               f"{config.disk_cache_dir}, offload filter {'off' if config.disable_disk_offload_filter else 'on'}, "
               f"onboard {config.disk_onboard}")
    return KindPlan([factory(store, i == 0) for i, store in enumerate(stores)], policy, summary)


KIND = TierKind(NAME, enabled, build)
