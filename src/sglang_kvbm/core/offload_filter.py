"""Which host blocks are worth writing to disk: KVBM's frequency filter.

A block's count starts at 1 the first time it is offered, doubles every time it
is offered again (stored again, or hit; saturating at 2**63 - 1 as KVBM's i64
does), and every decay step takes 1 off every count, forgetting those that reach
0. A block goes to disk once its count reaches the threshold (2): it has been
reused at least once recently. This spares SSDs the write of every one-shot
prompt.

Decay is lazy. KVBM walks its whole table on a timer; here, under the scheduler,
that walk was a stall that grew with the table (0.9 s at 1M keys). Decay steps
fall at fixed times (every ``decay_interval_s`` from construction, as KVBM's
timer ticks), so a key's count now is its count when last offered minus the
steps since. Each key keeps one number, ``count + epoch`` at its last offer,
and its count at epoch ``e`` is that number minus ``e``; nothing is walked.

Memory is bounded by forgetting the least recently offered key when the table
is full (O(1)), where KVBM decays the whole table until it fits. The key that
goes is the one that has decayed the longest since its last use; KVBM would
instead drop every count-1 key at once, however recent.
"""

from __future__ import annotations

import collections
import math
import time
from typing import Callable, Hashable

_SATURATED = (1 << 63) - 1  # KVBM counts in i64 with saturating_mul


class FrequencyFilter:
    def __init__(
        self,
        threshold: int = 2,
        decay_interval_s: float = 10.0,
        max_entries: int = 1 << 20,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if threshold < 1:
            raise ValueError(f"FrequencyFilter threshold={threshold!r} must be at least 1 (KVBM uses 2)")
        if not (math.isfinite(decay_interval_s) and decay_interval_s > 0):
            raise ValueError(f"FrequencyFilter decay_interval_s={decay_interval_s!r} must be a positive number of seconds")
        if max_entries < 1:
            raise ValueError(f"FrequencyFilter max_entries={max_entries!r} must be at least 1")
        self._threshold = threshold
        self._interval = decay_interval_s
        self._max_entries = max_entries
        self._clock = clock
        self._start = clock()
        # key -> count + epoch at its last offer; least recently offered first.
        self._bases: collections.OrderedDict[Hashable, int] = collections.OrderedDict()

    def offer(self, key: Hashable) -> bool:
        """Count one more use of ``key``; True when it has earned a disk copy."""
        epoch = self._epoch()
        bases = self._bases
        base = bases.pop(key, None)  # re-inserted below, at the most recent end
        count = 0 if base is None else base - epoch
        count = 1 if count <= 0 else min(count * 2, _SATURATED)
        bases[key] = count + epoch
        if base is None and len(bases) > self._max_entries:
            bases.popitem(last=False)
        return count >= self._threshold

    def count(self, key: Hashable) -> int:
        """``key``'s count now (0 when forgotten), without counting a use."""
        base = self._bases.get(key)
        return 0 if base is None else max(base - self._epoch(), 0)

    def _epoch(self) -> int:
        """Decay steps since construction: KVBM's timer ticks, counted instead of run."""
        return int((self._clock() - self._start) // self._interval)
