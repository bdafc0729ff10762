"""A real Mooncake Store on 127.0.0.1 for tests: ``mooncake_master`` and a standalone memory lender.

``mooncake-transfer-engine-non-cuda`` (the ``mooncake`` extra) ships both
binaries; they need the system library ``libibverbs1``. The master keeps every
object's metadata in its memory (a restart forgets them all); objects live in
the segments clients lend, so the lender here (``mooncake_client``, Mooncake's
standalone "real client") keeps them when a worker leaves.

No metadata server: clients find each other by ``P2PHANDSHAKE`` (the master's
embedded HTTP metadata server binds 0.0.0.0 whatever its host flag says). So the
master listens on 127.0.0.1 only, and the one leak past it (Mooncake 0.3.13) is
every client's two transfer listeners (the lender's and each worker's: 0.0.0.0
and ``[::]``, in ``MC_MIN_RPC_PORT``..``MC_MAX_RPC_PORT``), which Mooncake cannot
bind to one address; ``MC_TCP_BIND_ADDRESS`` only makes clients advertise 127.0.0.1.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import requests

from sglang_kvbm.ops.demo.server import free_port, stop_group
from sglang_kvbm.tiers.mooncake.probe import unreachable_endpoints


def binary(name: str) -> Path:
    import mooncake

    path = Path(mooncake.__file__).parent / name
    if not path.exists():
        raise FileNotFoundError(f"{path}: install the mooncake extra (pip install 'sglang-kvbm[mooncake]')")
    return path


class MooncakeCluster:
    """A master (RPC and metrics on 127.0.0.1, no metadata server) and, unless ``lend`` is 0, one memory lender.

    ``on_host`` (a :class:`harness.fleet.Host`): every process runs there and binds its address instead."""

    def __init__(self, log_dir: Path, *, lend: str = "256MB", on_host=None) -> None:
        self.log_dir = Path(log_dir)
        self.on_host = on_host
        self.host = on_host.address if on_host is not None else "127.0.0.1"
        self.rpc_port, self.admin_port = free_port(), free_port()
        self.lend = lend
        self.master: Optional[subprocess.Popen] = None
        self.lender: Optional[subprocess.Popen] = None
        self.relay: Optional[subprocess.Popen] = None
        self.events_endpoint: Optional[str] = None

    @property
    def master_address(self) -> str:
        return f"{self.host}:{self.rpc_port}"

    @property
    def metadata_url(self) -> str:
        """What clients are given as the metadata server: none, they handshake with each other."""
        return "P2PHANDSHAKE"

    def _spawn(self, args: list, name: str) -> subprocess.Popen:
        log = open(self.log_dir / f"{name}.log", "ab")
        env = {**os.environ, "MC_TCP_BIND_ADDRESS": self.host}
        if self.on_host is not None:
            args = self.on_host.command(args)
        try:
            return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        finally:
            log.close()

    def start_master(self, timeout: float = 120.0) -> None:
        self.master = self._spawn([
            str(binary("mooncake_master")), f"--rpc_port={self.rpc_port}", f"--rpc_address={self.host}",
            f"--metrics_host={self.host}", f"--metrics_port={self.admin_port}", "--enable_metric_reporting=false",
        ], "master")
        # Its metrics server answers /health before its RPC server listens: ready is both (a client or doctor
        # that connects in between is refused; seen once in CI without a lender to wait for).
        self._wait(lambda: requests.get(f"http://{self.host}:{self.admin_port}/health", timeout=1).ok
                   and not unreachable_endpoints(self.master_address, ""), timeout, "master")

    def start_lender(self, timeout: float = 120.0) -> None:
        self.lender = self._spawn([
            str(binary("mooncake_client")), f"--host={self.host}", f"--port={free_port()}",
            f"--global_segment_size={self.lend}", f"--master_server_address={self.master_address}",
            f"--metadata_server={self.metadata_url}", "--protocol=tcp",
        ], "lender")
        self._wait(lambda: self.capacity() > 0, timeout, "lender")

    def start_relay(self, interval: float = 0.2) -> str:
        """``sglang-kvbm mooncake-events`` beside the master (this interpreter's): the endpoint routers subscribe to."""
        self.events_endpoint = f"tcp://{self.host}:{free_port()}"
        self.relay = self._spawn([
            sys.executable, "-m", "sglang_kvbm.ops.cli", "mooncake-events", f"--master-http={self.host}:{self.admin_port}",
            f"--bind={self.events_endpoint}", f"--interval={interval}",
        ], "relay")
        return self.events_endpoint

    def capacity(self) -> int:
        """Bytes lent to the store, from the master's metrics."""
        text = requests.get(f"http://{self.host}:{self.admin_port}/metrics", timeout=2).text
        for line in text.splitlines():
            if line.startswith("master_total_capacity_bytes"):
                return int(float(line.split()[-1]))
        return 0

    def _wait(self, ready, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            proc = self.master if what == "master" else self.lender
            if proc.poll() is not None:
                raise RuntimeError(f"mooncake {what} exited with {proc.returncode} (see {self.log_dir}/{what}.log)")
            try:
                if ready():
                    return
            except requests.RequestException:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"mooncake {what} not ready in {timeout:.0f}s")

    def kill_master(self) -> None:
        """SIGKILL, as a crash: no goodbye to its clients."""
        proc, self.master = self.master, None
        if proc is not None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)

    def stop(self) -> None:
        for name in ("relay", "lender", "master"):  # lenders first: the master outlives its clients
            proc = getattr(self, name)
            setattr(self, name, None)
            if proc is not None:
                stop_group(proc, grace=5.0)

    def __enter__(self) -> "MooncakeCluster":
        self.start_master()
        if self.lend:
            self.start_lender()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
