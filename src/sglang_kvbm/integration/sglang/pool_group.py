"""Every device pool a model's KV lives in, described as paged layouts on the forward's layers.

SGLang's tree hands a linker one ``PoolTransfer`` per pool, each with its own
index space (``hybrid_cache/linker_pool_assembler.py`` describes them as a
``DevicePoolGroup``; its ``resolve_hybrid_device_pool_group`` refuses plain
MHA/MLA, sliding-window-only hybrids, MHA + Mamba, scale buffers, and draft
pools outside the Mamba group, so the same shape is built here for all of them):

* **KV** (``PoolName.KV``, every page, token slots): every full-attention
  layer's page, plus the page of every draft pool (EAGLE/MTP draft runners
  share the target's token slots: ``CacheInitParams.sidecar_draft_device_pools``
  / ``mtp_draft_device_pools``) and any per-token scale buffer. One block:
  target KV, draft KV and scales land together or not at all.
* **SWA** (``PoolName.SWA``, SWA-pool slots): the sliding-window layers' page,
  needed for the last ``window`` pages before a boundary.
* **MAMBA** (``PoolName.MAMBA``, one state slot per node): every Mamba layer's
  conv and temporal state at a node's last page, valid for exactly that boundary.

Each layout's ``layers[l]`` lists the buffers forward layer ``l`` (global id
minus the pool's ``start_layer``) reads, so each pool loads layer by layer
under the forward like plain KV. Draft buffers ride the last layer: the draft
forward runs after the target's, which waited for it.
"""

from __future__ import annotations

import dataclasses
import hashlib

from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, HybridReqToTokenPool
from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

from sglang_kvbm.integration.sglang.compat import draft_pools, mtp_draft_mamba_pools, swa_retain_window
from sglang_kvbm.integration.sglang.kv_pool import UnsupportedPoolError, pool_buffers
from sglang_kvbm.transfer.kv_layout import PagedKvLayout

SWA, MAMBA = "swa", "mamba"
MAMBA_STATE_TOKENS = 512  # the tiers size one Mamba state per this many tokens of KV (one per node, not per page)


@dataclasses.dataclass(frozen=True)
class Sidecar:
    """A pool stored beside the KV blocks, under the same block ids, in tiers of its own.

    A boundary of ``p`` pages is restorable only if the sidecar holds the blocks
    ``keys[p - window : p]`` (SWA: the window's pages; Mamba: the boundary's own state).
    """

    name: str
    layout: PagedKvLayout
    window: int
    share: float = 1.0  # blocks per KV block the tiers give it (sliding-window pages: one; Mamba: one per node)


@dataclasses.dataclass(frozen=True)
class PoolGroup:
    kv: PagedKvLayout
    sidecars: tuple[Sidecar, ...]
    num_layers: int
    shape: dict  # what a disk block's bytes depend on besides the model (part of each pool's identity)

    def shape_id(self) -> str:
        return hashlib.sha256(repr(sorted(self.shape.items())).encode()).hexdigest()[:16]


