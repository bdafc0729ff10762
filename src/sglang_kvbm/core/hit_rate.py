"""KVBM's host and disk cache hit rates: a sliding window over recent requests.

KVBM (``block_manager`` cache statistics) records, once per request, how many
of the blocks it looked up below the device were found in host memory and how
many on disk, and reports ``hits / blocks looked up`` over the last
``DYN_KVBM_CACHE_STATS_MAX_REQUESTS`` requests (default 1000). This is that
definition: a request looked up again while it waits replaces its own entry.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable

DEFAULT_WINDOW = 1000


class HitRateWindow:
    def __init__(self, max_requests: int = DEFAULT_WINDOW) -> None:
        self._max = max(1, max_requests)
        self._entries: OrderedDict[Hashable, tuple[int, int, int]] = OrderedDict()
        self._host = self._disk = self._total = 0

    def record(self, request: Hashable, host_blocks: int, disk_blocks: int, total_blocks: int) -> None:
        """What one request's lookup found: blocks in host, blocks on disk, blocks looked up."""
        if total_blocks <= 0:
            return
        old = self._entries.pop(request, None)
        if old is not None:
            self._subtract(old)
        entry = (host_blocks, disk_blocks, total_blocks)
        self._entries[request] = entry
        self._host += host_blocks
        self._disk += disk_blocks
        self._total += total_blocks
        while len(self._entries) > self._max:
            self._subtract(self._entries.popitem(last=False)[1])

    def _subtract(self, entry: tuple[int, int, int]) -> None:
        self._host -= entry[0]
        self._disk -= entry[1]
        self._total -= entry[2]

    @property
    def host_rate(self) -> float:
        return self._host / self._total if self._total else 0.0

    @property
    def disk_rate(self) -> float:
        return self._disk / self._total if self._total else 0.0

    def clear(self) -> None:
        self._entries.clear()
        self._host = self._disk = self._total = 0
