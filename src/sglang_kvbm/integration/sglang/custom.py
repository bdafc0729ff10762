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
from sglang_kvbm.integration.sglang.compat import admit_match, device_prefix_len, loaded_tail, path_device_indices
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
    pending: Optional["_Pending"] = None  # the load still running (``prefix(wait=False)``): :meth:`KvbmCache.land`


@dataclasses.dataclass(frozen=True)
class _Pending:
    """A layer-wise load under way: what :meth:`KvbmCache.land` needs to finish it."""

    req: Req
    key: Optional[RadixKey]  # None: the loaded pages are in the tree already (SGLang 0.5.21)
    index: int  # the load's consumer index (its batch) on the layer counter
    slots: torch.Tensor  # the device slots the load writes


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
    disk_writer=None, disk_reader=None, forward_stream=None,
) -> "KvbmCache":
    """SGLang's default tree over ``params``' pools with KVBM's tiers below it (``config``).

    ``identity`` names what the disk tier's bytes depend on (the model, its
    settings, this rank); ``offload_executor`` replaces the device -> host copy
    worker, ``disk_writer`` and ``disk_reader`` (``LaneExecutor``) the disk
    threads (tests hold copies in flight with them; one job at a time each).
    ``forward_stream`` is the CUDA stream the model's forward writes the pool on
    (SGLang's ``forward_stream``): an offload then also waits for what that
    stream had queued when the tree handed the pages over.
    """
    kvcache = params.token_to_kv_pool_allocator.get_kvcache()
    ensure_runtime_context(str(kvcache.device))
    params.tree_components = (ComponentType.FULL,)
    tree = UnifiedRadixCache(params)
    # Without an identity, the disk tier's names this pool's shape and this process's ranks (from params' groups).
    extra = {"config": config, "identity": identity, "offload_executor": offload_executor, "disk_writer": disk_writer,
             "disk_reader": disk_reader}
    linker = KvbmLinker(None, params, components={ComponentType.FULL}, extra_config=extra,
                        forward_stream=forward_stream)
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

    def prefix(self, token_ids, *, extra_key: Optional[str] = None, cache_salt: Optional[str] = None,
               wait: bool = True) -> PrefixHit:
        """Match ``token_ids`` in every tier and bring the lower-tier part into the device pool.

        At most ``len(token_ids) - 1`` tokens, in whole pages (the last token is
        computed to produce logits). The returned node is locked: call
        :meth:`release` when the indices are no longer read.

        With ``wait=False`` the lower-tier part loads layer by layer while the
        caller's forward runs: reading a layer through the pool
        (``get_key_buffer(layer)``, as SGLang's attention backends do) waits for
        that layer alone. After the forward, :meth:`land` finishes the load.
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
        if not match.host_hit_length:
            return PrefixHit(path_device_indices(tree, node)[:device], node, device, 0, lock)
        admit_match(req, match)
        result = tree.init_load_back(
            InitLoadBackParams(best_match_node=match.best_match_node, host_hit_length=match.host_hit_length, req=req)
        )
        loaded, inserted = loaded_tail(result)
        if not loaded:
            return PrefixHit(path_device_indices(tree, node)[:device], node, device, 0, lock)
        if inserted is not None:  # the tail is in the tree already, loading: hold it, let go of the matched node
            tail = result[1]
            tail_lock = tree.inc_lock_ref(tail).to_dec_params()
            tree.dec_lock_ref(node, lock)
            node, lock, slots, key = tail, tail_lock, inserted, None
        else:
            slots = tree.linker.private_load_indices[req.rid]
            key = key[: device + loaded]
        index = tree.ready_to_load_host_cache()  # the layer-wise load starts
        indices = torch.cat([path_device_indices(tree, node)[:device].to(torch.int64), slots.to(torch.int64)]) \
            if key is not None else path_device_indices(tree, node)[: device + loaded]
        hit = PrefixHit(indices, node, device, loaded, lock, _Pending(req, key, index, slots))
        if wait:
            return self.land(hit)
        self.linker.layer_done_counter.set_consumer(index)  # what SGLang's worker does before the forward
        return hit

    def land(self, hit: PrefixHit) -> PrefixHit:
        """Finish ``hit``'s load (after the forward that read it, for ``prefix(wait=False)``): wait for its last
        layers and put the loaded pages in the tree, locked; ``hit`` is spent, release the returned one.

        If the load failed, the returned hit's ``loaded_tokens`` is 0 and its indices end at the device part: a
        forward that read the loaded part must be recomputed from there."""
        pending = hit.pending
        if pending is None:
            return hit
        tree, node, lock = self.tree, hit.node, hit.lock
        counter = self.linker.layer_done_counter
        if counter.consumer_index == pending.index:
            counter.set_consumer(-1)  # the next forward reads no load unless it is given one
        if pending.key is None:  # SGLang 0.5.21: in the tree already; a failed load is redone (LayerCounter.redo)
            counter.finish(pending.index)
            tree.check_hicache_events()  # the tree lets go of its own pin on the loaded node
            return dataclasses.replace(hit, pending=None)
        if tree.finish_external_linker_loads([pending.req]):  # the load failed: recompute
            tree.token_to_kv_pool_allocator.free(pending.slots)
            return PrefixHit(hit.indices[: hit.device_tokens], node, hit.device_tokens, 0, lock)
        # Pages another insert added meanwhile are duplicates: the tree frees those of ours itself.
        result = tree.insert(InsertParams(key=pending.key, value=hit.indices, prev_prefix_len=hit.device_tokens))
        new_node = result.last_device_node
        new_lock = tree.inc_lock_ref(new_node).to_dec_params()
        tree.dec_lock_ref(node, lock)
        indices = path_device_indices(tree, new_node)[: len(hit.indices)]
        return PrefixHit(indices, new_node, hit.device_tokens, hit.loaded_tokens, new_lock)

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
