"""Onboard from disk only when it pays: estimated read time against estimated recompute time.

Both costs are measured while serving. Each meter fits ``seconds = fixed +
per_unit * units`` by least squares over its recent samples (bytes read for the
disk, tokens prefilled for the model), so a fixed per-read latency and the
bandwidth both show. Until both meters have data the policy loads (a disk hit is
usually worth it, and loading is how the read meter learns).

``always`` (``SGLANG_KVBM_DISK_ONBOARD=always``) reads every disk hit, the meters still kept for the logs: for a
disk known to be fast, and for tests whose subject is what a read serves, not whether it pays on a busy machine.

Probes: once reading stops paying nothing is read, so the read meter would never
learn that a slowdown has passed. Every ``probe_every``-th "recompute" decision
loads anyway (``decisions["probe"]``): at most one in ``probe_every`` spans
that would have been recomputed is read instead, a count rather than a clock or
a coin so that it is bounded and repeatable. When the reads recorded after a
probe beat the prefill they replace (their seconds against the prefill
estimate of their tokens), the read meter forgets its older samples: the
disk is fast again and the policy loads at once. A probe that reads slow is
just one more sample.
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
        self.recorded = 0  # samples ever recorded (a mark for :meth:`since`)

    def record(self, units: float, seconds: float) -> None:
        if units > 0 and seconds >= 0 and math.isfinite(seconds):
            self._samples.append((float(units), float(seconds)))
            self.recorded += 1

    def __len__(self) -> int:
        return len(self._samples)

    def since(self, mark: int) -> list[tuple[float, float]]:
        """``(units, seconds)`` of the samples recorded after ``recorded`` was ``mark`` (those still held)."""
        n = min(len(self._samples), max(0, self.recorded - mark))
        return list(self._samples)[len(self._samples) - n :]

    def keep_since(self, mark: int) -> None:
        """Forget the samples recorded before ``recorded`` was ``mark``."""
        kept = self.since(mark)
        self._samples.clear()
        self._samples.extend(kept)

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

    def __init__(self, bytes_per_token: float, read: Optional[LinearCostMeter] = None,
                 prefill: Optional[LinearCostMeter] = None, probe_every: int = 32, always: bool = False):
        if probe_every < 1:
            raise ValueError(f"probe_every must be at least 1, got {probe_every}")
        self.bytes_per_token = bytes_per_token
        self.read = read or LinearCostMeter()
        self.prefill = prefill or LinearCostMeter()
        self.probe_every = probe_every
        self.always = always
        self.decisions = collections.Counter()
        self._logged_break_even: Optional[float] = -1.0
        self._recomputes = 0  # "recompute" decisions since the last probe
        self._probe_mark: Optional[int] = None  # ``read.recorded`` when an unanswered probe was sent

    def disk_pays(self, tokens: int) -> bool:
        if self.always:
            self.decisions["load (always)"] += 1
            return True
        read = self.read.estimate(tokens * self.bytes_per_token)
        prefill = self.prefill.estimate(tokens)
        if read is None or prefill is None:
            self.decisions["load (not measured yet)"] += 1
            return True
        if self._take_probe_answer():
            read = self.read.estimate(tokens * self.bytes_per_token)
        self._log_break_even()
        if read < prefill:
            self.decisions["load"] += 1
            return True
        self._recomputes += 1
        if self._recomputes < self.probe_every:
            self.decisions["recompute"] += 1
            return False
        self._recomputes = 0
        self.decisions["probe"] += 1
        if self._probe_mark is None:
            self._probe_mark = self.read.recorded
        return True

    def _take_probe_answer(self) -> bool:
        """True when the reads since a probe beat the prefill they replaced (the older read samples are dropped)."""
        mark = self._probe_mark
        if mark is None or self.read.recorded == mark:
            return False
        self._probe_mark = None
        fresh = self.read.since(mark)
        replaced = sum(self.prefill.estimate(units / self.bytes_per_token) for units, _ in fresh)
        if sum(seconds for _, seconds in fresh) >= replaced:
            return False
        self.read.keep_since(mark)
        logger.info("kvbm: a probe read from disk beat recomputing: older read times are dropped, loading resumes")
        return True

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
