"""Dynamo's own processes on one machine, for tests and benchmarks: frontend and SGLang workers.

Each is started from Dynamo's environment as :mod:`harness.dynamo_env` describes
(file discovery, TCP requests, ZMQ events, all on 127.0.0.1, one process group each).
``examples/dynamo/`` runs the same deployment by hand.

* :class:`DynamoFrontend`: ``python -m dynamo.frontend --router-mode kv`` (OpenAI API + KV router).
* :class:`DynamoWorker`: ``python -m dynamo.sglang`` on CPU with KV events, with this library
  (``--radix-cache-backend kvbm``, its ``/tiers`` and ``/stats`` endpoint on) or stock.

What Dynamo's KV router holds per worker and tier: :class:`harness.router_view.RouterView`.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import requests

from harness.dynamo_env import (
    DynamoError,
    _Process,
    dynamo_env,
    dynamo_python,
    system_port,
)
from sglang_kvbm.ops.demo.server import CPU_ARGS, free_port, stream_chunks

__all__ = ["Completion", "DynamoError", "DynamoFrontend", "DynamoWorker", "dynamo_python"]


@dataclasses.dataclass
class Completion:
    """One ``/v1/completions`` answer, with what Dynamo adds (``nvext``)."""

    worker_id: int  # the instance the router picked (nvext.worker_id.decode_worker_id)
    tokens: list  # generated tokens as text (the test tokenizer: one word per token)
    logprobs: list
    prompt_tokens: int
    cached_tokens: int  # usage.prompt_tokens_details.cached_tokens: SGLang's cached_tokens, every tier together
    ttft_s: Optional[float]  # measured by the client when streamed, else Dynamo's nvext.timing.ttft_ms
    raw: dict


class DynamoFrontend(_Process):
    """``python -m dynamo.frontend --router-mode kv`` on 127.0.0.1: the OpenAI API and Dynamo's KV router."""

    name = "dynamo.frontend"

    def __init__(
        self,
        discovery_dir: str | Path,
        *,
        port: Optional[int] = None,
        extra_args: Sequence[str] = (),
        env: Optional[Mapping[str, str]] = None,
        log_path: Optional[str | Path] = None,
        on_host=None,
    ) -> None:
        """``on_host``: a :class:`harness.fleet.Host` (its address, namespace), else 127.0.0.1 on this machine."""
        host = on_host.address if on_host is not None else "127.0.0.1"
        self.port = port or free_port()
        self.url = f"http://{host}:{self.port}"
        args = [
            dynamo_python(), "-m", "dynamo.frontend",
            "--router-mode", "kv",
            "--http-host", host, "--http-port", str(self.port),
            *extra_args,
        ]
        super().__init__(args, {**dynamo_env(discovery_dir, host), **(env or {})}, log_path, on_host)

    def instances(self) -> set[int]:
        """Instance ids serving the workers' ``generate`` endpoint, as the frontend discovered them."""
        health = requests.get(f"{self.url}/health", timeout=5).json()
        return {int(i["instance_id"]) for i in health.get("instances", []) if i.get("endpoint") == "generate"}

    def wait_ready(self, model: str, worker_ids: Sequence[int] = (), timeout: float = 600.0) -> "DynamoFrontend":
        """Until the frontend serves ``model`` and has discovered every one of ``worker_ids``."""

        def ready() -> bool:
            models = requests.get(f"{self.url}/v1/models", timeout=5).json().get("data", [])
            return any(m.get("id") == model for m in models) and set(worker_ids) <= self.instances()

        self._wait(ready, timeout, f"model {model} with workers {list(worker_ids)}")
        return self

    def body(self, model: str, prompt: Sequence[int], max_tokens: int, worker: Optional[int]) -> dict:
        nvext: dict[str, Any] = {"extra_fields": ["worker_id", "timing"]}
        if worker is not None:
            nvext["backend_instance_id"] = int(worker)  # direct routing: this worker, not the router's pick
        return {
            "model": model,
            "prompt": [int(t) for t in prompt],  # token ids: the frontend does not tokenize them again
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "logprobs": 1,
            "ignore_eos": True,
            "nvext": nvext,
        }

    def complete(self, model: str, prompt: Sequence[int], max_tokens: int = 8, *, worker: Optional[int] = None,
                 timeout: float = 600.0) -> Completion:
        response = requests.post(f"{self.url}/v1/completions", json=self.body(model, prompt, max_tokens, worker),
                                 timeout=timeout)
        if response.status_code != 200:
            raise DynamoError(f"/v1/completions answered {response.status_code}: {response.text[:500]}")
        data = response.json()
        timing = (data.get("nvext") or {}).get("timing") or {}
        ttft = timing.get("ttft_ms")
        return _completion(data, data["choices"][0], ttft / 1e3 if ttft is not None else None)

    def stream(self, model: str, prompt: Sequence[int], max_tokens: int = 8, *, worker: Optional[int] = None,
               timeout: float = 600.0) -> Completion:
        """Streamed: ``ttft_s`` is the client's time to the first token chunk."""
        body = {**self.body(model, prompt, max_tokens, worker), "stream": True,
                "stream_options": {"include_usage": True}}
        started = time.perf_counter()
        ttft: Optional[float] = None
        tokens, logprobs, last, nvext, usage = [], [], {}, {}, {}
        with requests.post(f"{self.url}/v1/completions", json=body, stream=True, timeout=timeout) as response:
            if response.status_code != 200:
                raise DynamoError(f"/v1/completions answered {response.status_code}: {response.text[:500]}")
            for chunk in stream_chunks(response):
                last = chunk
                nvext.update(chunk.get("nvext") or {})
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices") or []:
                    if ttft is None and choice.get("text"):
                        ttft = time.perf_counter() - started
                    lp = choice.get("logprobs") or {}
                    tokens += lp.get("tokens") or []
                    logprobs += lp.get("token_logprobs") or []
        merged = {**last, "usage": usage, "nvext": nvext}
        choice = {"logprobs": {"tokens": tokens, "token_logprobs": logprobs}}
        return _completion(merged, choice, ttft if ttft is not None else time.perf_counter() - started)


