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
from sglang_kvbm.core.tiers import DEVICE, DISK, HOST
from sglang_kvbm.observe.http_server import KvbmHttpServer, json_reply
from sglang_kvbm.observe.metrics import KvbmMetrics
from sglang_kvbm.tiers import registry

# ``linker`` below is the worker's ``KvbmLinker`` (not imported: the linker imports this module).


def stats_of(linker) -> dict:
    """What ``/stats`` carries besides the connector's counters (scheduler thread, once per publish)."""
    manager = linker.manager
    sidecars = linker.sidecars.managers
    block = linker.layout.block_bytes
    extra = {
        "local": manager.stats,
        "in_flight": len(manager.in_flight()) + sum(len(m.in_flight()) for m in sidecars.values()),
        "events": {"held": linker.orderer.held(), "held_total": linker.orderer.held_total, "dropped": linker.orderer.dropped},
        "offloads_refused_outside_insert": linker.offloads_refused_outside_insert,
        "block_bytes": {HOST.name: block, **{name: tier.header_bytes + block for name, tier in manager.tiers.items()}},
        "chain": [HOST.name, *manager.tiers],
    }
    if linker.pins is not None:  # SGLang 0.5.21: requests kept waiting for their reads below host
        extra["lookup_waits"] = {"deferred": linker.pins.deferrals, "expired": linker.pins.waits_expired,
                                 "idle_wait_seconds": linker.pins.idle_wait_seconds}
    if sidecars:  # hybrid models: each sidecar pool's tiers (sliding-window pages, Mamba states), by pool
        extra["sidecars"] = {name: {"tiers": {c.tier: (c.blocks, c.capacity) for c in m.counts()},
                                    "block_bytes": m.layout.block_bytes, "local": m.stats}
                             for name, m in sidecars.items()}
    if manager.host is not None:
        extra[HOST.name] = manager.host.accounting()
    for name, tier in manager.tiers.items():  # each tier below host, under its name
        extra[name] = tier.stats
    if linker.cache is not None:
        allocator = linker.cache.token_to_kv_pool_allocator
        extra[DEVICE.name] = {
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
    remote = {name: snapshot.get(name, {}) for name in snapshot.get("chain", ()) if "lookup_hits" in snapshot.get(name, {})}
    return {
        **{f"kvbm_{name}": stats.get(name, 0) for name in (
            "offload_blocks_d2h", "offload_blocks_h2d", "offload_blocks_d2d", "onboard_blocks_h2d",
            "onboard_blocks_d2d", "matched_tokens")},
        **registry.metrics(snapshot),  # KVBM's names for the tiers further down, as each tier gives them
        "kvbm_host_cache_hit_rate": snapshot.get("host_hit_rate", 0.0),
        "kvbm_disk_cache_hit_rate": snapshot.get("disk_hit_rate", 0.0),
        "tiers": tiers,
        "invalidated": snapshot.get(DISK.name, {}).get("invalidated", {}),
        "up": {name: int(bool(tier["up"])) for name, tier in remote.items() if "up" in tier},  # remote tiers
        "per_tier": {  # every tier by name: what it served, took, lost, and (remote tiers) was asked for in vain
            "onboard_blocks": stats.get("onboard_blocks", {}),
            "offload_blocks": stats.get("offload_blocks", {}),
            "removed_blocks": stats.get("removed_blocks", {}),
            "lookup_hit_blocks": stats.get("hit_blocks", {}),
            "hit_rate": snapshot.get("hit_rates", {}),
            "lookup_misses": {name: tier["lookup_misses"] for name, tier in remote.items()},
        },
    }


def remote_tokens(tiers, served: int, beyond, page_size: int) -> dict:
    """Tokens every tier down to each remote tier would serve (cumulative, as ``device``/``host``/``disk``), or None
    for one that is not reachable now. They ask the tiers: never on the scheduler thread."""
    out, ids = {}, list(beyond)
    for tier in tiers:
        found = tier.ask(ids)  # None while the tier is down, whatever there is left to ask
        if found is None:
            out[tier.name] = None
            continue
        run = found.index(False) if False in found else len(found)
        served, ids = served + run * page_size, ids[run:]
        out[tier.name] = served
    return out


def start_http(linker, config: KvbmConfig, metrics: Optional[KvbmMetrics], *, port_offset: int = 0):
    def tiers(body: Optional[dict]):
        if not body or not isinstance(body.get("token_ids"), list):
            return json_reply({"error": 'POST {"token_ids": [int, ...]}'}, 400)
        token_ids = body["token_ids"]
        if not all(isinstance(t, int) and t >= 0 for t in token_ids):
            return json_reply({"error": "token_ids must be non-negative integers"}, 400)
        answer = linker.query_tiers(token_ids, extra_key=body.get("extra_key"), cache_salt=body.get("cache_salt"))
        reply = answer.counts()
        reply.update(remote_tokens([t for t in linker.manager.tiers.values() if not t.indexed], answer.disk,
                                   answer.beyond, linker.page_size))
        return json_reply(reply)

    routes = {
        ("POST", "/tiers"): tiers,
        ("GET", "/stats"): lambda _: json_reply(linker.connector.snapshot()),
    }
    if metrics is not None:
        routes[("GET", "/metrics")] = lambda _: (200, CONTENT_TYPE_LATEST, metrics.render())
    return KvbmHttpServer(config.http_host, config.metrics_port + port_offset, routes)
