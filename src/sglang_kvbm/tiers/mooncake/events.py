"""The Mooncake master's KV events, for Dynamo's router (``--shared-cache-type hicache``), by polling the master.

Dynamo 1.6.1's router learns what is in a Mooncake Store only from the
master's ZMQ KV events (``DYN_MOONCAKE_KV_EVENTS_ENDPOINT``; Dynamo's
``kv_router/shared_cache.rs``): three frames, a topic, an 8-byte big-endian
sequence number and msgpack ``(timestamp_ms, [{event_type, object_key,
tenant_id, group_id}], dp_rank)``, where ``event_type`` is ``stored`` or
``removed``. A gap in the sequence makes it forget everything it knew. The
``mooncake_master`` on PyPI (0.3.13.post1, both wheels) accepts
``--enable_kv_events`` but is built without its publisher: its
``/kv_events/status`` stays ``enabled: false`` and nothing is sent.

:class:`EventRelay` stands in for it, beside the master: it reads the master's
object names (``GET /get_all_keys`` on its HTTP port, ``--metrics_port``), and
publishes what appeared and what left since the last poll, in that format, on
a ZMQ XPUB socket. A router that subscribes late (or reconnects) is sent every
name the store holds at once, so it never waits for a resync. Names are
announced as the master holds them, with one addition: an object of this
library (tag ``kvbm-...``) holds a rank's K *and* V (SGLang's HiCache writes
``..._{rank}_k`` and ``..._{rank}_v``), and the router wants both names for an
MHA page, so its ``_k`` name is announced with its ``_v`` twin.

The price of polling: each poll lists every object the master holds (0.8 ms
with a handful here; it grows with the store); a store of millions of objects
wants a longer interval, or a master built with its own publisher (Mooncake's
``--enable_kv_events``).
"""

from __future__ import annotations

import logging
import re
import threading
import time
import urllib.request
from typing import Iterable, Optional

import msgspec
import zmq

from sglang_kvbm.tiers.block_objects import TAG_PREFIX

logger = logging.getLogger(__name__)

BATCH = 1000  # names per message
_KVBM_MHA = re.compile(r"_\d+(?:_\d+)?_k$")  # object_suffix() of an MHA rank: _{tp}_k, _{tp}_{pp}_k
_SUBSCRIBED = 1  # first byte of an XPUB subscription message


def announced(key: str) -> list[str]:
    """The names the router is told for an object the master holds."""
    if key.startswith(TAG_PREFIX) and _KVBM_MHA.search(key):
        return [key, key[:-1] + "v"]
    return [key]


def list_keys(admin_url: str, timeout: float = 5.0) -> set[str]:
    """Every object name the master holds (its ``/get_all_keys``)."""
    with urllib.request.urlopen(f"{admin_url.rstrip('/')}/get_all_keys", timeout=timeout) as response:
        return {line for line in response.read().decode().splitlines() if line}


class EventRelay:
    """Polls a master every ``interval`` seconds and publishes the difference on ``bind`` (a ZMQ endpoint)."""

    def __init__(self, admin_url: str, bind: str, *, interval: float = 1.0, tenant: str = "default") -> None:
        self.admin_url = admin_url
        self.interval = interval
        self.tenant = tenant
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.XPUB)
        self._socket.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscriber's subscription, not just the first
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(bind)
        self.endpoint = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self.held: set[str] = set()  # names announced as stored
        self.sequence = 0
        self._snapshot_due = False  # a router subscribed since the last snapshot
        self.stats = {"polls": 0, "poll_errors": 0, "stored": 0, "removed": 0, "snapshots": 0}

    def poll(self) -> bool:
        """One poll: publish what changed (and everything, to a new subscriber); False when the master did not answer."""
        self._snapshot_due |= self._new_subscribers()  # kept until a poll succeeds
        try:
            keys = list_keys(self.admin_url)
        except OSError as error:
            self.stats["poll_errors"] += 1
            if self.stats["poll_errors"] == 1 or self.stats["poll_errors"] % 60 == 0:
                logger.warning("kvbm events relay: master %s did not answer (%s); its names stay as last seen",
                               self.admin_url, error)
            return False
        self.stats["polls"] += 1
        now = {name for key in keys for name in announced(key)}
        gone, new = self.held - now, now - self.held
        self.held = now
        if self._snapshot_due:  # a router that just (re)connected holds nothing: tell it everything
            self._snapshot_due = False
            self.stats["snapshots"] += 1
            new = now
        self._publish("removed", sorted(gone))
        self._publish("stored", sorted(new))
        return True

    def _new_subscribers(self) -> bool:
        seen = False
        while True:
            try:
                message = self._socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                return seen
            seen = seen or (bool(message) and message[0] == _SUBSCRIBED)

    def _publish(self, event_type: str, names: Iterable[str]) -> None:
        names = list(names)
        for start in range(0, len(names), BATCH):
            events = [{"event_type": event_type, "object_key": name, "tenant_id": self.tenant, "group_id": None}
                      for name in names[start:start + BATCH]]
            self.sequence += 1
            payload = msgspec.msgpack.encode((int(time.time() * 1000), events, 0))
            self._socket.send_multipart([b"", self.sequence.to_bytes(8, "big"), payload])
            self.stats[event_type] += len(events)

    def run(self, stop: Optional[threading.Event] = None) -> None:
        stop = stop or threading.Event()
        logger.info("kvbm events relay: master %s -> %s every %.2f s", self.admin_url, self.endpoint, self.interval)
        while not stop.is_set():
            self.poll()
            stop.wait(self.interval)

    def close(self) -> None:
        self._socket.close(0)
        self._context.term()
