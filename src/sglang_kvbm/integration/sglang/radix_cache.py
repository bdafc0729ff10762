"""``KvbmRadixCache``: SGLang's ``RadixCache`` with KVBM tiers below it.

It follows SGLang's host-hit contract (the one ``FlexKVRadixCache`` uses):

* ``insert`` (every checkpoint of a request) wraps the pages it added as blocks
  and starts their copy down; the node is locked until the copy has read them,
  so evicting it can never free a page a copy is still reading.
* ``match_prefix`` extends the device match with the pages the lower tiers hold
  (``host_hit_length``); ``init_load_back`` then allocates device pages, copies
  the KV back (all or nothing) and hangs a new node under the device match.
* eviction frees device pages as usual; the lower-tier copies stay.

Completions are drained where the scheduler calls the cache: a
``--radix-cache-backend`` cache is not polled per step (only HiCache, FlexKV and
LMCache are). Every entry point the scheduler uses each step, plus
``take_events`` (which the event publisher calls after each step and when
idle), drains first. That keeps the plugin free of scheduler hooks; the only
cost is that with events off, an idle server releases its copy locks on the
next request rather than at once, which holds no memory anyone is waiting for.
"""

from __future__ import annotations

import dataclasses
import functools
import queue
from array import array
from concurrent.futures import Future
from typing import Optional

import torch
from sglang.srt.mem_cache.base_prefix_cache import (
    CacheRequestHandle,
    EvictParams,
    EvictResult,
    InitLoadBackParams,
    InsertParams,
    InsertResult,
    MatchPrefixParams,
    MatchResult,
)
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey, TreeNode
from sglang.srt.mem_cache.utils import compute_node_hash_values, get_storage_hash_str

from sglang_kvbm.core.connector import KvbmConnector
from sglang_kvbm.core.identity import BlockId
from sglang_kvbm.core.ports import BlockMeta, PageStore
from sglang_kvbm.integration.sglang.event_order import EventOrderer
from sglang_kvbm.integration.sglang.events import SglangEventSink, page_event_identities


@dataclasses.dataclass(frozen=True)
class TierTokens:
    """Tokens of a sequence this worker would serve from each tier right now.

    Cumulative, as Dynamo's indexer reports them (``gpu``, ``cpu``, ``disk`` in its
    ``/query`` answer): ``device`` from the device pool alone, ``host`` from device
    and host, ``disk`` from all three. Whole pages only.
    """

    device: int
    host: int
    disk: int


@dataclasses.dataclass(frozen=True)
class PrefixHit:
    """A prefix served for a custom server: its KV is in the device pool at ``indices``."""

    indices: torch.Tensor  # token slots of the matched prefix, in order
    node: TreeNode  # lock it (``cache.lock(node)``) while the indices are in use
    device_tokens: int  # found in the device pool
    loaded_tokens: int  # brought back from host or disk


@dataclasses.dataclass(frozen=True)
class _LoadMarker:
    """What ``match_prefix`` promised, for the ``init_load_back`` that follows.

    ``key`` is a snapshot: the request's live key grows as it decodes.
    """

    block_ids: tuple[BlockId, ...]
    key: RadixKey
    device_len: int


class _PrefixRequest:
    """The two fields of a scheduler request the cache reads, for :meth:`KvbmRadixCache.prefix`."""

    def __init__(self, handle: CacheRequestHandle) -> None:
        self.cache_request_handle = handle
        self.storage_hit_length = 0
        self.storage_hit_start = None


