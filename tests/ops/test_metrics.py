"""Metrics per tier by name, from the snapshot the scheduler publishes: KVBM's names where KVBM has them (its G4
counters belong to the object tier), this library's per-tier families for every tier, Mooncake never as disk."""

from __future__ import annotations

from sglang_kvbm.core.connector import ConnectorStats
from sglang_kvbm.core.hit_rate import HitRateWindow
from sglang_kvbm.observe.endpoint import metrics_of
from sglang_kvbm.observe.metrics import KvbmMetrics


def scrape(snapshot: dict) -> dict:
    text = KvbmMetrics(lambda: metrics_of(snapshot)).render().decode()
    return {name: float(value) for name, value in
            (line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))}


def test_every_tier_is_counted_under_its_own_name():
    stats = ConnectorStats()
    stats.onboard_blocks.update({"host": 5, "disk": 3, "mooncake": 7, "object": 2})
    stats.offload_blocks.update({"device->host": 11, "host->disk": 4, "device->disk": 1, "host->mooncake": 9,
                                 "host->object": 6})
    stats.removed_blocks.update({"host": 8})
    rates = HitRateWindow()
    rates.record("r1", {"host": 5, "disk": 3, "mooncake": 7, "object": 2}, 20)
    snapshot = {"connector": stats.as_dict(), "host_hit_rate": rates.host_rate, "disk_hit_rate": rates.disk_rate,
                "hit_rates": rates.rates(), "chain": ["host", "disk", "mooncake", "object"],
                "mooncake": {"lookup_hits": 7, "lookup_misses": 1}, "object": {"lookup_hits": 2, "lookup_misses": 3}}
    m = scrape(snapshot)
    # KVBM's names: Mooncake's hits are not disk's
    assert (m["kvbm_onboard_blocks_h2d"], m["kvbm_onboard_blocks_d2d"], m["kvbm_onboard_blocks_obj2h"]) == (5, 3, 2)
    assert (m["kvbm_offload_blocks_d2h"], m["kvbm_offload_blocks_h2d"], m["kvbm_offload_blocks_d2d"],
            m["kvbm_offload_blocks_h2obj"]) == (11, 4, 1, 6)
    assert (m["kvbm_g4_lookup_hits"], m["kvbm_g4_lookup_misses"]) == (2, 3)  # KVBM's G4 is its object tier
    assert (m["kvbm_host_cache_hit_rate"], m["kvbm_disk_cache_hit_rate"]) == (0.25, 0.15)
    # every tier by name
    assert m['kvbm_tier_onboard_blocks{tier="mooncake"}'] == 7
    assert m['kvbm_tier_offload_blocks{source="host",tier="mooncake"}'] == 9
    assert m['kvbm_tier_removed_blocks{tier="host"}'] == 8
    assert m['kvbm_tier_hit_rate{tier="mooncake"}'] == 0.35
    assert m['kvbm_tier_lookup_miss_blocks{tier="mooncake"}'] == 1 and m['kvbm_tier_lookup_miss_blocks{tier="object"}'] == 3


def test_a_request_looked_up_again_replaces_its_entry_in_every_tiers_rate():
    rates = HitRateWindow(max_requests=2)
    rates.record("a", {"host": 4}, 4)
    rates.record("a", {"disk": 2}, 4)  # the same request, waiting: its new answer replaces the old
    assert rates.rates() == {"disk": 0.5}
    rates.record("b", {"mooncake": 4}, 4)
    rates.record("c", {"host": 4}, 4)  # the window holds two requests: a's entry leaves
    assert rates.rates() == {"mooncake": 0.5, "host": 0.5}


def test_each_shared_tier_says_whether_it_is_up():
    snapshot = {"chain": ["host", "disk", "mooncake", "object"], "disk": {"invalidated": {}},
                "mooncake": {"lookup_hits": 0, "lookup_misses": 0, "up": False},
                "object": {"lookup_hits": 0, "lookup_misses": 0, "up": True}}
    m = scrape(snapshot)
    assert m['kvbm_tier_up{tier="mooncake"}'] == 0 and m['kvbm_tier_up{tier="object"}'] == 1
    assert not any(key.startswith("kvbm_tier_up") and "disk" in key for key in m)  # local tiers have no heartbeat
