"""What the linker wraps of the one tree cache that adopted it (``hooks`` calls ``KvbmLinker.attach_kvbm``).

* ``insert``: the key (and priority) of the insert in progress, which says what
  tokens the pages of the offloads it makes hold;
* ``init_load_back``: the part of a hit that came from below host is reported as
  SGLang reports its L3 hits (``cached_tokens_details["storage"]``); on SGLang
  0.5.21 a request whose lookup found reads still in flight gets None, which
  keeps it waiting in the queue (``lookup_pins``);
* ``take_events``: this library's tiers' events join the tree's, on its one
  stream, in an order Dynamo's indexer accepts.

The wrappers reach the linker only through its methods (``begin_insert`` /
``end_insert``, ``defers_load``, ``staged_blocks``, ``join_tier_events``), whose docstrings say
what each costs the scheduler thread.
"""

from __future__ import annotations

import functools


def wrap_cache(linker, cache) -> None:
    """Wrap ``cache``'s (an instance's, nothing else) ``insert``, ``init_load_back`` and ``take_events``."""
    insert, init_load_back, take_events = cache.insert, cache.init_load_back, cache.take_events

    @functools.wraps(insert)
    def insert_with_key(params):
        linker.begin_insert(params.key, params.priority)
        try:
            return insert(params)
        finally:
            linker.end_insert()

    @functools.wraps(init_load_back)
    def init_load_back_reporting_disk(params):
        req = params.req
        if req is not None and linker.defers_load(req.rid):
            return None
        result = init_load_back(params)
        staged = linker.staged_blocks(req.rid) if req is not None else 0
        if staged:
            req.storage_hit_length = staged * linker.page_size
            req.storage_hit_start = None
        return result

    @functools.wraps(take_events)
    def take_all_events():
        return linker.join_tier_events(take_events())

    cache.insert = insert_with_key
    cache.init_load_back = init_load_back_reporting_disk
    cache.take_events = take_all_events
