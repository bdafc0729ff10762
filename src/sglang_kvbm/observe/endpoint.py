"""Routes of the worker's KVBM endpoint (see ``sglang_kvbm.observe.http_server``) for a linker.

Nothing here reads the scheduler's structures: ``/stats`` and ``/metrics``
read the snapshot the scheduler thread publishes once per step (replaced
whole, never changed in place), and ``/tiers`` is answered by the scheduler
thread between steps.
"""

from __future__ import annotations

from typing import Optional

from prometheus_client import CONTENT_TYPE_LATEST

from sglang_kvbm.config import KvbmConfig
from sglang_kvbm.integration.sglang.tier_query import g4_tokens
from sglang_kvbm.observe.http_server import KvbmHttpServer, json_reply
from sglang_kvbm.observe.metrics import KvbmMetrics

# ``linker`` below is the worker's ``KvbmLinker`` (not imported: the linker imports this module).


def stats_of(linker) -> dict:
    """What ``/stats`` carries besides the connector's counters (scheduler thread, once per publish)."""
    manager = linker.manager
    sidecars = linker.sidecars.managers
    extra = {
        "local": manager.stats.__dict__.copy(),
        "in_flight": len(manager.in_flight()) + sum(len(m.in_flight()) for m in sidecars.values()),
        "events": {"held": linker.orderer.held(), "held_total": linker.orderer.held_total, "dropped": linker.orderer.dropped},
        "offloads_refused_outside_insert": linker.offloads_refused_outside_insert,
        "block_bytes": {"host": linker.layout.block_bytes, "disk": manager.disk.slot_bytes if manager.disk is not None else 0},
    }
    if sidecars:  # hybrid models: each sidecar pool's tiers (sliding-window pages, Mamba states), by pool
        extra["sidecars"] = {name: {"tiers": {c.tier.name.lower(): (c.blocks, c.capacity) for c in m.counts()},
                                    "block_bytes": m.layout.block_bytes, "local": m.stats.__dict__.copy()}
                             for name, m in sidecars.items()}
    if manager.g4 is not None:  # the shared tier: what this worker wrote, fetched and rejected, and whether it is up
        extra["g4"] = {**manager.g4.stats, "up": not manager.g4.down, "connected": manager.g4.connected,
                       "write_through": manager.g4_writes.written, "staged": manager.staging.g4_staged}
    if manager.host is not None:
        extra["host"] = manager.host.accounting()
    if manager.disk is not None:
        disk = dict(manager.disk.stats.__dict__)
        disk["invalidated"] = dict(manager.disk.stats.invalidated)
        disk.update(manager.disk.accounting())
        extra["disk"] = disk
    if linker.cache is not None:
        allocator = linker.cache.token_to_kv_pool_allocator
        extra["device"] = {
            "total": allocator.size,
            "available": allocator.available_size(),
            "evictable": linker.cache.evictable_size(),
            "protected": linker.cache.protected_size(),
        }
    return extra


def metrics_of(snapshot: dict) -> dict:
    """The numbers behind KVBM's metric names, from a published snapshot."""
    stats = snapshot.get("connector", {})
    block_bytes = snapshot.get("block_bytes", {})
    tiers = {
        name: (blocks, capacity, blocks * block_bytes.get(name, 0))
        for name, (blocks, capacity) in snapshot.get("tiers", {}).items()
    }
    return {
        "kvbm_offload_blocks_d2h": stats.get("offload_blocks_d2h", 0),
        "kvbm_offload_blocks_h2d": stats.get("offload_blocks_h2d", 0),
        "kvbm_offload_blocks_d2d": stats.get("offload_blocks_d2d", 0),
        "kvbm_onboard_blocks_h2d": stats.get("onboard_blocks_h2d", 0),
        "kvbm_onboard_blocks_d2d": stats.get("onboard_blocks_d2d", 0),
        "kvbm_matched_tokens": stats.get("matched_tokens", 0),
        "kvbm_host_cache_hit_rate": snapshot.get("host_hit_rate", 0.0),
        "kvbm_disk_cache_hit_rate": snapshot.get("disk_hit_rate", 0.0),
        "tiers": tiers,
        "invalidated": snapshot.get("disk", {}).get("invalidated", {}),
    }


def start_http(linker, config: KvbmConfig, metrics: Optional[KvbmMetrics], *, port_offset: int = 0):
    def tiers(body: Optional[dict]):
        if not body or not isinstance(body.get("token_ids"), list):
            return json_reply({"error": 'POST {"token_ids": [int, ...]}'}, 400)
        token_ids = body["token_ids"]
        if not all(isinstance(t, int) and t >= 0 for t in token_ids):
            return json_reply({"error": "token_ids must be non-negative integers"}, 400)
        answer = linker.query_tiers(token_ids, extra_key=body.get("extra_key"), cache_salt=body.get("cache_salt"))
        reply = answer.counts()
        if linker.manager.g4 is not None:  # null: G4 configured but not reachable now
            reply["g4"] = g4_tokens(linker.manager.g4, answer, linker.page_size)
        return json_reply(reply)

    routes = {
        ("POST", "/tiers"): tiers,
        ("GET", "/stats"): lambda _: json_reply(linker.connector.snapshot()),
    }
    if metrics is not None:
        routes[("GET", "/metrics")] = lambda _: (200, CONTENT_TYPE_LATEST, metrics.render())
    return KvbmHttpServer(config.http_host, config.metrics_port + port_offset, routes)
