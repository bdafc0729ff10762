"""What the linker wraps of the one tree cache that adopted it (``hooks`` calls ``KvbmLinker.attach_kvbm``).

* ``insert``: the key (and priority) of the insert in progress, which says what
  tokens the pages of the offloads it makes hold;
* ``init_load_back``: the part of a hit that came from below host is reported as
  SGLang reports its L3 hits (``cached_tokens_details["storage"]``);
* ``take_events``: this library's tiers' events join the tree's, on its one
  stream, in an order Dynamo's indexer accepts.
"""

from __future__ import annotations

import functools


def wrap_cache(linker, cache) -> None:
    """Wrap ``cache``'s (an instance's, nothing else) ``insert``, ``init_load_back`` and ``take_events``."""
    insert, init_load_back, take_events = cache.insert, cache.init_load_back, cache.take_events

    @functools.wraps(insert)
    def insert_with_key(params):
        linker._insert = (params.key, params.priority or 0) if params.key is not None else None
        try:
            return insert(params)
        finally:
            linker._insert = None

    @functools.wraps(init_load_back)
    def init_load_back_reporting_disk(params):
        result = init_load_back(params)
        req = params.req
        plan = linker.loads.queued_plan(req.rid) if req is not None else None
        if plan is not None and plan.staged_blocks:
            req.storage_hit_length = plan.staged_blocks * linker.page_size
            req.storage_hit_start = None
        return result

    @functools.wraps(take_events)
    def take_all_events():
        events = take_events()
        if not linker._events_on:  # the step's check_hicache_events polled the copies already
            return events
        linker.connector.poll()  # copies that landed during the step publish with it
        return linker.orderer.order(events + linker.sink.take())

    cache.insert = insert_with_key
    cache.init_load_back = init_load_back_reporting_disk
    cache.take_events = take_all_events
