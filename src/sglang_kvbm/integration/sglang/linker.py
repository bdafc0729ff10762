"""``KvbmLinker``: KVBM's host and disk tiers behind SGLang's external-cache linker seam.

SGLang's default tree (``UnifiedRadixCache``) drives it through ``UnifiedCacheLinkerWrapper``; each method
of the contract states who calls it, what it may wait for and what its answer means to SGLang. In short:
``lookup`` reports what the tiers hold, ``load`` pins it or refuses (``admission``), the loader thread
copies a batch layer by layer under the forward, and ``offload`` (the tree's write-through) copies new
nodes down, reported in order. Every attention rank and pipeline stage answers the same (``ranks``).
The tree publishes no events for an external store: the linker puts its tiers' ``CPU_PINNED``/``DISK``
events on the cache's event stream itself (``cache_wrappers``; ``hooks`` for how it reaches the cache).
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
from sglang_kvbm.integration.sglang.admission import Admissions
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
from sglang_kvbm.integration.sglang.pool_transfers import kv_transfer, sidecar_stores
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
            self.manager.defer_reads()  # a request waits for its reads in the queue, not the scheduler thread
            self.layer_done_counter.redo = self.loader.redo
        self.admissions = Admissions(self.connector, self.sidecars, self.loads, self.setup, self.pins)
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
        """Scheduler thread, at admission: the prefix lengths (pages) of the device-uncached tail the tiers can restore.

        Disk reads start here, not waited for; remote (G4) tiers' reads are, up to SGLANG_KVBM_LOAD_WAIT_MS plus 3x
        the read meter's estimate (capped by the load timeout); PP stages MIN-reduce. ``[]``: a miss, the request
        computes the tail. 0.5.21: also pins what it reports (``lookup_pins``); it waits for no read: with reads in
        flight it reports what they will serve and the request is kept waiting (``defers_load``).
        """
        return self.admissions.lookup(rid, transfers)

    def load(self, rid: str, transfers: list[PoolTransfer]) -> bool:
        """Scheduler thread, once the tree gave the request's slots: pin every block (and sidecar part) for the next
        ``start_layer_wise_loading``, copying nothing yet. Waits for this request's own disk/G4 reads in flight, up to
        SGLANG_KVBM_LOAD_WAIT_MS plus 3x the read meter's estimate, then MIN-reduces over stages and attention ranks.
        False: SGLang frees the slots and the request recomputes the span. 0.5.21 cannot take a refusal
        (``compat``): there it takes the lookup's pins and is always True."""
        return self.admissions.load(rid, transfers, self.cache)

    def start_layer_wise_loading(self) -> int:
        """Scheduler thread, before the forward: hand every queued load to the loader thread as one batch, copied
        layer by layer while the forward waits per layer (``layer_done_counter``). Never blocks (CUDA: records the
        scheduler's and forward's events first). The counter index; -1: nothing was queued. 0.5.21: lookup pins
        not loaded are let go (those requests are looked up again)."""
        # On CUDA the copies wait (on the GPU) for the scheduler's stream, which made the slots, and the forward's,
        # which may still write pages the slots reuse: SGLang's own pair of events (HiCache fences loads alike).
        ready = self.record_offload_ready() if self.layout.is_cuda and self.loads.pending() else ()
        if self.pins is not None:
            self.pins.release_all()  # looked up, not admitted: looked up again next round
        return self.loads.start(ready)

    def finish_layer_wise_loading(self, counter_index: int) -> bool:
        """Scheduler thread, after the forward (0.5.22 on): wait until the loader handed over every layer of the
        batch (CPU: copied; CUDA: enqueued, the current stream waiting for the last), at most a copy's time, then
        MIN-reduce over PP stages (SGLang reduces over attention ranks). False: a copy failed on some rank; SGLang
        aborts the batch's requests (503) and none of their KV joins the tree."""
        return self.setup.stages.agree(self.loads.finish(counter_index))

    def cancel_queued_load(self, rid: str) -> bool:
        """Scheduler thread, as a request goes away: unpin its load not started yet (and its lookup's pins). Never
        blocks. False: none is queued (a started batch is concluded by ``finish_layer_wise_loading``, on 0.5.21 by
        ``pop_completed_load``). 0.5.21 calls it on every request release."""
        if self.pins is not None:
            self.pins.forget(rid)
        return self.loads.cancel(rid)

    def num_completed_loads(self) -> int:
        """SGLang 0.5.21 only, scheduler thread, each step: started batches whose layers were all handed over, not
        popped yet; finishes them (rows are let go once their copies end). Never waits for a copy, but copies a
        failed batch again if its forward did not (``LayerCounter.redo``). SGLang pops the attention ranks' MIN."""
        return self.loads.landed()

    def pop_completed_load(self) -> list[str]:
        """SGLang 0.5.21, scheduler thread, once per batch ``num_completed_loads`` counted: its request ids (the tree
        unlocks their nodes). Never blocks."""
        return self.loads.pop_landed()

    def record_offload_ready(self) -> list:
        """Scheduler thread, CUDA only (``offload`` and ``start_layer_wise_loading`` call it): events after which the
        scheduler's slots and the forward's writes are ready; SGLang's own where its linker base has them (0.5.23),
        else ``compat``'s. Records; never waits."""
        return super().record_offload_ready() if seam().offload_ready else offload_ready_events(self.forward_stream)

    def offload(self, transfers: list[PoolTransfer], session_id: Optional[str] = None) -> bool:
        """Scheduler thread, in the tree's insert (write-through of a new node): reserve tier rows and queue the
        pages' copies down to worker threads; never blocks. True: the tree keeps the node locked until
        ``pop_completed_offload``. False (outside an insert, tokens unknown; or priority below
        DYN_KVBM_HOST_OFFLOAD_PREFIX_MIN_PRIORITY): the tree unlocks it, and may offer it again."""
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
        keys = kv.keys  # the transfer's own list (the tree builds one per call and never changes it): not copied
        ready = tuple(self.record_offload_ready()) if self.layout.is_cuda else ()
        request = StoreRequest(keys, kv.device_indices, functools.partial(context.describe, keys), ready)
        if not self.connector.offload(request, priority=priority):
            return False
        if self.sidecars:  # the node's sliding-window pages and Mamba state complete with its KV, as one offload
            self.sidecars.store(sidecar_stores(transfers, self.sidecars.managers, ready))
        return True

    def num_completed_offloads(self) -> int:
        """Scheduler thread, first thing each step (the linker's per-step hook: polls copies, answers ``/tiers``,
        publishes stats every 50 ms): how many of the oldest offloads finished, in order. Never waits for a copy; PP
        stages MIN-reduce, so a node unlocks on every stage at once. SGLang pops the attention ranks' MIN."""
        self.loads.poll()
        self.queries.answer_pending()
        count = self.connector.completed_offloads()
        if self.sidecars:
            count = min(count, self.sidecars.completed())
        count = self.setup.stages.completed_offloads(count, self._pop_offload, self.connector.pending_offloads())
        if self.metrics is not None:
            now = time.monotonic()
            if now - self._published_at >= PUBLISH_INTERVAL_S:  # the idle scheduler loops without pause
                self._published_at = now
                from sglang_kvbm.observe.endpoint import stats_of

                self.connector.publish(stats_of(self))
        return count

    def pop_completed_offload(self) -> bool:
        """Scheduler thread, once per offload ``num_completed_offloads`` counted, oldest first: True when every page
        (and sidecar part) is held below; False: not stored, the tree unlocks the node unmarked. Never blocks."""
        return self.setup.stages.pop_offload(self._pop_offload)

    def _pop_offload(self) -> bool:
        ok = self.connector.pop_completed_offload()
        return self.sidecars.pop() and ok if self.sidecars else ok

    def quiesce(self, timeout: Optional[float] = None) -> bool:
        """Wait until no copy touches device or tier memory (loads, offloads, disk and G4 I/O); False when ``timeout``
        ran out. Scheduler thread (weight updates) or a test's."""
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
        """Forget every block of every tier, announcing their removal (the device cache stays as it is): for what
        makes the tiers' bytes wrong while the tree keeps its nodes (a weight update without a flush); offloads the
        tree waits for still complete, in order, as not held. Scheduler thread; waits as ``reset`` does."""
        self._quiesce_or_warn("dropping the tiers")
        self.manager.drop()
        self.sidecars.drop()
        self.connector.poll()

    def reset(self) -> None:
        """Scheduler thread, on a cache flush: wait for the loads in flight (a copy's time), then up to
        ``quiesce_timeout`` (60 s) for offloads and disk/G4 I/O (copies still running then register nothing), and
        forget every tier, pin and queued load. The tree then drops its pending offloads and publishes
        ``AllBlocksCleared``."""
        self._quiesce_or_warn("reset")
        if self.pins is not None:
            self.pins.release_all()
        self.loads.drop()
        self.connector.reset()
        self.sidecars.reset()
        self.setup.stages.forget_offloads()  # the tree drops its pending offloads after this
        self.sink.clear()

    def close(self) -> None:
        """At shutdown (the tree's ``release_host_resources``, scheduler thread): stop the endpoint, wait for the
        loader to hand over what it holds, stop every tier's threads (queued copies are cancelled) and close the
        tiers. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.endpoint is not None:
            self.endpoint.close()
        self.loads.close()
        self.connector.close()
        self.sidecars.close()

    # -- what the hooks give (see ``hooks``, ``cache_wrappers``) ---------------------------

    def attach_kvbm(self, cache) -> None:
        """Wrap this cache instance's ``insert``, ``init_load_back`` and ``take_events`` (``cache_wrappers``)."""
        self.cache = cache
        wrap_cache(self, cache)

    def begin_insert(self, key, priority: Optional[int]) -> None:
        """Scheduler thread, as the tree's ``insert`` starts: the offloads it makes store ``key``'s pages at
        ``priority`` (no key: they are refused). Never blocks."""
        self._insert = (key, priority or 0) if key is not None else None

    def end_insert(self) -> None:
        """Scheduler thread, as that insert returns or raises: later offloads are outside an insert (refused)."""
        self._insert = None

    def defers_load(self, rid: str) -> bool:
        """Scheduler thread, SGLang 0.5.21, as the tree's ``init_load_back`` starts (on every rank and stage, for
        the same request): True when some rank's lookup for ``rid`` reported reads still in flight; the tree then
        answers None and SGLang keeps the request waiting (its next lookup pins what landed). Never waits for a read
        (one MIN-reduce over ranks and stages where there are several)."""
        if self.pins is None:
            return False
        if self.setup.all_agree(not self.pins.deferred(rid), self.cache):
            return False
        self.pins.unpin(rid)  # this rank may have pinned (another rank waits): the next lookup pins again
        self.pins.mark_deferred(rid)
        return True

    def wait_while_idle(self) -> bool:
        """Scheduler thread, SGLang 0.5.21, when it has no batch to run (``hooks``: before its ``on_idle``): wait
        for the first read some deferred request waits for, at most until that request's wait runs out, instead of
        spinning through rounds. False: none waits."""
        return self.pins is not None and self.pins.wait_idle()

    def staged_blocks(self, rid: str) -> int:
        """Scheduler thread, after ``load``: blocks of ``rid``'s queued load read from below host (0: none, or no load
        queued), which SGLang reports as storage hits. Never blocks."""
        plan = self.loads.queued_plan(rid)
        return 0 if plan is None else plan.staged_blocks

    def join_tier_events(self, events: list) -> list:
        """Scheduler thread, in the tree's ``take_events``: ``events`` with the tiers' events of the step after them,
        in an order Dynamo's indexer accepts; events off: ``events`` as given (nothing polled). Never blocks."""
        if not self._events_on:  # the step's check_hicache_events polled the copies already
            return events
        self.connector.poll()  # copies that landed during the step publish with it
        return self.orderer.order(events + self.sink.take())

    # -- the truth about this worker's tiers ----------------------------------------------

    def tier_tokens(self, token_ids, *, extra_key=None, cache_salt=None) -> TierTokens:
        """Tokens of a sequence each tier would serve now (scheduler thread; others use ``query_tiers``)."""
        return tier_tokens(self.cache, self.connector, token_ids, extra_key=extra_key, cache_salt=cache_salt,
                           sidecars=self.sidecars)

    def query_tiers(self, token_ids, *, extra_key=None, cache_salt=None, timeout: float = 10.0) -> TierTokens:
        """Any other thread (``/tiers``): ``tier_tokens``, answered by the scheduler thread at its next step; waits
        up to ``timeout`` for the answer."""
        return self.queries.ask(token_ids, extra_key=extra_key, cache_salt=cache_salt, timeout=timeout)

    def _metrics_snapshot(self) -> dict:
        from sglang_kvbm.observe.endpoint import metrics_of

        return metrics_of(self.connector.snapshot())
