"""Dynamo's KV router's view of every worker, per tier, from the tests' environment.

:class:`RouterView` starts ``sglang_kvbm.integration.dynamo.router_view`` (the process that builds a second
``KvRouter``) with Dynamo's interpreter and asks it line by line; see that module for the protocol.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
from pathlib import Path
from typing import Optional, Sequence

from harness.dynamo_env import DynamoError, dynamo_env, dynamo_python, require_dynamo
from sglang_kvbm.integration.dynamo.router_view import NAMESPACE_ENDPOINT
from sglang_kvbm.ops.demo.server import stop_group


class RouterView:
    """Dynamo's KV router's per-tier view of every worker: this module as a helper process, asked line by line."""

    def __init__(self, discovery_dir: str | Path, block_size: int, *, endpoint: str = NAMESPACE_ENDPOINT,
                 log_path: Optional[str | Path] = None, settle: float = 3.0) -> None:
        self.args = [str(dynamo_python()), "-m", "sglang_kvbm.integration.dynamo.router_view",
                     "--endpoint", endpoint, "--block-size", str(block_size), "--settle", str(settle)]
        self.env = {**os.environ, **dynamo_env(discovery_dir)}
        self.log_path = Path(log_path) if log_path else None
        self._proc: Optional[subprocess.Popen] = None
        self._log = None

    def start(self, timeout: float = 120.0) -> "RouterView":
        require_dynamo()
        self._log = open(self.log_path, "wb") if self.log_path else subprocess.DEVNULL
        self._proc = subprocess.Popen(self.args, env=self.env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=self._log, start_new_session=True, text=True, bufsize=1)
        if not self._read(timeout).get("ready"):
            raise DynamoError("router view did not start")
        return self

    def _read(self, timeout: float) -> dict:
        assert self._proc is not None and self._proc.stdout is not None
        ready, _, _ = select.select([self._proc.stdout], [], [], timeout)
        line = self._proc.stdout.readline() if ready else ""
        if not line:
            raise DynamoError(f"router view gave no answer in {timeout:.0f}s (exit code {self._proc.poll()})")
        return json.loads(line)

    def _ask(self, request: dict, timeout: float = 120.0) -> dict:
        assert self._proc is not None and self._proc.stdin is not None
        self._proc.stdin.write(json.dumps(request) + "\n")
        self._proc.stdin.flush()
        answer = self._read(timeout)
        if "error" in answer:
            raise DynamoError(f"router view: {answer['error']}")
        return answer

    def tiers(self, token_ids: Sequence[int]) -> dict[int, dict]:
        """``{worker id: {"device", "host", "disk"}}`` in tokens, cumulative; every worker the router knows, all
        zero where nothing matched."""
        workers = self._ask({"token_ids": [int(t) for t in token_ids]})["workers"]
        return {int(w): tiers for w, tiers in workers.items()}

    def best_worker(self, token_ids: Sequence[int], *, device_only: bool = False) -> int:
        """The worker a KV router would pick now (query only); ``device_only``: one that credits no host
        or disk hits, as a router that never heard of those tiers."""
        answer = self._ask({"best_worker": True, "device_only": device_only, "token_ids": [int(t) for t in token_ids]})
        return int(answer["worker_id"])

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            try:
                proc.stdin.close()
            except (OSError, AttributeError):
                pass
            stop_group(proc, leader_only=True, grace=20.0)
            if proc.stdout is not None:
                proc.stdout.close()
        if self._log not in (None, subprocess.DEVNULL):
            self._log.close()
        self._log = None

    def __enter__(self) -> "RouterView":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
