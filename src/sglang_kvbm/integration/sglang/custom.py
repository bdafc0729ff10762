"""For a server that builds SGLang's KV pool and allocator itself and runs its own model.

:func:`build_cache` makes SGLang's default tree (``UnifiedRadixCache``) with a
:class:`~sglang_kvbm.integration.sglang.linker.KvbmLinker` attached, exactly as
SGLang's scheduler does for ``--radix-cache-backend kvbm``, and returns a
:class:`KvbmCache`. Its :meth:`KvbmCache.prefix` does what the scheduler does at
admission: match every tier, load the lower-tier part into fresh device slots
(layer-wise, waited for), and insert it into the tree, with the matched node
locked across its own load, so eviction under pool pressure can never hand
back slots the load was reading into or from.
"""

from __future__ import annotations

import dataclasses
import itertools
from array import array
from typing import Optional

import torch
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.unified_cache.components import ComponentType
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
from sglang.srt.sampling.sampling_params import SamplingParams

from sglang_kvbm.config import KvbmConfig
from sglang_kvbm.integration.sglang.build import Identity
from sglang_kvbm.integration.sglang.compat import device_prefix_len, loaded_tail, path_device_indices
from sglang_kvbm.integration.sglang.linker import KvbmLinker
from sglang_kvbm.integration.sglang.tier_query import TierTokens

_ids = itertools.count()


@dataclasses.dataclass(frozen=True)
class PrefixHit:
    """A prefix whose KV is in the device pool at ``indices``; locked until :meth:`KvbmCache.release`."""

    indices: torch.Tensor  # token slots of the matched prefix, in order
    node: int  # the tree node that ends the prefix
    device_tokens: int  # found in the device pool
    loaded_tokens: int  # brought back from host or disk
    lock: object  # what releases the node


def ensure_runtime_context(device: str) -> None:
    """SGLang's tree reads a published runtime configuration; publish a plain one if none is."""
    from sglang.srt.runtime_context import get_disagg, publish
    from sglang.srt.server_args import ServerArgs

    try:
        get_disagg()
    except ValueError:
        publish(ServerArgs(model_path="dummy", device=device), role="tokenizer")


def build_cache(
    params: CacheInitParams, config: KvbmConfig, *, identity: Optional[Identity] = None, offload_executor=None,
    disk_writer=None, disk_reader=None,
) -> "KvbmCache":
    """SGLang's default tree over ``params``' pools with KVBM's tiers below it (``config``).

    ``identity`` names what the disk tier's bytes depend on (the model, its
    settings, this rank); ``offload_executor`` replaces the device -> host copy
    worker, ``disk_writer`` and ``disk_reader`` (``LaneExecutor``) the disk
    threads (tests hold copies in flight with them; one job at a time each).
    """
    kvcache = params.token_to_kv_pool_allocator.get_kvcache()
    ensure_runtime_context(str(kvcache.device))
    params.tree_components = (ComponentType.FULL,)
    tree = UnifiedRadixCache(params)
    # Without an identity, the disk tier's names this pool's shape and this process's ranks (from params' groups).
    extra = {"config": config, "identity": identity, "offload_executor": offload_executor, "disk_writer": disk_writer,
             "disk_reader": disk_reader}
    linker = KvbmLinker(None, params, components={ComponentType.FULL}, extra_config=extra)
    tree.init_cache_linker(linker)  # adopting it attaches the linker to this tree (see hooks)
    kvcache.register_layer_transfer_counter(linker.layer_done_counter)
    return KvbmCache(tree, linker)


