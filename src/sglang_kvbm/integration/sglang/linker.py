"""``KvbmLinker``: KVBM's host and disk tiers behind SGLang's external-cache linker seam.

SGLang's default tree (``UnifiedRadixCache``) drives it through
``UnifiedCacheLinkerWrapper``:

* ``lookup`` (at admission): how many pages of the device-uncached tail the
  tiers hold; disk-resident ones start reading into verified staging at once.
  The wrapper intersects the answer across attention ranks.
* ``load`` (admission, after slots were allocated): pins every block, or
  refuses (the request recomputes the span); disk bytes are verified first.
  Where SGLang cannot take a refusal (0.5.21, ``compat``), ``lookup`` pins what
  it reports instead (``lookup_pins``), a failed copy is copied again before
  the forward reads it (``LayerCounter.redo``), and finished batches are
  reported by ``num_completed_loads`` / ``pop_completed_load``.
  Every attention rank answers the same (SGLang requires one branch on all
  ranks): a rank's refusal is reduced across them before ``load`` returns.
  So do pipeline stages, on hits, loads and offloads alike (``ranks.Stages``).
* ``start_layer_wise_loading`` / ``finish_layer_wise_loading``: the batch's
  copies run on the loader thread one layer at a time while the forward waits
  only for the layer it reads.
* ``offload`` (the tree's write-through, once per new node): device pages are
  copied down on a worker; ``num_completed_offloads`` / ``pop_completed_offload``
  report them in order, and the tree unlocks the node.

The tree publishes no events for an external store: this linker puts its
tiers' ``CPU_PINNED``/``DISK`` events on the cache's event stream itself (see
``hooks`` for how it reaches the cache).
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Optional

from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer
from sglang.srt.mem_cache.unified_cache.unified_cache_linker import UnifiedCacheLinker

from sglang_kvbm.config import KvbmConfig
from sglang_kvbm.core.connector import KvbmConnector
from sglang_kvbm.core.ports import StoreRequest
from sglang_kvbm.integration.sglang import hooks
from sglang_kvbm.integration.sglang.build import build_tiers
from sglang_kvbm.integration.sglang.cache_wrappers import wrap_cache
from sglang_kvbm.integration.sglang.compat import (
    event_format,
    offload_ready_events,
    refuse_what_this_sglang_cannot_carry,
    seam,
)
from sglang_kvbm.integration.sglang.event_order import EventOrderer
from sglang_kvbm.integration.sglang.events import SglangEventSink
from sglang_kvbm.integration.sglang.flags import check_installed_sglang
from sglang_kvbm.integration.sglang.lookup_pins import LookupPins
from sglang_kvbm.integration.sglang.page_identity import EventSettings, InsertContext
from sglang_kvbm.integration.sglang.pool_transfers import (
    kv_transfer,
    restorable_lengths,
    sidecar_loads,
    sidecar_stores,
)
from sglang_kvbm.integration.sglang.ranks import LinkerSetup, check_components, setup_of
from sglang_kvbm.integration.sglang.tier_query import TierQueries, TierTokens, tier_tokens
from sglang_kvbm.integration.sglang.worker_counter import KvbmLayerCounter
from sglang_kvbm.manager.layer_loader import LayerLoader
from sglang_kvbm.manager.loads import LoadBatches

logger = logging.getLogger(__name__)
# Installed when this module is imported (SGLang imports it to build the linker, before adopting it), not in a
# linker's constructor: resolving the hook targets keeps import frames alive, which would pin that linker.
hooks.install()
PUBLISH_INTERVAL_S = 0.05  # how fresh /stats and /metrics are
QUIESCE_TIMEOUT_S = 60.0  # reset() waits this long for copies in flight; later ones change nothing when they end


class KvbmLinker(UnifiedCacheLinker):
    def __init__(self, server_args, params, *, components=(), extra_config=None, forward_stream=None) -> None:
        check_installed_sglang()
        check_components(components, params)
        refuse_what_this_sglang_cannot_carry(server_args, params, components)
        self.forward_stream = forward_stream
        self.page_size = params.page_size
        self.setup: LinkerSetup = setup_of(server_args, params, extra_config or {})
        config: KvbmConfig = self.setup.config
        self._events_on = bool(params.enable_kv_cache_events)
        self._event_settings = (
            EventSettings(params.page_size, *event_format(params))
            if self._events_on or config.has_disk
            else None
        )
        self.sink = SglangEventSink(self._events_on, params.page_size)
        if self._events_on:
            logger.info("kvbm: KV events carry one page per block, block_size=%d, media GPU/CPU_PINNED/DISK: "
                        "run Dynamo's router or indexer with --block-size %d", params.page_size, params.page_size)
        self.orderer = EventOrderer()
        self.metrics = None
        if config.metrics and self.setup.serves_endpoint:
            from sglang_kvbm.observe.metrics import KvbmMetrics

            self.metrics = KvbmMetrics(self._metrics_snapshot)
        extra = extra_config or {}
        tiers = build_tiers(params, config, self.setup.identity, observer=self.metrics,
                            offload_executor=extra.get("offload_executor"), disk_writer=extra.get("disk_writer"),
                            disk_reader=extra.get("disk_reader"), forward_stream=forward_stream, components=components)
        self.layout, self.manager, self.policy = tiers.layout, tiers.manager, tiers.policy
        self.group, self.sidecars = tiers.group, tiers.sidecars
        self.connector = KvbmConnector(
            self.manager, self.sink, page_size=params.page_size,
            min_offload_priority=config.host_offload_min_priority, hit_rate_window=config.cache_stats_max_requests,
        )
        kvcache = params.token_to_kv_pool_allocator.get_kvcache()
        self.pools = {PoolName.KV: kvcache, **{PoolName(name): kvcache for name in self.sidecars.managers}}
        self.layer_done_counter = KvbmLayerCounter(self.layout.num_layers, self.policy, cuda=self.layout.is_cuda)
        if PoolName.MAMBA in self.pools:  # Mamba layers wait through the request pool (SGLang registers the KV pool's)
            params.req_to_token_pool.register_layer_transfer_counter(self.layer_done_counter)
        self.loader = LayerLoader(self.manager, self.layer_done_counter, observe=self.manager.observe,
                                  sidecars=self.sidecars.managers)
        self.loads = LoadBatches(self.connector, self.loader, self.layer_done_counter, self.sidecars)
        self.pins: Optional[LookupPins] = None
        if not seam().refusable_loads:  # SGLang cannot take a refused or failed load: see the module's docstring
            self.pins = LookupPins(self.connector)
            self.layer_done_counter.redo = self.loader.redo
        self.queries = TierQueries(self.tier_tokens)
        self.cache = None
        self._insert: Optional[tuple] = None  # (key, priority) of the insert in progress
        self.offloads_refused_outside_insert = 0
        self.endpoint = None
        if self.metrics is not None:
            from sglang_kvbm.observe.endpoint import start_http

            self.endpoint = start_http(self, config, self.metrics, port_offset=self.setup.dp_rank)
        self._published_at = 0.0
        self._closed = False
        self.quiesce_timeout = QUIESCE_TIMEOUT_S

    # -- the contract ---------------------------------------------------------------

    def lookup(self, rid: str, transfers: list[PoolTransfer]) -> list[int]:
        keys = kv_transfer(transfers).keys or []
        hit = self.connector.lookup(rid, keys)
        if self.pins is not None:
            hit = self.pins.pin(rid, keys, hit)
        stages, across = self.setup.stages, self.setup.ranks_agreeing > 1
        if self.sidecars:  # hybrid: only boundaries whose window pages / state the sidecar tiers hold too
            lengths = self.sidecars.restorable(keys, hit, every=across or stages.many) if hit else []
            return stages.common(lengths, len(keys))
        return restorable_lengths(stages.shortest(hit), across)

    def load(self, rid: str, transfers: list[PoolTransfer]) -> bool:
        kv = kv_transfer(transfers)
        if self.pins is not None:  # pinned by its lookup; every rank pinned at least what the ranks agreed on
            self.loads.queue(rid, self.pins.take(rid, kv.keys), kv.device_indices)
            return True
        plan = side = None
        try:
            plan = self.connector.acquire(kv.keys)
            if plan is not None and self.sidecars:  # all or none: the KV with every sidecar pool's part
                wanted = sidecar_loads(transfers, self.sidecars.managers)
                try:
                    side = self.sidecars.acquire({n: t.keys for n, t in wanted.items()}) if wanted else None
                except BaseException:
                    self.connector.cancel(plan)
                    raise
                if side is None:
                    self.connector.refuse(plan, "a sliding-window page or Mamba state it needs is not held")
                    plan = None
        finally:  # also when acquire raised: the other ranks are in the reduction already
            if not self.setup.all_agree(plan is not None, self.cache):
                if plan is not None:
                    self.connector.cancel(plan)
                    self.sidecars.release(side or {}, reused=False)
                plan = None
        if plan is None:
            return False
        side = {name: (side[name], t.device_indices) for name, t in wanted.items()} if side else None
        self.loads.queue(rid, plan, kv.device_indices, side)
        return True

    def start_layer_wise_loading(self) -> int:
        # On CUDA the copies wait (on the GPU) for the scheduler's stream, which made the slots, and the forward's,
        # which may still write pages the slots reuse: SGLang's own pair of events (HiCache fences loads alike).
        ready = self.record_offload_ready() if self.layout.is_cuda and self.loads.pending() else ()
        if self.pins is not None:
            self.pins.release_all()  # looked up, not admitted: looked up again next round
        return self.loads.start(ready)

    def finish_layer_wise_loading(self, counter_index: int) -> bool:
        """After the forward: every layer handed to the device (the current stream now waits for the last)."""
        return self.setup.stages.agree(self.loads.finish(counter_index))  # SGLang reduces over attention ranks only

    def cancel_queued_load(self, rid: str) -> bool:
        if self.pins is not None:
            self.pins.release(rid)
        return self.loads.cancel(rid)

    def num_completed_loads(self) -> int:
        """SGLang 0.5.21, each step: batches whose layers all landed (their requests' nodes unlock)."""
        return self.loads.landed()

    def pop_completed_load(self) -> list[str]:
        return self.loads.pop_landed()

    def record_offload_ready(self) -> list:
        """CUDA: events after which the scheduler's slots and the forward's writes are ready (SGLang's own where its
        linker base has them)."""
        return super().record_offload_ready() if seam().offload_ready else offload_ready_events(self.forward_stream)

    def offload(self, transfers: list[PoolTransfer], session_id: Optional[str] = None) -> bool:
        if self._insert is None:
            # Only an insert says which tokens the pages hold; the tree offers the node again later.
            self.offloads_refused_outside_insert += 1
            if self.offloads_refused_outside_insert == 1:
                logger.warning("kvbm: the tree offered pages outside an insert; refused (their tokens are unknown)",
                               stack_info=True)
            return False
        key, priority = self._insert
        context = InsertContext(key, priority, self.page_size, self._event_settings)
        kv = kv_transfer(transfers)
        keys = tuple(kv.keys)
        ready = tuple(self.record_offload_ready()) if self.layout.is_cuda else ()
        request = StoreRequest(keys, kv.device_indices, functools.partial(context.describe, keys), ready)
        if not self.connector.offload(request, priority=priority):
            return False
        if self.sidecars:  # the node's sliding-window pages and Mamba state complete with its KV, as one offload
            self.sidecars.store(sidecar_stores(transfers, self.sidecars.managers, ready))
        return True

    def num_completed_offloads(self) -> int:
        # Called by the scheduler at the top of every step: the linker's per-step hook.
        self.loads.poll()
        self.queries.answer_pending()
        count = self.connector.completed_offloads()
        if self.sidecars:
            count = min(count, self.sidecars.completed())
        # A node unlocks on every pipeline stage at once, or the stages' trees drift apart.
        count = self.setup.stages.completed_offloads(count, self._pop_offload, self.connector.pending_offloads())
        if self.metrics is not None:
            now = time.monotonic()
            if now - self._published_at >= PUBLISH_INTERVAL_S:  # the idle scheduler loops without pause
                self._published_at = now
                from sglang_kvbm.observe.endpoint import stats_of

                self.connector.publish(stats_of(self))
        return count

    def pop_completed_offload(self) -> bool:
        return self.setup.stages.pop_offload(self._pop_offload)

    def _pop_offload(self) -> bool:
        ok = self.connector.pop_completed_offload()
        return self.sidecars.pop() and ok if self.sidecars else ok

    def quiesce(self, timeout: Optional[float] = None) -> bool:
        """Wait until no copy touches device or tier memory (loads, offloads, disk reads and writes); False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        idle = self.loads.quiesce(timeout)
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        flushed = self.connector.flush(left)
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        return self.sidecars.wait(left) and flushed and idle

    def _quiesce_or_warn(self, what: str) -> None:
        # Loads first, unbounded: they write device pages and read rows their plans pin, and end in a copy's time.
        self.loads.quiesce()
        if not self.quiesce(self.quiesce_timeout):
            logger.warning("kvbm: %s: copies still in flight after %.0f s; they will register nothing when they end",
                           what, self.quiesce_timeout)

    def drop_tiers(self) -> None:
        """Forget every block of every tier, announcing their removal (the device cache stays as it is).

        For what makes the tiers' bytes wrong while the tree keeps its nodes (a
        weight update without a flush): offloads the tree waits for still
        complete, in order, as not held.
        """
        self._quiesce_or_warn("dropping the tiers")
        self.manager.drop()
        self.sidecars.drop()
        self.connector.poll()

    def reset(self) -> None:
        """Quiesce the copies and forget every tier (the tree publishes ``AllBlocksCleared``)."""
        self._quiesce_or_warn("reset")
        if self.pins is not None:
            self.pins.release_all()
        self.loads.drop()
        self.connector.reset()
        self.sidecars.reset()
        self.setup.stages.forget_offloads()  # the tree drops its pending offloads after this
        self.sink.clear()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.endpoint is not None:
            self.endpoint.close()
        self.loads.close()
        self.connector.close()
        self.sidecars.close()

    # -- what the hooks give (see ``hooks``) -------------------------------------------

    def attach_kvbm(self, cache) -> None:
        """Wrap this cache instance's ``insert``, ``init_load_back`` and ``take_events`` (``cache_wrappers``)."""
        self.cache = cache
        wrap_cache(self, cache)

    # -- the truth about this worker's tiers ----------------------------------------------

    def tier_tokens(self, token_ids, *, extra_key=None, cache_salt=None) -> TierTokens:
        """Tokens of a sequence each tier would serve now (scheduler thread; others use ``query_tiers``)."""
        return tier_tokens(self.cache, self.connector, token_ids, extra_key=extra_key, cache_salt=cache_salt,
                           sidecars=self.sidecars)

    def query_tiers(self, token_ids, *, extra_key=None, cache_salt=None, timeout: float = 10.0) -> TierTokens:
        return self.queries.ask(token_ids, extra_key=extra_key, cache_salt=cache_salt, timeout=timeout)

    def _metrics_snapshot(self) -> dict:
        from sglang_kvbm.observe.endpoint import metrics_of

        return metrics_of(self.connector.snapshot())
