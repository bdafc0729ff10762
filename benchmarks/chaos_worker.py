"""The chaos soak's workers: kvbm servers that can be killed and restarted, and the leak check at idle.

A :class:`Worker` is one ``--radix-cache-backend kvbm`` server (device pool,
host tier, disk tier, optionally G4) that keeps its disk directory across
restarts. Each incarnation logs to a file of its own in the log directory.
:meth:`Worker.idle_check` waits for an idle server's ``/stats`` to settle and
says what it still holds (:func:`leak_of`) if it never does.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Optional

import requests

from sglang_kvbm.ops.demo.server import SglangServer, free_port

WARM_UP = [4000 + i for i in range(48)]  # three pages no schedule's prompt starts with


class Worker:
    def __init__(self, name: str, model: Path, scratch: Path, logs: Path, *, pool: int, host_blocks: int,
                 disk_blocks: int, page_size: int = 16, cluster=None) -> None:
        self.name, self.model, self.logs = name, model, logs
        self.disk = scratch / f"disk-{name}"
        self.disk.mkdir(parents=True, exist_ok=True)
        self.pool, self.page_size = pool, page_size
        self.env = {
            "DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": str(host_blocks),
            "DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS": str(disk_blocks),
            "DYN_KVBM_DISK_CACHE_DIR": str(self.disk),
            "DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER": "true",
            "DYN_KVBM_METRICS": "true",
            "SGLANG_KVBM_DIGEST_CACHE": str(scratch / f"digests-{name}.json"),
        }
        if cluster is not None:
            self.env.update({"SGLANG_KVBM_MOONCAKE_MASTER": cluster.master_address,
                             "SGLANG_KVBM_MOONCAKE_METADATA": cluster.metadata_url, "MC_TCP_BIND_ADDRESS": "127.0.0.1"})
        self.incarnation = 0
        self.server: Optional[SglangServer] = None
        self.http = 0

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def log_path(self) -> Path:
        return self.logs / f"{self.name}-{self.incarnation}.log"

    def start(self) -> float:
        """Start an incarnation (new ports, same disk directory); seconds until healthy."""
        self.incarnation += 1
        self.http = free_port()
        self.server = SglangServer(self.model, page_size=self.page_size, max_total_tokens=self.pool,
                                   extra_args=["--radix-cache-backend", "kvbm"],
                                   env={**self.env, "DYN_KVBM_METRICS_PORT": str(self.http)}, log_path=self.log_path)
        started = time.monotonic()
        self.server.start(timeout=300)
        self.server.generate(WARM_UP, max_new_tokens=1)  # the first request's one-time costs (full pages)
        return time.monotonic() - started

    def alive(self) -> bool:
        proc = self.server._proc if self.server else None
        return proc is not None and proc.poll() is None

    def kill9(self) -> None:
        """SIGKILL to the server's whole process group, as a crash: nothing is flushed or closed."""
        proc = self.server._proc
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=60)
        self.server.stop()  # reaps what is left of the group, closes the log

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()

    def stats(self) -> dict:
        return requests.get(f"http://127.0.0.1:{self.http}/stats", timeout=30).json()

    def tier_dirs(self) -> list[Path]:
        return sorted(p for p in self.disk.glob("sglang-kvbm-*") if p.is_dir())

    def idle_check(self, timeout: float = 30.0) -> tuple[Optional[str], dict]:
        """At idle, wait until no copy is in flight and nothing is pinned; (None, stats) or (what leaks, stats).

        SGLang unlocks a node at its next step, so a one-token request drives steps
        while waiting (its 5 tokens fill no page: it stores nothing). A real leak never settles.
        """
        deadline = time.monotonic() + timeout
        while True:
            try:
                stats = self.stats()
                problem = leak_of(stats)
            except (requests.RequestException, ValueError) as exc:
                stats, problem = {}, f"/stats unreadable: {exc}"
            if problem is None or time.monotonic() > deadline:
                return problem, stats
            try:
                self.server.generate([7, 8, 9, 10, 11], max_new_tokens=1)
            except requests.RequestException:
                pass
            time.sleep(0.2)


def leak_of(s: dict) -> Optional[str]:
    """What an idle server's ``/stats`` shows still held, or None: pins, copies in flight, orphaned host rows,
    device pages held, events held back, and books that do not add up."""
    found = []
    if s.get("in_flight"):
        found.append(f"in_flight={s['in_flight']}")
    host = s.get("host") or {}
    for key in ("pinned", "in_flight", "orphaned"):
        if host.get(key):
            found.append(f"host.{key}={host[key]}")
    if host and host["registered"] + host["free"] != host["capacity"]:
        found.append(f"host rows {host['registered']}+{host['free']} != {host['capacity']}")
    disk = s.get("disk") or {}
    if disk.get("writing"):
        found.append(f"disk.writing={disk['writing']}")
    if disk and not disk.get("rebuilding") and disk["registered"] + disk["free"] + disk["lost"] != disk["slots"]:
        found.append(f"disk slots {disk['registered']}+{disk['free']}+{disk['lost']} != {disk['slots']}")
    device = s.get("device") or {}
    if device.get("protected"):
        found.append(f"device.protected={device['protected']}")
    if device and device["available"] + device["evictable"] != device["total"]:
        found.append(f"device {device['available']}+{device['evictable']} != {device['total']}")
    if (s.get("events") or {}).get("held"):
        found.append(f"events.held={s['events']['held']}")
    return ", ".join(found) or None
