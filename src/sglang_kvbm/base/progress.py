"""Progress for long start-up work (pinning host memory, preallocating disk files).

A bar on a terminal; elsewhere (a server's log) a log line at every tenth.
"""

from __future__ import annotations

import logging
import sys
import time

logger = logging.getLogger(__name__)


class Progress:
    def __init__(self, total: int, what: str) -> None:
        self.total = max(1, total)
        self.what = what
        self.done = 0
        self._next_log = 0.1
        self._started = time.monotonic()
        self._bar = None
        if sys.stderr.isatty():
            try:
                from tqdm import tqdm

                self._bar = tqdm(total=total, desc=f"kvbm: {what}", unit="B", unit_scale=True, leave=False)
            except ImportError:
                pass
        if self._bar is None:
            logger.info("kvbm: %s (%.2f GiB) ...", what, total / (1 << 30))

    def update(self, n: int) -> None:
        self.done += n
        if self._bar is not None:
            self._bar.update(n)
            return
        fraction = self.done / self.total
        if fraction >= self._next_log and fraction < 1:
            logger.info("kvbm: %s %d%%", self.what, int(fraction * 100))
            self._next_log = int(fraction * 10 + 1) / 10

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        logger.info("kvbm: %s done in %.1f s", self.what, time.monotonic() - self._started)

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
