"""A remote tier's heartbeat: whether its server answers, asked about once a second on a thread of its own.

A call to a server that is cut off waits out its time limit (a Mooncake call ~4.5 s, an S3 request its timeout),
and a store used to learn it was down only from such a call. The heartbeat asks the server with a plain TCP
connect (no client library; no GIL held while it waits) every :data:`INTERVAL_S`, for at most :data:`TIMEOUT_S`:
a lost server marks the tier down within about two seconds, lookups skip it at once (``stalled``), and the first
answer afterwards marks it up again.
"""

from __future__ import annotations

import logging
import socket
import threading
from typing import Callable, Sequence

logger = logging.getLogger(__name__)

INTERVAL_S = 1.0
TIMEOUT_S = 1.0


def unanswered(addresses: Sequence[str], timeout: float = TIMEOUT_S) -> list[str]:
    """The ``host:port`` of ``addresses`` that refused a connection or did not accept one in ``timeout``."""
    lost = []
    for address in addresses:
        host, _, port = address.rpartition(":")
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
        except (OSError, ValueError):
            lost.append(address)
    return lost


class Heartbeat:
    """Calls ``down(why)`` after every probe that finds one of ``addresses()`` unanswered, and ``up()`` after the
    first probe that finds them all answering again, until :meth:`stop`."""

    def __init__(self, name: str, addresses: Callable[[], Sequence[str]], down: Callable[[str], None],
                 up: Callable[[], None], *, interval: float = INTERVAL_S, timeout: float = TIMEOUT_S) -> None:
        self._addresses, self._down, self._up = addresses, down, up
        self.lost = False  # the last probe found the server gone
        self._interval, self._timeout = interval, timeout
        self._stop = threading.Event()
        self.beats = 0
        self._thread = threading.Thread(target=self._run, name=f"kvbm-{name}-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                down = unanswered(self._addresses(), self._timeout)
                if self._stop.is_set():
                    return
                if down:
                    self.lost = True
                    self._down(f"{', '.join(down)} did not answer the heartbeat in {self._timeout:g} s")
                elif self.lost:
                    self.lost = False
                    self._up()
            except Exception:  # never the end of the heartbeat: the store's own calls still fail into "down"
                logger.exception("kvbm: heartbeat failed")
            self.beats += 1
            self._stop.wait(self._interval)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self._timeout + 1)
