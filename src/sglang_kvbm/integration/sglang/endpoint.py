"""Routes of the worker's KVBM endpoint (see ``sglang_kvbm.http_server``) for an SGLang cache."""

from __future__ import annotations

import dataclasses
from typing import Optional

from sglang_kvbm.backends.local.manager import LocalBlockManager
from sglang_kvbm.config import KvbmConfig
from sglang_kvbm.http_server import KvbmHttpServer, json_reply
from sglang_kvbm.integration.sglang.radix_cache import KvbmRadixCache


def stats_of(cache: KvbmRadixCache, manager: LocalBlockManager) -> dict:
    """Counters and occupancy, plain JSON (read from another thread: a consistent-enough snapshot)."""
    stats = {
        "connector": dataclasses.asdict(cache.connector.stats),
        "tiers": {c.tier.name.lower(): {"blocks": c.blocks, "capacity": c.capacity} for c in cache.connector.counts()},
        "local": dataclasses.asdict(manager.stats),
        "in_flight": manager.in_flight(),
        "events": {"held": cache.events.held(), "held_total": cache.events.held_total, "dropped": cache.events.dropped},
    }
    if manager.disk is not None:
        disk = dataclasses.asdict(manager.disk.stats)
        disk["invalidated"] = dict(manager.disk.stats.invalidated)
        stats["disk"] = disk
    return stats


def start_http(cache: KvbmRadixCache, manager: LocalBlockManager, config: KvbmConfig) -> KvbmHttpServer:
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
    return KvbmHttpServer(config.http_host, config.metrics_port, routes)
