"""KVBM's cache hit rates, per tier: a sliding window over recent requests.

KVBM (``block_manager`` cache statistics) records, once per request, how many
of the blocks it looked up below the device were found in host memory and how
many on disk, and reports ``hits / blocks looked up`` over the last
``DYN_KVBM_CACHE_STATS_MAX_REQUESTS`` requests (default 1000). This is that
definition, for every tier by name (``host``, ``disk`` and those below): a
request looked up again while it waits replaces its own entry.
"""

from __future__ import annotations

import collections
from collections import OrderedDict
from typing import Hashable, Mapping

from sglang_kvbm.core.tiers import DISK, HOST

DEFAULT_WINDOW = 1000


class HitRateWindow:
    def __init__(self, max_requests: int = DEFAULT_WINDOW) -> None:
        self._max = max(1, max_requests)
        self._entries: OrderedDict[Hashable, tuple[Mapping[str, int], int]] = OrderedDict()
        self._hits: collections.Counter = collections.Counter()
        self._total = 0

    def record(self, request: Hashable, found: Mapping[str, int], total_blocks: int) -> None:
        """What one request's lookup found: blocks each tier serves (by name), of the blocks looked up."""
        if total_blocks <= 0:
            return
        old = self._entries.pop(request, None)
        if old is not None:
            self._subtract(old)
        self._entries[request] = (found, total_blocks)
        self._hits.update(found)
        self._total += total_blocks
        while len(self._entries) > self._max:
            self._subtract(self._entries.popitem(last=False)[1])

    def _subtract(self, entry: tuple[Mapping[str, int], int]) -> None:
        self._hits.subtract(entry[0])
        self._total -= entry[1]

    def rate(self, tier: str) -> float:
        return self._hits[tier] / self._total if self._total else 0.0

    def rates(self) -> dict[str, float]:
        """Every tier that served a block in the window: its hit rate."""
        return {tier: self.rate(tier) for tier, hits in self._hits.items() if hits}

    @property
    def host_rate(self) -> float:
        return self.rate(HOST.name)

    @property
    def disk_rate(self) -> float:
        return self.rate(DISK.name)

    def clear(self) -> None:
        self._entries.clear()
        self._hits.clear()
        self._total = 0