class KvbmCache:
    def __init__(self, tree: UnifiedRadixCache, linker: KvbmLinker) -> None:
        self.tree = tree
        self.linker = linker
        self.page_size = tree.page_size

    @property
    def connector(self):
        return self.linker.connector

    def prefix(self, token_ids, *, extra_key: Optional[str] = None, cache_salt: Optional[str] = None) -> PrefixHit:
        """Match ``token_ids`` in every tier and bring the lower-tier part into the device pool.

        At most ``len(token_ids) - 1`` tokens, in whole pages (the last token is
        computed to produce logits). The returned node is locked: call
        :meth:`release` when the indices are no longer read.
        """
        self.poll()
        tree = self.tree
        tokens = array("q", token_ids)
        usable = max(0, len(tokens) - 1) // self.page_size * self.page_size
        key = RadixKey(tokens[:usable], extra_key, cache_salt=cache_salt)
        req = Req(f"kvbm-prefix-{next(_ids)}", "", tokens, SamplingParams(max_new_tokens=1),
                  extra_key=extra_key, cache_salt=cache_salt)
        match = tree.match_prefix(MatchPrefixParams(key=key, req=req))
        node, device = match.last_device_node, device_prefix_len(match)
        lock = tree.inc_lock_ref(node).to_dec_params()  # held across the load: evictions cannot take it
        loaded = 0
        if match.host_hit_length:
            req.last_node = node
            if getattr(match, "device_indices", None) is not None:  # SGLang 0.5.21 loads after these
                req.prefix_indices = match.device_indices
            result = tree.init_load_back(
                InitLoadBackParams(best_match_node=match.best_match_node, host_hit_length=match.host_hit_length, req=req)
            )
            loaded, inserted = loaded_tail(result)
            if inserted is not None:  # the tail is in the tree already, loading
                node, lock, loaded = self._land_inserted(result[1], node, lock, loaded)
            elif loaded:
                node, lock, loaded = self._land(req, key, node, lock, device, loaded)
        indices = path_device_indices(tree, node)[: device + loaded]
        return PrefixHit(indices, node, device, loaded, lock)

    def _land(self, req, key: RadixKey, node, lock, device: int, loaded: int):
        """Wait for the layer-wise load, put the loaded pages in the tree, and move the lock onto them."""
        tree = self.tree
        slots = tree.linker.private_load_indices[req.rid]
        tree.ready_to_load_host_cache()
        if tree.finish_external_linker_loads([req]):  # the load failed: recompute
            tree.token_to_kv_pool_allocator.free(slots)
            return node, lock, 0
        values = torch.cat([path_device_indices(tree, node)[:device].to(torch.int64), slots.to(torch.int64)])
        # Pages another insert added meanwhile are duplicates: the tree frees those of ours itself.
        result = tree.insert(InsertParams(key=key[: device + loaded], value=values, prev_prefix_len=device))
        new_node = result.last_device_node
        new_lock = tree.inc_lock_ref(new_node).to_dec_params()
        tree.dec_lock_ref(node, lock)
        return new_node, new_lock, loaded

    def _land_inserted(self, tail_node, node, lock, loaded: int):
        """Wait for a load whose pages the tree holds already (it cannot fail: ``LayerCounter.redo``), and move the
        lock onto them."""
        tree = self.tree
        new_lock = tree.inc_lock_ref(tail_node).to_dec_params()
        index = tree.ready_to_load_host_cache()
        self.linker.layer_done_counter.finish(index)
        tree.check_hicache_events()  # the tree lets go of its own pin on the loaded node
        tree.dec_lock_ref(node, lock)
        return tail_node, new_lock, loaded

    def release(self, hit: PrefixHit) -> None:
        """The caller no longer reads ``hit.indices``: the prefix may be evicted again."""
        self.tree.dec_lock_ref(hit.node, hit.lock)

    def insert(self, token_ids, slots: torch.Tensor, hit: Optional[PrefixHit] = None, *, extra_key=None,
               cache_salt=None):
        """Cache the KV of ``token_ids`` (whole pages): ``hit.indices`` for its prefix, ``slots`` for the rest.

        The tree takes ownership of ``slots``; where another insert cached some of
        those pages meanwhile, the tree frees the duplicates itself. Its
        write-through then copies the new pages down to the tiers below.
        """
        self.poll()
        reused = hit.indices if hit is not None else torch.empty(0, dtype=torch.int64)
        values = torch.cat([reused.to(torch.int64), slots.to(torch.int64)])
        key = RadixKey(array("q", token_ids[: len(values)]), extra_key, cache_salt=cache_salt)
        return self.tree.insert(InsertParams(key=key, value=values, prev_prefix_len=len(reused)))

    def evict(self, num_tokens: int) -> None:
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        self.poll()  # nodes whose copies finished are unlocked, and evictable, only after a poll
        self.tree.evict(EvictParams(num_tokens=num_tokens))

    def poll(self) -> None:
        """What SGLang's scheduler does each step: finish offloads (unlocking their nodes).

        ``prefix``, ``insert`` and ``evict`` poll first; a server that waits long between
        calls may poll itself, so finished copies unlock their nodes sooner."""
        self.tree.check_hicache_events()

    def tier_tokens(self, token_ids, *, extra_key=None, cache_salt=None) -> TierTokens:
        return self.linker.tier_tokens(token_ids, extra_key=extra_key, cache_salt=cache_salt)

    def flush(self, timeout: Optional[float] = None) -> bool:
        """Wait for every copy under way and finish the offloads (tools, tests, shutdown)."""
        done = self.linker.connector.flush(timeout)
        self.poll()
        return done

    def close(self) -> None:
        self.flush(timeout=60)
        self.tree.release_host_resources()  # closes the linker