def _completion(data: dict, choice: dict, ttft: Optional[float]) -> Completion:
    usage = data.get("usage") or {}
    worker = ((data.get("nvext") or {}).get("worker_id") or {}).get("decode_worker_id")
    lp = choice.get("logprobs") or {}
    return Completion(
        worker_id=int(worker) if worker is not None else -1,
        tokens=list(lp.get("tokens") or []),
        logprobs=list(lp.get("token_logprobs") or []),
        prompt_tokens=int(usage.get("prompt_tokens") or 0),
        cached_tokens=int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0),
        ttft_s=ttft,
        raw=data,
    )


_WORKER_ID_LABEL = re.compile(r'worker_id="([0-9a-f]+)"')


class DynamoWorker(_Process):
    """``python -m dynamo.sglang`` on CPU, publishing KV events to Dynamo's router.

    ``kvbm=True`` runs this library (``--radix-cache-backend kvbm``; ``kvbm_env`` sets its tiers,
    and its ``/tiers``, ``/stats`` endpoint is on); ``kvbm=False`` is stock SGLang. The events
    endpoint binds the wildcard host (``tcp://*:P``): Dynamo's worker subscribes to SGLang's
    publisher at 127.0.0.1 only then (``dynamo/sglang/publisher.py``, ``kv_event_connect_ip``).
    """

    name = "dynamo.sglang"

    def __init__(
        self,
        discovery_dir: str | Path,
        model_dir: str | Path,
        *,
        served_model_name: str,
        page_size: int = 4,
        max_total_tokens: int = 1024,
        kvbm: bool = True,
        kvbm_env: Optional[Mapping[str, str]] = None,
        extra_args: Sequence[str] = (),
        env: Optional[Mapping[str, str]] = None,
        log_path: Optional[str | Path] = None,
        label: str = "",
        on_host=None,
    ) -> None:
        self.name = f"dynamo.sglang {label}".strip()
        self.host = host = on_host.address if on_host is not None else "127.0.0.1"
        self.kvbm = kvbm
        self.page_size = page_size
        self.system_port = system_port()  # Dynamo's status server: /health, /metrics
        self.kvbm_port = free_port()  # this library's endpoint: /tiers, /stats, /metrics
        self.events_port = free_port()
        self.instance_id: Optional[int] = None
        events = {"publisher": "zmq", "topic": "kv-events", "endpoint": f"tcp://*:{self.events_port}"}
        args = [
            dynamo_python(), "-m", "dynamo.sglang",
            "--model-path", str(model_dir),
            "--served-model-name", served_model_name,
            *CPU_ARGS,
            "--port", str(free_port()),
            "--page-size", str(page_size),
            "--max-total-tokens", str(max_total_tokens),
            "--kv-events-config", json.dumps(events),
            *(["--radix-cache-backend", "kvbm"] if kvbm else []),
            *extra_args,
        ]
        worker_env = {**dynamo_env(discovery_dir, host), "DYN_SYSTEM_PORT": str(self.system_port), **(env or {})}
        if kvbm:
            worker_env.update({
                "DYN_KVBM_METRICS": "true",
                "DYN_KVBM_METRICS_PORT": str(self.kvbm_port),
                "SGLANG_KVBM_HTTP_HOST": host,
                "SGLANG_KVBM_ROUTER_BLOCK_SIZE": str(page_size),
                **(kvbm_env or {}),
            })
        super().__init__(args, worker_env, log_path, on_host)

    def wait_ready(self, timeout: float = 600.0) -> "DynamoWorker":
        """Until Dynamo's status server says every endpoint is ready; then reads the worker's instance id."""
        base = f"http://{self.host}:{self.system_port}"

        def ready() -> bool:
            if requests.get(f"{base}/health", timeout=5).json().get("status") != "ready":
                return False
            found = _WORKER_ID_LABEL.search(requests.get(f"{base}/metrics", timeout=5).text)
            if found:
                self.instance_id = int(found.group(1), 16)
            return found is not None

        self._wait(ready, timeout, "ready status")
        return self

    def tiers(self, token_ids: Sequence[int]) -> dict:
        """This library's own answer: tokens each tier would serve now, cumulative (``POST /tiers``)."""
        response = requests.post(f"http://{self.host}:{self.kvbm_port}/tiers", json={"token_ids": list(token_ids)},
                                 timeout=30)
        response.raise_for_status()
        return response.json()

    def stats(self) -> dict:
        return requests.get(f"http://{self.host}:{self.kvbm_port}/stats", timeout=30).json()
