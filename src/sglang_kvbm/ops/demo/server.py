"""Start and stop a real SGLang server on CPU, for the demo, tests and benchmarks.

The server runs in its own process group; :meth:`SglangServer.stop` ends that
group by id, so no scheduler or detokenizer process outlives it.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional, Sequence

import requests

# --mem-fraction-static: on CPU, SGLang measures the machine's available memory before and after
# loading the weights; whatever other processes took meanwhile counts as this server's, and with
# 0.05 a server beside others starting failed ("Loaded weights leave no GPU memory for the KV
# cache"). The pool is --max-total-tokens either way (same RSS measured at 0.05 and 0.3).
# --sleep-on-idle: an idle scheduler otherwise spins a whole core (measured: 20.1 CPU-seconds in 20 idle
# seconds; 0.3 with the flag), so every server waiting between requests, and the tests' reference server
# kept for a whole session, took a core from the processes doing the work on a 2-core machine. It polls
# its sockets with a 1 s timeout instead: a request wakes it at once, and an idle step (completions
# collected, events published) runs at least once a second. SGLang 0.5.21 on have the flag.
CPU_ARGS = (
    "--device", "cpu",
    "--attention-backend", "torch_native",
    "--mem-fraction-static", "0.3",
    "--host", "127.0.0.1",
    "--disable-cuda-graph",
    "--dtype", "float32",
    "--sleep-on-idle",
)

# A stopped server's scheduler dies by SIGTERM before its launcher does; the launcher takes that
# for a crash and, by default, sleeps 5 s to let a GPU settle before dumping its schedulers'
# stacks with py-spy and asking for CUDA core dumps (either one is enough to sleep). Nothing to
# settle on a CPU, and nothing crashed.
QUICK_STOP = {"SGLANG_PYSPY_DUMP_BEFORE_CRASH": "0", "SGLANG_CUDA_COREDUMP_BEFORE_CRASH": "0"}


_handed_out: set[int] = set()


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(count: int = 1) -> int:
    """A port free on 127.0.0.1 now, for a server started later, never one handed out before.

    ``count`` > 1 hands out ``count`` consecutive ports and answers the first: for servers
    that add a rank to a base port (SGLang's KV event endpoints and KVBM's metrics port
    under ``--dp-size``), so no rank's port can be another server's.

    Taken from 20000-21999 and 30000-32767: below the kernel's ephemeral range (32768-60999 by
    default), where a port can be given to some process's outgoing connection between this call
    and the server's bind (seen: a Dynamo worker's KV event port taken while the worker beside it
    started), and outside 22000-29999, where SGLang draws its own ports (``nccl_port``,
    ``get_free_port_below_ephemeral``) for processes that bind them later. Dynamo's
    ``DYN_SYSTEM_PORT`` needs one below 32768 too. Under pytest-xdist each worker draws from its
    own share of each part: two workers' servers never race for one port.
    """
    for _ in range(500):
        low, top = random.choice(_PORT_RANGES)
        base = random.randrange(low, top - count + 1)
        ports = range(base, base + count)
        if any(port in _handed_out for port in ports) or not all(_bindable(port) for port in ports):
            continue
        _handed_out.update(ports)
        return base
    raise RuntimeError(f"no {count} free consecutive ports in {_PORT_RANGES}")


def _port_ranges() -> list[tuple[int, int]]:
    top = min(32768, _ephemeral_low())
    top = top if top > 31_000 else 32768
    return [_worker_share(low, high) for low, high in ((20_000, 22_000), (30_000, top))]


def _worker_share(low: int, top: int) -> tuple[int, int]:
    """``[low, top)``, or this pytest-xdist worker's slice of it (``PYTEST_XDIST_WORKER=gwN``)."""
    worker, workers = os.environ.get("PYTEST_XDIST_WORKER", ""), os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if not (worker.startswith("gw") and worker[2:].isdigit() and workers.isdigit() and int(workers) > 1):
        return low, top
    step = (top - low) // int(workers)
    start = low + step * (int(worker[2:]) % int(workers))
    return start, start + step


