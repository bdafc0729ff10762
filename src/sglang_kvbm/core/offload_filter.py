"""Which host blocks are worth writing to disk: KVBM's frequency filter.

A block's count starts at 1 the first time it is offered, doubles every time it
is offered again (stored again, or hit), and every decay step takes 1 off every
count, forgetting those that reach 0. A block goes to disk once its count
reaches the threshold (2): it has been reused at least once recently. This
spares SSDs the write of every one-shot prompt.
"""

from __future__ import annotations

import time
from typing import Callable, Hashable


class FrequencyFilter:
    def __init__(
        self,
        threshold: int = 2,
        decay_interval_s: float = 10.0,
        max_entries: int = 1 << 20,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._threshold = threshold
        self._interval = decay_interval_s
        self._max_entries = max_entries
        self._clock = clock
        self._counts: dict[Hashable, int] = {}
        self._last_decay = clock()

    def offer(self, key: Hashable) -> bool:
        """Count one more use of ``key``; True when it has earned a disk copy."""
        self._decay_due()
        count = self._counts.get(key)
        count = 1 if count is None else count * 2
        self._counts[key] = count
        if len(self._counts) > self._max_entries:
            while len(self._counts) > self._max_entries:
                self._decay()
        return count >= self._threshold

    def count(self, key: Hashable) -> int:
        self._decay_due()
        return self._counts.get(key, 0)

    def _decay_due(self) -> None:
        now = self._clock()
        steps = int((now - self._last_decay) // self._interval)
        if steps <= 0:
            return
        self._last_decay += steps * self._interval
        for _ in range(min(steps, 64)):
            self._decay()
            if not self._counts:
                break

    def _decay(self) -> None:
        self._counts = {k: c - 1 for k, c in self._counts.items() if c > 1}
