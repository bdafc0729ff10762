"""Prometheus metrics under KVBM's names, so KVBM's Grafana dashboard works unchanged.

KVBM's own counters (``kvbm_offload_blocks_d2h`` ...) are exported under their
exact names, without the ``_total`` suffix the Python client would add (KVBM's
Rust exporter adds none), as untyped samples read from the snapshot the
scheduler publishes: nothing is counted twice and nothing runs on the hot path.
This library's own additions are exported the same way where they are counts
(``kvbm_transfer_bytes`` per path, tier occupancy, verification failures); the
transfer durations are an ordinary Prometheus histogram.

The hit rates are KVBM's: over the last ``DYN_KVBM_CACHE_STATS_MAX_REQUESTS``
requests (1000), the blocks each request looked up below the device that the
host (resp. disk) tier held, over the blocks looked up (``core/hit_rate.py``).
"""

from __future__ import annotations

import threading
from typing import Callable, Iterable

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric

from sglang_kvbm.tiers import registry

# KVBM's names (lib/runtime metrics, "kvbm" namespace) and their meaning.
KVBM_COUNTERS = {
    "kvbm_offload_blocks_d2h": "Offload blocks from device to host",
    "kvbm_offload_blocks_h2d": "Offload blocks from host to disk",
    "kvbm_offload_blocks_d2d": "Offload blocks from device to disk (bypassing host)",
    "kvbm_onboard_blocks_h2d": "Onboard blocks from host to device",
    "kvbm_onboard_blocks_d2d": "Onboard blocks from disk to device",
    "kvbm_matched_tokens": "Number of matched tokens",
}
# Every tier by its name (``host``, ``disk``, and each tier below): this library's, KVBM has no per-tier family.
PER_TIER = {
    "onboard_blocks": ("kvbm_tier_onboard_blocks", "Blocks a tier served to the device", ["tier"]),
    "offload_blocks": ("kvbm_tier_offload_blocks", "Blocks a tier took, by the tier they came from",
                       ["source", "tier"]),
    "removed_blocks": ("kvbm_tier_removed_blocks", "Blocks a tier evicted or dropped", ["tier"]),
    "lookup_hit_blocks": ("kvbm_tier_lookup_hit_blocks", "Blocks lookups found in a tier", ["tier"]),
    "lookup_misses": ("kvbm_tier_lookup_miss_blocks", "Blocks asked of a remote tier and not found", ["tier"]),
}
KVBM_GAUGES = {
    "kvbm_host_cache_hit_rate": "Host cache hit rate (0.0-1.0)",
    "kvbm_disk_cache_hit_rate": "Disk cache hit rate (0.0-1.0)",
}
TRANSFER_PATHS = ("d2h", "h2d", "d2d", "onboard_h2d", "onboard_d2d", "s2h")
_BUCKETS = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0, 10.0)


class KvbmMetrics:
    """One registry per worker: KVBM's counters and gauges from ``snapshot()``, plus transfer histograms."""

    def __init__(self, snapshot: Callable[[], dict]) -> None:
        self.registry = CollectorRegistry()
        self._snapshot = snapshot
        self._seconds = Histogram(
            "kvbm_transfer_seconds", "Duration of one tier transfer", ["path"], registry=self.registry, buckets=_BUCKETS
        )
        self._bytes = dict.fromkeys(TRANSFER_PATHS, 0)
        self._lock = threading.Lock()
        self.registry.register(self)

    def observe(self, path: str, nbytes: int, seconds: float) -> None:
        """A transfer finished (called from the scheduler and the copy threads; cheap)."""
        self._seconds.labels(path).observe(seconds)
        with self._lock:
            self._bytes[path] = self._bytes.get(path, 0) + nbytes

    def collect(self) -> Iterable[Metric]:
        snap = self._snapshot()
        for name, doc in {**KVBM_COUNTERS, **registry.metric_docs()}.items():
            metric = Metric(name, doc, "unknown")
            metric.add_sample(name, {}, float(snap.get(name, 0)))
            yield metric
        for name, doc in KVBM_GAUGES.items():
            yield GaugeMetricFamily(name, doc, value=float(snap.get(name, 0.0)))
        per_tier = snap.get("per_tier", {})
        for key, (name, doc, labels) in PER_TIER.items():
            metric = Metric(name, doc, "unknown")
            for label, n in per_tier.get(key, {}).items():
                values = label.split("->") if len(labels) == 2 else [label]
                metric.add_sample(name, dict(zip(labels, values)), float(n))
            yield metric
        rates = GaugeMetricFamily("kvbm_tier_hit_rate", "A tier's share of the blocks looked up below the device "
                                  "(KVBM's window)", labels=["tier"])
        for tier, rate in per_tier.get("hit_rate", {}).items():
            rates.add_metric([tier], rate)
        yield rates
        moved = Metric("kvbm_transfer_bytes", "Bytes moved between tiers, per path", "unknown")
        with self._lock:
            for path, nbytes in self._bytes.items():
                moved.add_sample("kvbm_transfer_bytes", {"path": path}, float(nbytes))
        yield moved
        blocks = GaugeMetricFamily("kvbm_tier_blocks", "Blocks a tier holds", labels=["tier"])
        capacity = GaugeMetricFamily("kvbm_tier_capacity_blocks", "Blocks a tier can hold", labels=["tier"])
        used = GaugeMetricFamily("kvbm_tier_bytes", "Bytes of KV a tier holds", labels=["tier"])
        for tier, (n, cap, nbytes) in snap.get("tiers", {}).items():
            blocks.add_metric([tier], n)
            capacity.add_metric([tier], cap)
            used.add_metric([tier], nbytes)
        yield blocks
        yield capacity
        yield used
        up = GaugeMetricFamily("kvbm_tier_up", "Whether a shared tier answers (1) or is marked down (0): its "
                               "heartbeat or a failed call", labels=["tier"])
        for tier, value in snap.get("up", {}).items():
            up.add_metric([tier], value)
        yield up
        invalid = GaugeMetricFamily(
            "kvbm_disk_invalidated_blocks", "Disk blocks dropped because their bytes could not be verified", labels=["reason"]
        )
        for reason, n in snap.get("invalidated", {}).items():
            invalid.add_metric([reason], n)
        yield invalid

    def render(self) -> bytes:
        return generate_latest(self.registry)