_PORT_RANGES = _port_ranges()


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class ServerError(RuntimeError):
    pass


def stream_chunks(response: requests.Response) -> Iterator[dict]:
    """The JSON chunks of a server-sent-event response (SGLang's and Dynamo's streams), up to ``[DONE]``."""
    for line in response.iter_lines():
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            return
        yield json.loads(payload)


def stop_group(proc: subprocess.Popen, *, leader_only: bool = False, grace: float = 30.0) -> None:
    """Stop a process started with ``start_new_session=True`` and everything in its process group.

    SIGTERM (to the group, or to its leader only where the leader shuts its children down
    itself), then after ``grace`` seconds SIGKILL to whatever is left of the group.
    """
    if proc.poll() is None:
        try:
            if leader_only:
                proc.send_signal(signal.SIGTERM)
            else:
                os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=grace)
        except (subprocess.TimeoutExpired, ProcessLookupError):
            pass
    try:  # the leader may be gone while children it started are not
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        pass


def log_tail(path: Optional[Path], name: str, lines: int = 40) -> str:
    """The last lines of a process's log, for an error message ("" without one)."""
    if path is None or not path.exists():
        return ""
    text = path.read_text(errors="replace").splitlines()[-lines:]
    return f"\n--- {name} log (tail) ---\n" + "\n".join(text)


class SglangServer:
    """``python -m sglang.launch_server`` on 127.0.0.1 with the CPU flags above."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        page_size: int = 4,
        max_total_tokens: int = 4096,
        extra_args: Sequence[str] = (),
        env: Optional[Mapping[str, str]] = None,
        log_path: Optional[str | Path] = None,
        port: Optional[int] = None,
        python: Optional[str | Path] = None,
    ) -> None:
        """``python``: the interpreter of the environment to serve from (another SGLang release's; default this
        one)."""
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = [
            str(python or sys.executable), "-m", "sglang.launch_server",
            "--model-path", str(model_dir),
            *CPU_ARGS,
            "--port", str(self.port),
            "--page-size", str(page_size),
            "--max-total-tokens", str(max_total_tokens),
            *extra_args,
        ]
        self.env = {**os.environ, "HF_HUB_OFFLINE": "1", **QUICK_STOP, **(env or {})}
        self.log_path = Path(log_path) if log_path else None
        self._proc: Optional[subprocess.Popen] = None
        self._log = None

    def start(self, timeout: float = 600.0) -> "SglangServer":
        return self.launch().wait_ready(timeout)

    def launch(self) -> "SglangServer":
        """Start the process and return at once (servers that start side by side: launch each, then wait)."""
        self._log = open(self.log_path, "wb") if self.log_path else subprocess.DEVNULL
        self._proc = subprocess.Popen(
            self.args, env=self.env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )
        return self

    def wait_ready(self, timeout: float = 600.0) -> "SglangServer":
        """Until ``/health`` answers 200; a server that exits or is not healthy in ``timeout`` s is stopped."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise ServerError(f"sglang exited with {self._proc.returncode} during start-up{self._tail()}")
            try:
                if requests.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except requests.RequestException:
                pass
            time.sleep(0.5)
        self.stop()
        raise ServerError(f"sglang did not become healthy in {timeout:.0f}s{self._tail()}")

    def generate(self, input_ids: Sequence[int], max_new_tokens: int = 8, **extra: Any) -> dict:
        body = {
            "input_ids": list(input_ids),
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True},
            "return_logprob": True,
            **extra,
        }
        response = requests.post(f"{self.url}/generate", json=body, timeout=600)
        response.raise_for_status()
        return response.json()

    def flush_cache(self) -> None:
        requests.post(f"{self.url}/flush_cache", timeout=60).raise_for_status()

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            stop_group(proc)
        if self._log not in (None, subprocess.DEVNULL):
            self._log.close()
        self._log = None

    def _tail(self, lines: int = 40) -> str:
        return log_tail(self.log_path, "server", lines)

    def __enter__(self) -> "SglangServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