def describe_pools(params, components=()) -> PoolGroup:
    """The pool group of ``params``' device pools, or :class:`UnsupportedPoolError` with the reason."""
    page = params.page_size
    kvcache = params.token_to_kv_pool_allocator.get_kvcache()
    components = set(components) or {ComponentType.FULL}
    sidecars: list[Sidecar] = []
    if isinstance(kvcache, (SWAKVPool, HybridLinearKVPool)) and type(kvcache) not in (SWAKVPool, HybridLinearKVPool):
        # e.g. QSATokenToKVPool (a HybridLinearKVPool with a compressed-K indexer cache): state a page copy would miss
        raise UnsupportedPoolError(
            f"--radix-cache-backend kvbm does not store {type(kvcache).__name__} (it keeps state beyond its full, "
            f"sliding-window and Mamba pools, e.g. an indexer cache): run this model without it"
        )
    if isinstance(kvcache, SWAKVPool):
        full, start = kvcache.full_kv_pool, kvcache.start_layer
        full_ids = {g: local for g, (local, is_swa) in kvcache.layers_mapping.items() if not is_swa}
        swa_ids = {g: local for g, (local, is_swa) in kvcache.layers_mapping.items() if is_swa}
        num_layers = max(kvcache.layers_mapping) - start + 1
    elif isinstance(kvcache, HybridLinearKVPool):
        full, start = kvcache.full_kv_pool, kvcache.start_layer
        full_ids, swa_ids = dict(kvcache.full_attention_layer_id_mapping), {}
        mamba_ids = dict(getattr(params.req_to_token_pool, "mamba_map", {}))
        num_layers = max([*full_ids, *mamba_ids]) - start + 1
    else:
        full, start, swa_ids = kvcache, 0, {}
        full_ids = {layer: layer for layer in range(len(pool_buffers(kvcache, page).layers))}
        num_layers = len(full_ids)
    if ComponentType.SWA in components and not swa_ids:
        raise UnsupportedPoolError(f"the tree keeps sliding-window state but the KV pool is {type(kvcache).__name__}")
    drafts = draft_pools(params)
    if drafts and swa_ids:
        raise UnsupportedPoolError(
            "--radix-cache-backend kvbm does not store the draft KV of a sliding-window hybrid yet (its draft pools "
            "split into full and sliding-window slots): run speculative decoding without it, or without kvbm"
        )
    if mtp_draft_mamba_pools(params):
        raise UnsupportedPoolError("--radix-cache-backend kvbm does not store MTP draft Mamba states: run without it")
    kv, shape = _kv_layout(full, full_ids, start, num_layers, drafts, page)
    if swa_ids:
        window = -(-swa_retain_window(params) // page)
        swa_parts = pool_buffers(kvcache.swa_kv_pool, page)
        swa = _on_layers(swa_parts, swa_ids, start, num_layers, page)
        sidecars.append(Sidecar(SWA, swa, window))
        shape.update(swa_bytes=swa.buffer_page_bytes, swa_window=window,
                     swa_dtypes=_dtypes(swa_parts.buffers))
    if ComponentType.MAMBA in components:
        mamba, mamba_dtypes = _mamba_layout(params, num_layers)
        sidecars.append(Sidecar(MAMBA, mamba, 1, share=1 / max(1, MAMBA_STATE_TOKENS // page)))
        shape.update(mamba_bytes=mamba.buffer_page_bytes, mamba_dtypes=mamba_dtypes)
    if sidecars and params.attn_cp_size > 1:
        raise UnsupportedPoolError("--radix-cache-backend kvbm does not store hybrid pools under context parallelism")
    return PoolGroup(kv, tuple(sidecars), num_layers, shape)


def _on_layers(parts, ids: dict, start: int, num_layers: int, page: int, extra=()) -> PagedKvLayout:
    """A pool's buffers, placed on the forward layers that read them (``ids``: global layer -> pool layer)."""
    layers = [() for _ in range(num_layers)]
    for global_id, local in ids.items():
        layers[global_id - start] = parts.layers[local]
    for layer, buffers in extra:
        layers[layer] = (*layers[layer], *buffers)
    return PagedKvLayout(parts.buffers, page, parts.tokens_per_row, layers)


def _kv_layout(full, full_ids, start, num_layers, drafts, page) -> tuple[PagedKvLayout, dict]:
    parts = pool_buffers(full, page)
    buffers, extra = list(parts.buffers), []
    for draft in drafts:  # same token slots as the target: same block, loaded on the last layer
        d = pool_buffers(draft, page)
        if d.tokens_per_row != parts.tokens_per_row:
            raise UnsupportedPoolError("the draft KV pool's layout differs from the target's: run without kvbm")
        extra.append((num_layers - 1, tuple(len(buffers) + i for i in range(len(d.buffers)))))
        buffers += d.buffers
    parts = dataclasses.replace(parts, buffers=tuple(buffers))
    kv = _on_layers(parts, full_ids, start, num_layers, page, extra)
    shape = {"page": page, "layers": num_layers, "kv_bytes": kv.buffer_page_bytes, "drafts": len(drafts),
             "kv_dtypes": _dtypes(parts.buffers)}
    return kv, shape


def _mamba_layout(params, num_layers: int) -> tuple[PagedKvLayout, tuple[str, ...]]:
    """Every Mamba layer's conv and temporal state rows, one row per state slot."""
    r2t = params.req_to_token_pool
    if not isinstance(r2t, HybridReqToTokenPool):
        raise UnsupportedPoolError(f"the tree keeps Mamba state but the request pool is {type(r2t).__name__}")
    if type(r2t).translate_mamba_indices is not HybridReqToTokenPool.translate_mamba_indices:
        raise UnsupportedPoolError(
            f"{type(r2t).__name__} maps Mamba slots to physical rows at run time (a unified memory pool): "
            f"--radix-cache-backend kvbm cannot address its states; run without it"
        )
    pool = r2t.mamba_pool
    cache = pool.mamba_cache
    refused = [name for name in ("replayssm_d", "replayssm_k", "replayssm_g", "replayssm_rawv", "replayssm_rawk",
                                 "replayssm_beta") if getattr(cache, name, None) is not None]
    if refused or getattr(pool, "_slot_siblings", ()) or getattr(r2t, "mamba_ckpt_pool", None) is not None:
        raise UnsupportedPoolError(
            "--radix-cache-backend kvbm stores Mamba conv and temporal states; this pool also keeps side states "
            f"({', '.join(refused) or 'slot siblings or an int8 checkpoint pool'}) that SGLang's linker seam does not "
            "carry: run without --enable-linear-replayssm / --enable-int8-mamba-checkpoint, or without kvbm"
        )
    states = [cache.temporal, *cache.conv]
    buffers, layers = [], [() for _ in range(num_layers)]
    for global_id, index in sorted(r2t.mamba_map.items()):
        layers[global_id - r2t.start_layer] = tuple(range(len(buffers), len(buffers) + len(states)))
        buffers += [state[index] for state in states]
    # The SSM dtype (--mamba-ssm-dtype) is in the identity: bf16 and fp16 states have one size, not the same bits.
    return PagedKvLayout(buffers, 1, 1, layers), _dtypes(buffers)


def _dtypes(buffers) -> tuple[str, ...]:
    """Each buffer's element type: what a page's bytes mean (target, draft, scale and state buffers alike)."""
    return tuple(str(b.dtype) for b in buffers)
