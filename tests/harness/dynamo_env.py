"""Dynamo processes on one machine: which interpreter, which environment, how each is started and stopped.

Every process runs from Dynamo's environment (:func:`dynamo_python`: ``.venv-dynamo``, which
``make test`` builds: ai-dynamo 1.6.1 with the sglang 0.5.21 it pins, and this package), in its own process
group, stopped by group id. No etcd or NATS: discovery is a directory shared by every process
(``DYN_DISCOVERY_BACKEND=file``, ``DYN_FILE_KV``), requests go over TCP and events over ZMQ,
all on 127.0.0.1. :mod:`harness.dynamo` builds the frontend, workers and router
view on these.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Mapping, Optional, Sequence

import requests

from sglang_kvbm.integration.dynamo.router_view import NAMESPACE_ENDPOINT  # noqa: F401  (where dynamo.sglang serves)
from sglang_kvbm.ops.demo.server import QUICK_STOP, free_port, log_tail, stop_group


def dynamo_python() -> Path:
    """The interpreter of Dynamo's environment: ``DYNAMO_PYTHON``, else ``.venv-dynamo/bin/python`` under the
    current directory (a repository checkout; the tests set ``DYNAMO_PYTHON`` to their checkout's: this module
    may be installed from a wheel, far from any checkout).

    (Not an ``SGLANG_KVBM_*`` name: the library refuses unknown variables of its own prefix, and
    the servers the tests start inherit the tests' environment.)
    """
    return Path(os.environ.get("DYNAMO_PYTHON", Path.cwd() / ".venv-dynamo" / "bin" / "python"))


def require_dynamo() -> Path:
    python = dynamo_python()
    if not python.exists():
        raise FileNotFoundError(
            f"{python} not found: run `make test` (it creates .venv-dynamo) or set DYNAMO_PYTHON"
        )
    return python


def dynamo_env(discovery_dir: str | Path, host: str = "127.0.0.1") -> dict[str, str]:
    """What every process of one deployment shares: file discovery in ``discovery_dir``, TCP requests,
    ZMQ events, each process reached at ``host`` (its own host's address; one machine: loopback)."""
    return {
        "DYN_DISCOVERY_BACKEND": "file",
        "DYN_FILE_KV": str(discovery_dir),
        "DYN_REQUEST_PLANE": "tcp",
        "DYN_EVENT_PLANE": "zmq",
        # What Dynamo binds and advertises for its request and event planes and its status server
        # (docs/fleet.md): the host's own address, never a guess.
        "DYN_TCP_RPC_HOST": host,
        "DYN_EVENT_PLANE_HOST": host,
        "DYN_SYSTEM_HOST": host,
        "HF_HUB_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1",
        # A stopped worker unregisters, then waits 5 s for in-flight requests by default; these
        # deployments are stopped only when nothing is in flight.
        "DYN_GRACEFUL_SHUTDOWN_GRACE_PERIOD_SECS": "0",
        **QUICK_STOP,
    }


class DynamoError(RuntimeError):
    pass


def system_port() -> int:
    """A free port for ``DYN_SYSTEM_PORT``: Dynamo 1.6.1 reads that variable as an i16, so it must be
    below 32768 (``invalid value unsigned int `48421`, expected i16 for key "SYSTEM_PORT"``)."""
    return free_port()


class _Process:
    """One Dynamo process in its own process group, its output in a log file.

    Stopped by a SIGTERM to its leader only, then SIGKILL to what is left of the group: Dynamo's
    worker shuts its SGLang engine down itself, whereas a SIGTERM to the whole group kills
    SGLang's scheduler under it, whose watchdog then sleeps 5 s for crash diagnostics before
    killing its own tree.
    """

    name = "dynamo"

    def __init__(self, args: Sequence[str], env: Mapping[str, str], log_path: Optional[str | Path],
                 on_host=None) -> None:
        """``on_host``: a :class:`harness.fleet.Host` to run on (its namespace, hostname), else this machine."""
        self.args = [str(a) for a in args] if on_host is None else on_host.command(args)
        self.env = {**os.environ, **env}
        self.log_path = Path(log_path) if log_path else None
        self._proc: Optional[subprocess.Popen] = None
        self._log = None

    def start(self) -> "_Process":
        require_dynamo()
        self._log = open(self.log_path, "wb") if self.log_path else subprocess.DEVNULL
        self._proc = subprocess.Popen(
            self.args, env=self.env, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        return self

    @property
    def pid(self) -> Optional[int]:
        return self._proc.pid if self._proc else None

    def check_running(self) -> None:
        if self._proc is None:
            raise DynamoError(f"{self.name} was not started")
        if self._proc.poll() is not None:
            raise DynamoError(f"{self.name} exited with {self._proc.returncode}{self.tail()}")

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            stop_group(proc, leader_only=True, grace=20.0)
        if self._log not in (None, subprocess.DEVNULL):
            self._log.close()
        self._log = None

    def tail(self, lines: int = 40) -> str:
        return log_tail(self.log_path, self.name, lines)

    def _wait(self, ready, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.check_running()
            try:
                if ready():
                    return
            except requests.RequestException:
                pass
            time.sleep(0.5)
        raise DynamoError(f"{self.name}: {what} not reached in {timeout:.0f}s{self.tail()}")

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
