"""What the tree's ``PoolTransfer``\ s ask of the tiers, pool by pool (see ``pool_group`` for the pools)."""

from __future__ import annotations

from typing import Optional

import torch
from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

from sglang_kvbm.core.pages import bare_pages
from sglang_kvbm.core.ports import StoreRequest


def restorable_lengths(hit: int, across_ranks: bool) -> list[int]:
    """The prefix lengths (pages) a load can restore, for SGLang to intersect across ranks.

    Every length up to ``hit`` is restorable (full-attention pages only). A lone
    rank needs just ``hit``; ranks that must agree get the last 32 lengths and
    every power of two below, so their intersection (SGLang's MIN-reduce over a
    mask it fills one entry per length) finds a common length near the shortest
    rank's hit without a per-page list.
    """
    if not hit:
        return []
    if not across_ranks:
        return [hit]
    near = range(max(1, hit - 31), hit + 1)
    powers = (1 << k for k in range(hit.bit_length()) if (1 << k) < near.start)
    return [*powers, *near]


def kv_transfer(transfers: list[PoolTransfer]) -> PoolTransfer:
    for transfer in transfers:
        if transfer.name == PoolName.KV:
            return transfer
    raise ValueError("the tree passed no KV transfer to the kvbm linker")


def sidecar_transfers(transfers: list[PoolTransfer], names) -> dict[str, PoolTransfer]:
    """The transfers of the sidecar pools ``names`` (SWA, MAMBA) among ``transfers``, by pool name."""
    return {t.name.value: t for t in transfers if t.name != PoolName.KV and t.name.value in names and t.keys}


def sidecar_stores(transfers: list[PoolTransfer], names, ready: tuple) -> dict[str, StoreRequest]:
    """One store per sidecar transfer of an offload: its keys, its pool's device slots (no events: see ``sidecars``)."""
    return {name: StoreRequest(tuple(t.keys), t.device_indices.to(torch.int64), bare_pages(t.keys).views, ready)
            for name, t in sidecar_transfers(transfers, names).items()}


def sidecar_loads(transfers: list[PoolTransfer], names) -> Optional[dict[str, PoolTransfer]]:
    """The sidecar transfers of a load, or None when a sidecar pool the tiers keep has none (not restorable)."""
    found = sidecar_transfers(transfers, names)
    if set(found) != set(names) or any(t.device_indices is None for t in found.values()):
        return None
    return found
