"""Onboard from disk only when it pays: estimated read time against estimated recompute time.

Both costs are measured while serving. Each meter fits ``seconds = fixed +
per_unit * units`` by least squares over its recent samples (bytes read for the
disk, tokens prefilled for the model), so a fixed per-read latency and the
bandwidth both show. Until both meters have data the policy loads (a disk hit is
usually worth it, and loading is how the read meter learns).
"""

from __future__ import annotations

import collections
import logging
import math
from typing import Optional

logger = logging.getLogger(__name__)


class LinearCostMeter:
    """Least-squares ``seconds ~ fixed + per_unit * units`` over the last ``window`` samples."""

    def __init__(self, window: int = 64) -> None:
        self._samples: collections.deque[tuple[float, float]] = collections.deque(maxlen=window)

    def record(self, units: float, seconds: float) -> None:
        if units > 0 and seconds >= 0 and math.isfinite(seconds):
            self._samples.append((float(units), float(seconds)))

    def __len__(self) -> int:
        return len(self._samples)

    def fit(self) -> Optional[tuple[float, float]]:
        """``(fixed, per_unit)``, both >= 0; None without samples."""
        n = len(self._samples)
        if n == 0:
            return None
        sx = sum(u for u, _ in self._samples)
        sy = sum(s for _, s in self._samples)
        sxx = sum(u * u for u, _ in self._samples)
        sxy = sum(u * s for u, s in self._samples)
        denom = n * sxx - sx * sx
        if n >= 3 and denom > 1e-12 * max(1.0, sxx * n):
            slope = (n * sxy - sx * sy) / denom
            fixed = (sy - slope * sx) / n
            if slope > 0 and fixed >= 0:
                return fixed, slope
        return 0.0, sy / sx  # proportional: too few or degenerate samples

    def estimate(self, units: float) -> Optional[float]:
        fitted = self.fit()
        return None if fitted is None else fitted[0] + fitted[1] * units


class OnboardPolicy:
    """Decides whether a disk-resident span of a prefix is loaded or recomputed."""

    def __init__(self, bytes_per_token: float, read: Optional[LinearCostMeter] = None, prefill: Optional[LinearCostMeter] = None):
        self.bytes_per_token = bytes_per_token
        self.read = read or LinearCostMeter()
        self.prefill = prefill or LinearCostMeter()
        self.decisions = collections.Counter()
        self._logged_break_even: Optional[float] = -1.0

    def disk_pays(self, tokens: int) -> bool:
        read = self.read.estimate(tokens * self.bytes_per_token)
        prefill = self.prefill.estimate(tokens)
        if read is None or prefill is None:
            self.decisions["load (not measured yet)"] += 1
            return True
        self._log_break_even()
        pays = read < prefill
        self.decisions["load" if pays else "recompute"] += 1
        return pays

    def break_even_tokens(self) -> Optional[float]:
        """Shortest disk span worth loading: 0 = always, inf = never, None = not measured yet."""
        read, prefill = self.read.fit(), self.prefill.fit()
        if read is None or prefill is None:
            return None
        read_fixed, read_per_token = read[0], read[1] * self.bytes_per_token
        prefill_fixed, prefill_per_token = prefill
        gain = prefill_per_token - read_per_token
        extra = read_fixed - prefill_fixed
        if gain <= 0:
            return math.inf if extra >= 0 or gain < 0 else 0.0
        return max(0.0, extra / gain)

    def _log_break_even(self) -> None:
        be = self.break_even_tokens()
        if be is None:
            return
        old = self._logged_break_even
        changed = old is None or old < 0 or (math.isinf(be) != math.isinf(old)) or (
            not math.isinf(be) and abs(be - old) > max(16.0, 0.5 * old)
        )
        if changed:
            self._logged_break_even = be
            read, prefill = self.read.fit(), self.prefill.fit()
            logger.info(
                "kvbm: disk break-even %s (disk read %.3f ms + %.1f us/token, prefill %.3f ms + %.1f us/token)",
                "never pays" if math.isinf(be) else f"{be:.0f} tokens",
                read[0] * 1e3, read[1] * self.bytes_per_token * 1e6, prefill[0] * 1e3, prefill[1] * 1e6,
            )
