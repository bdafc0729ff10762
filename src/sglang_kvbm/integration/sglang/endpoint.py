"""Routes of the worker's KVBM endpoint (see ``sglang_kvbm.http_server``) for an SGLang cache."""

from __future__ import annotations

import dataclasses
from typing import Optional

from prometheus_client import CONTENT_TYPE_LATEST

from sglang_kvbm.backends.local.manager import LocalBlockManager
from sglang_kvbm.config import KvbmConfig
from sglang_kvbm.http_server import KvbmHttpServer, json_reply
from sglang_kvbm.integration.sglang.radix_cache import KvbmRadixCache
from sglang_kvbm.metrics import KvbmMetrics


def stats_of(cache: KvbmRadixCache, manager: LocalBlockManager) -> dict:
    """Counters and occupancy, plain JSON (read from another thread: a consistent-enough snapshot)."""
    stats = {
        "connector": dataclasses.asdict(cache.connector.stats),
        "tiers": {c.tier.name.lower(): {"blocks": c.blocks, "capacity": c.capacity} for c in cache.connector.counts()},
        "local": dataclasses.asdict(manager.stats),
        "in_flight": manager.in_flight(),
        "device": {
            "total": cache.token_to_kv_pool_allocator.size,
            "available": cache.token_to_kv_pool_allocator.available_size(),
            "evictable": cache.evictable_size_,
            "protected": cache.protected_size(),
        },
        "events": {"held": cache.events.held(), "held_total": cache.events.held_total, "dropped": cache.events.dropped},
    }
    if manager.host is not None:
        host = manager.host
        stats["host"] = {"capacity": host.capacity, "registered": len(host), "free": host.free_rows(),
                         "in_flight": host.inflight_rows()}
    if manager.disk is not None:
        disk = dataclasses.asdict(manager.disk.stats)
        disk["invalidated"] = dict(manager.disk.stats.invalidated)
        disk.update(manager.disk.accounting())
        stats["disk"] = disk
    return stats


def metrics_snapshot(cache: KvbmRadixCache, manager: LocalBlockManager) -> dict:
    """The numbers behind KVBM's metric names, from the live counters."""
    c = cache.connector.stats
    wanted = max(1, c.requested_blocks)
    block_bytes = {"device": manager.layout.page_bytes, "host": manager.layout.block_bytes}
    if manager.disk is not None:
        block_bytes["disk"] = manager.disk.slot_bytes
    tiers = {}
    for count in cache.connector.counts():
        name = count.tier.name.lower()
        tiers[name] = (count.blocks, max(count.capacity, 0), count.blocks * block_bytes[name])
    return {
        "kvbm_offload_blocks_d2h": c.offload_blocks_d2h,
        "kvbm_offload_blocks_h2d": c.offload_blocks_h2d,
        "kvbm_offload_blocks_d2d": c.offload_blocks_d2d,
        "kvbm_onboard_blocks_h2d": c.onboard_blocks_h2d,
        "kvbm_onboard_blocks_d2d": c.onboard_blocks_d2d,
        "kvbm_matched_tokens": (c.onboard_blocks_h2d + c.onboard_blocks_d2d) * manager.layout.page_size,
        # Of the blocks beyond their device match that finished requests wanted, the share each tier served.
        "kvbm_host_cache_hit_rate": min(1.0, c.onboard_blocks_h2d / wanted),
        "kvbm_disk_cache_hit_rate": min(1.0, c.onboard_blocks_d2d / wanted),
        "tiers": tiers,
        "invalidated": dict(manager.disk.stats.invalidated) if manager.disk is not None else {},
    }


def start_http(
    cache: KvbmRadixCache, manager: LocalBlockManager, config: KvbmConfig, metrics: Optional[KvbmMetrics] = None
) -> KvbmHttpServer:
    def tiers(body: Optional[dict]):
        if not body or not isinstance(body.get("token_ids"), list):
            return json_reply({"error": 'POST {"token_ids": [int, ...]}'}, 400)
        token_ids = body["token_ids"]
        if not all(isinstance(t, int) and t >= 0 for t in token_ids):
            return json_reply({"error": "token_ids must be non-negative integers"}, 400)
        answer = cache.query_tiers(token_ids, extra_key=body.get("extra_key"), cache_salt=body.get("cache_salt"))
        return json_reply(dataclasses.asdict(answer))

    routes = {
        ("POST", "/tiers"): tiers,
        ("GET", "/stats"): lambda _: json_reply(stats_of(cache, manager)),
    }
    if metrics is not None:
        routes[("GET", "/metrics")] = lambda _: (200, CONTENT_TYPE_LATEST, metrics.render())
    return KvbmHttpServer(config.http_host, config.metrics_port, routes)