class KvbmRadixCache(RadixCache):
    """A radix cache whose evicted pages live on in KVBM's host (and disk) tiers."""

    def __init__(self, params: CacheInitParams, connector: KvbmConnector, sink: SglangEventSink) -> None:
        if params.is_eagle:
            raise ValueError("--radix-cache-backend kvbm does not support EAGLE speculative decoding yet")
        # Set before RadixCache.__init__, which calls reset(): that first reset
        # builds the tree and must not clear tiers restored from disk.
        self._kvbm = connector
        self._markers: dict[CacheRequestHandle, _LoadMarker] = {}
        self._wanted: dict[CacheRequestHandle, int] = {}  # blocks beyond the device match, per live request
        self._serving = False
        self._closers: list = [lambda: None]
        self.endpoint = None  # the worker's HTTP endpoint, when DYN_KVBM_METRICS is on
        self._queries: queue.Queue = queue.Queue(maxsize=256)
        self.events = EventOrderer()
        super().__init__(params)
        self._serving = True
        sink.bind(self.kv_events)

    @property
    def connector(self) -> KvbmConnector:
        return self._kvbm

    # -- storing -----------------------------------------------------------

    def insert(self, params: InsertParams) -> InsertResult:
        self._kvbm.poll()
        result = super().insert(params)
        if not self.disable and result.last_device_node is not None:
            self._wrap_new_pages(result.last_device_node, params.priority or 0)
        return result

    def _wrap_new_pages(self, leaf: TreeNode, priority: int) -> None:
        """Wrap the pages on the path to ``leaf`` that are not blocks yet, and offload them."""
        fresh: list[TreeNode] = []
        node = leaf
        while node is not self.root_node:
            if node.hash_value and self._kvbm.holds(node.hash_value[-1]):
                break  # nodes are wrapped whole, and every ancestor of a wrapped node is wrapped
            fresh.append(node)
            node = node.parent
        if not fresh:
            return
        pages: list[PageStore] = []
        for node in reversed(fresh):  # parents first: a node's hashes chain from its parent's
            if node.hash_value is None:
                node.hash_value = compute_node_hash_values(node, self.page_size)
            pages.extend(self._page_stores(node))
        self._offload(leaf, pages, priority)

    def _offload(self, leaf: TreeNode, pages: list[PageStore], priority: int) -> None:
        """Hand pages to the connector; lock ``leaf`` (and so its path) while a copy reads them."""
        if self._kvbm.store(pages, priority=priority, on_offloaded=functools.partial(self.dec_lock_ref, leaf)):
            self.inc_lock_ref(leaf)

    def _page_stores(self, node: TreeNode) -> list[PageStore]:
        ps = self.page_size
        device_pages = (node.value[::ps] // ps).tolist()
        events = page_event_identities(self.kv_events, node)
        if events is None and not self._kvbm.keeps_token_ids:
            # Token ids are only read by events and by the disk tier: skip the per-page slicing.
            return [PageStore(BlockMeta(b, ()), p) for b, p in zip(node.hash_value, device_pages)]
        tokens = node.key.token_ids
        return [
            PageStore(
                BlockMeta(block_id, tuple(tokens[i * ps : (i + 1) * ps]), events[i] if events else None),
                device_page,
            )
            for i, (block_id, device_page) in enumerate(zip(node.hash_value, device_pages))
        ]

    # -- matching and loading back -----------------------------------------

    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        self._kvbm.poll()
        self._answer_queries()
        result = super().match_prefix(params)
        req = params.req
        if req is None or self.disable:
            return result  # the tree's own internal matches (checkpoint) never load
        self._markers.pop(req.cache_request_handle, None)
        key = params.key.page_aligned(self.page_size)
        device_len = result.device_prefix_len
        if len(key) - device_len < self.page_size:
            return result
        rest = key[device_len:]
        wanted = len(rest) // self.page_size
        self._wanted[req.cache_request_handle] = wanted
        # Most lookups miss on their first page (a new question after a device hit):
        # hash one page first, the whole rest only when that page is held below.
        first = self._hashes_after(result.last_device_node, rest[: self.page_size])
        if not self._kvbm.peek(first)[1]:
            return result
        block_ids = first if wanted == 1 else self._hashes_after(result.last_device_node, rest)
        hit = self._kvbm.lookup(block_ids)
        if hit == 0:
            return result
        n = hit * self.page_size
        snapshot = RadixKey(array("q", rest.token_ids[:n]), rest.extra_key, cache_salt=rest.cache_salt)
        self._markers[req.cache_request_handle] = _LoadMarker(tuple(block_ids[:hit]), snapshot, device_len)
        return result._replace(host_hit_length=n)

    def _hashes_after(self, node: TreeNode, key: RadixKey, pages_into_node: Optional[int] = None) -> list[BlockId]:
        """Block ids of ``key``'s pages, chained from the last page under ``node``
        (or from its ``pages_into_node``-th page, when the match ends inside it)."""
        prior = None
        if node is not self.root_node:
            if node.hash_value is None:
                node.hash_value = compute_node_hash_values(node, self.page_size)
            prior = node.hash_value[-1] if pages_into_node is None else node.hash_value[pages_into_node - 1]
        return get_storage_hash_str(key, prior, page_size=self.page_size)

    # -- the truth about this worker's tiers ----------------------------------

    def tier_tokens(
        self, token_ids, *, extra_key: Optional[str] = None, cache_salt: Optional[str] = None
    ) -> TierTokens:
        """How many tokens of ``token_ids`` each tier would serve now (see :class:`TierTokens`).

        Read-only: no node is split, no access time or LRU position changes. Call
        it on the scheduler thread (or through :meth:`query_tiers` from another).
        """
        ps = self.page_size
        key = RadixKey(array("q", token_ids), extra_key, cache_salt=cache_salt).page_aligned(ps)
        node, matched, into = self.root_node, 0, None
        while matched < len(key):
            child = node.children.get(key.child_key_at(matched, ps))
            if child is None:
                break
            common = child.key.match_at(key, matched, page_size=ps)
            if common == 0:
                break
            matched += common
            node = child
            if common < len(child.key):
                into = common // ps
                break
        rest = key[matched:]
        if len(rest) < ps:
            return TierTokens(matched, matched, matched)
        host, lower = self._kvbm.peek(self._hashes_after(node, rest, into))
        return TierTokens(matched, matched + host * ps, matched + lower * ps)

    def query_tiers(self, token_ids, *, extra_key=None, cache_salt=None, timeout: float = 10.0) -> TierTokens:
        """:meth:`tier_tokens` from any thread: answered by the scheduler thread between steps."""
        future: Future = Future()
        self._queries.put((list(token_ids), extra_key, cache_salt, future), timeout=timeout)
        return future.result(timeout=timeout)

    def _answer_queries(self) -> None:
        while True:
            try:
                token_ids, extra_key, cache_salt, future = self._queries.get_nowait()
            except queue.Empty:
                return
            try:
                future.set_result(self.tier_tokens(token_ids, extra_key=extra_key, cache_salt=cache_salt))
            except Exception as exc:  # reported to the asking thread, never raised in the scheduler
                future.set_exception(exc)

    def init_load_back(self, params: InitLoadBackParams) -> Optional[tuple[int, TreeNode]]:
        self._kvbm.poll()
        parent: TreeNode = params.best_match_node
        req = params.req
        marker = self._markers.pop(req.cache_request_handle, None) if req is not None else None
        if marker is None or params.host_hit_length != len(marker.key):
            return 0, parent
        if not self._is_attached(parent, marker.device_len) or marker.key.child_key(self.page_size) in parent.children:
            return None  # the tree changed since the match: the scheduler re-matches next round
        n = len(marker.key)
        allocator = self.token_to_kv_pool_allocator
        if allocator.available_size() < n:
            self.evict(EvictParams(num_tokens=n - allocator.available_size()))
        slots = allocator.alloc(n)
        if slots is None:
            return 0, parent
        device_pages = (slots[:: self.page_size] // self.page_size).tolist()
        loaded = self._kvbm.load(marker.block_ids, device_pages)
        if loaded is None:
            allocator.free(slots)
            return 0, parent  # a miss: the request recomputes this span
        if loaded.disk_blocks and req is not None:
            # Report the disk part as SGLang reports L3 hits (cached_tokens_details["storage"]).
            req.storage_hit_length = loaded.disk_blocks * self.page_size
            req.storage_hit_start = None
        return n, self._attach(parent, marker, slots)

    def _is_attached(self, node: TreeNode, device_len: int) -> bool:
        """Whether ``node`` is still in the tree, ``device_len`` tokens below the root."""
        depth = 0
        while node is not self.root_node:
            parent = node.parent
            if parent is None or parent.children.get(node.key.child_key(self.page_size)) is not node:
                return False
            depth += len(node.key)
            node = parent
        return depth == device_len

    def _attach(self, parent: TreeNode, marker: _LoadMarker, slots) -> TreeNode:
        node = TreeNode(priority=parent.priority)
        node.parent = parent
        node.key = marker.key
        node.value = slots.to(dtype=self._empty_device_indices.dtype)
        node.hash_value = list(marker.block_ids)
        parent.children[marker.key.child_key(self.page_size)] = node
        self.evictable_size_ += len(marker.key)
        self._update_leaf_status(parent)
        self._update_leaf_status(node)
        self.kv_events.record_store(node)
        self._kvbm.loaded([BlockMeta(block_id, ()) for block_id in marker.block_ids])  # device blocks again
        return node

    def evictable_size(self):
        # The scheduler reads this every step and in its idle checks: a cheap,
        # always-reached point to answer tier queries (read-only, like this call).
        if not self._queries.empty():
            self._answer_queries()
        return super().evictable_size()

    # -- leaving the device ------------------------------------------------

    def evict(self, params: EvictParams) -> EvictResult:
        self._kvbm.poll()  # release copies that finished, so their nodes are evictable now
        return super().evict(params)

    def _delete_leaf(self, node: TreeNode) -> None:
        super()._delete_leaf(node)
        if node.hash_value:
            self._kvbm.evicted(node.hash_value)

    # -- request end, reset, events ------------------------------------------

    def on_release(self, req, *, checkpointed: bool) -> None:
        self._markers.pop(req.cache_request_handle, None)
        self._kvbm.request_done(self._wanted.pop(req.cache_request_handle, 0))
        super().on_release(req, checkpointed=checkpointed)

    def release_aborted_request(self, handle: CacheRequestHandle) -> None:
        self._markers.pop(handle, None)
        self._wanted.pop(handle, None)
        super().release_aborted_request(handle)

    def reset(self) -> None:
        """Clear every tier: a flush (e.g. after a weight update) must not leave KV of the old weights below."""
        if self._serving:
            self._kvbm.reset()
        self._markers.clear()
        self._wanted.clear()
        super().reset()

    # -- for custom servers (no SGLang scheduler) ------------------------------

    def prefix(self, token_ids, *, extra_key: Optional[str] = None, cache_salt: Optional[str] = None) -> PrefixHit:
        """Match ``token_ids`` in every tier and bring the lower-tier part into the device pool.

        What SGLang's scheduler does with ``match_prefix`` + ``init_load_back``, in one
        call. At most ``len(token_ids) - 1`` tokens are matched (the last one must be
        computed to produce logits), in whole pages.
        """
        key = RadixKey(array("q", token_ids), extra_key, cache_salt=cache_salt, limit=max(0, len(token_ids) - 1))
        handle = CacheRequestHandle(f"kvbm-prefix-{id(key)}", 0)
        request = _PrefixRequest(handle)
        result = self.match_prefix(MatchPrefixParams(key=key, req=request))
        node, loaded = result.last_device_node, 0
        if result.host_hit_length:
            answer = self.init_load_back(
                InitLoadBackParams(best_match_node=node, host_hit_length=result.host_hit_length, req=request)
            )
            if answer is not None and answer[0]:
                loaded, node = answer
        self._markers.pop(handle, None)
        self._wanted.pop(handle, None)
        indices = self.path_device_indices(node)
        return PrefixHit(indices, node, result.device_prefix_len, loaded)

    def add_closer(self, close) -> None:
        self._closers.append(close)

    def close(self) -> None:
        """Stop the endpoint and copy threads; persist the disk index. Idempotent."""
        closers, self._closers = self._closers, []
        for close in closers:
            close()
        if closers:
            self._kvbm.close()

    def check_hicache_events(self) -> None:
        """The per-step poll (SGLang with this project's version patch calls it every step)."""
        self._kvbm.poll()
        self._answer_queries()

    def take_events(self):
        """The worker's events, every tier, parents always before children (see ``event_order``).

        The scheduler calls this after each step and when idle, so it is also where
        tier queries from other threads are answered.
        """
        self._kvbm.poll()
        self._answer_queries()
        return self.events.order(super().take_events())
