"""Dynamo's standalone KV indexer (``python -m dynamo.indexer``) as a subprocess.

It runs from Dynamo's environment (``ai-dynamo-runtime==1.6.1`` pins a pydantic
SGLang cannot use): the interpreter is :func:`harness.dynamo_env.dynamo_python`,
``.venv-dynamo/bin/python`` at the repository root unless ``DYNAMO_PYTHON``
names another (``make test`` creates it). Note: the indexer listens on 0.0.0.0 and has
no option to change it.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Optional

import requests

from harness.dynamo_env import require_dynamo
from sglang_kvbm.ops.demo.server import free_port, stop_group


class DynamoIndexer:
    def __init__(self, *, log_path: Optional[Path] = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._proc: Optional[subprocess.Popen] = None
        self._log = None

    def start(self, timeout: float = 120.0) -> "DynamoIndexer":
        python = require_dynamo()
        self._log = open(self.log_path, "wb") if self.log_path else subprocess.DEVNULL
        self._proc = subprocess.Popen(
            [str(python), "-m", "dynamo.indexer", "--port", str(self.port), "--threads", "1"],
            stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"dynamo.indexer exited with {self._proc.returncode}")
            try:
                requests.get(f"{self.url}/workers", timeout=1).raise_for_status()
                return self
            except requests.RequestException:
                time.sleep(0.2)
        self.stop()
        raise TimeoutError("dynamo.indexer did not start")

    def register(self, instance_id: int, endpoint: str, replay_endpoint: str, block_size: int) -> None:
        body = {
            "instance_id": instance_id,
            "endpoint": endpoint,
            "replay_endpoint": replay_endpoint,
            "model_name": "default",
            "block_size": block_size,
        }
        requests.post(f"{self.url}/register", json=body, timeout=10).raise_for_status()

    def query(self, token_ids, cache_salt: Optional[str] = None) -> dict:
        body = {"token_ids": list(token_ids), "model_name": "default"}
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        response = requests.post(f"{self.url}/query", json=body, timeout=10)
        response.raise_for_status()
        return response.json().get("instances", {})

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            stop_group(proc, grace=10.0)
        if self._log not in (None, subprocess.DEVNULL):
            self._log.close()
        self._log = None

    def __enter__(self) -> "DynamoIndexer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
