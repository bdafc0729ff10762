"""What Dynamo's KV router believes each worker holds, per tier: a helper process in Dynamo's environment.

Runs with Dynamo's interpreter (``.venv-dynamo/bin/python -m sglang_kvbm.testing.dynamo_router_view``),
never imported by the library or the tests' own environment. Dynamo's frontend has no HTTP
route for its router's index, so this process builds a second ``dynamo.llm.KvRouter`` on the
workers' endpoint (``dynamo.backend.generate`` by default): it discovers the same workers,
bootstraps from their local indexers and then applies the same KV event stream the
frontend's router applies, and answers ``KvRouter.get_overlap_scores`` for a prompt. The
discovery backend and the planes come from the environment, as for every Dynamo process
(``DYN_DISCOVERY_BACKEND``, ``DYN_FILE_KV``, ``DYN_REQUEST_PLANE``, ``DYN_EVENT_PLANE``).

Protocol: one JSON object per line on stdin, one answer per line on stdout.

* ``{"token_ids": [...]}`` -> ``{"block_size": 4, "workers": {"<worker id>": {"device": t, "host": t,
  "disk": t}}}``, matched **tokens**, cumulative as the worker's ``POST /tiers`` answers them
  (``host`` counts device + host, ``disk`` all three); workers with no match are left out.
* ``{"best_worker": true, "token_ids": [...]}`` -> ``{"worker_id": id, "overlap_blocks": n}``: the
  worker this router would pick (``KvRouter.best_worker``, query only: no state changes), with
  Dynamo's default ``KvRouterConfig`` (host hits credited 0.75 per block, disk hits 0.25); add
  ``"device_only": true`` for the pick of a router that credits device hits only (host and disk
  weights 0): what a router without lower-tier events would do.
* ``{"dump": true}`` -> ``{"events": n}``: how many events the router's indexer holds.

The first line written is ``{"ready": true}``, once the router has had ``--settle`` seconds to
bootstrap. Logs go to stderr. :class:`RouterView` starts this process and asks it, from the
tests' or a benchmark's own environment.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import select
import subprocess
import sys
from pathlib import Path
from typing import Optional, Sequence

from sglang_kvbm.testing.dynamo_env import (
    NAMESPACE_ENDPOINT,
    DynamoError,
    dynamo_env,
    dynamo_python,
    require_dynamo,
)
from sglang_kvbm.testing.server import stop_group


def tiers_of(scores: dict) -> dict:
    """``get_overlap_scores``' rows (blocks, per worker and dp rank) as cumulative tokens per worker."""
    block = int(scores["block_size"])
    workers: dict[str, dict[str, int]] = {}
    for row in scores.get("workers", []):
        mine = workers.setdefault(str(row["worker_id"]), {"device": 0, "host": 0, "disk": 0})
        mine["device"] += block * int(row.get("device_blocks") or 0)
        mine["host"] += block * int(row.get("host_pinned_blocks") or 0)
        mine["disk"] += block * int(row.get("disk_blocks") or 0)
    return {"block_size": block, "workers": workers}


async def serve(args) -> None:
    from dynamo.llm import KvRouter, KvRouterConfig
    from dynamo.runtime import DistributedRuntime

    loop = asyncio.get_running_loop()
    runtime = DistributedRuntime(
        loop,
        os.environ.get("DYN_DISCOVERY_BACKEND", "file"),
        os.environ.get("DYN_REQUEST_PLANE", "tcp"),
        event_plane=os.environ.get("DYN_EVENT_PLANE", "zmq"),
    )
    endpoint = runtime.endpoint(args.endpoint)
    router = KvRouter(endpoint, args.block_size, KvRouterConfig())
    device_only = KvRouter(endpoint, args.block_size, KvRouterConfig(host_cache_hit_weight=0.0,
                                                                     disk_cache_hit_weight=0.0))
    await asyncio.sleep(args.settle)
    print(json.dumps({"ready": True}), flush=True)
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while True:
        line = await reader.readline()
        if not line:
            break
        try:
            request = json.loads(line)
            if request.get("best_worker"):
                chosen = device_only if request.get("device_only") else router
                worker, _, overlap = await chosen.best_worker([int(t) for t in request["token_ids"]])
                answer = {"worker_id": str(worker), "overlap_blocks": overlap}
            elif request.get("dump"):
                answer = {"events": len(json.loads(await router.dump_events()))}
            else:
                answer = tiers_of(await router.get_overlap_scores([int(t) for t in request["token_ids"]]))
        except Exception as exc:  # answer, do not die: the caller reads one line per request
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(answer), flush=True)
    runtime.shutdown()


class RouterView:
    """Dynamo's KV router's per-tier view of every worker: this module as a helper process, asked line by line."""

    def __init__(self, discovery_dir: str | Path, block_size: int, *, endpoint: str = NAMESPACE_ENDPOINT,
                 log_path: Optional[str | Path] = None, settle: float = 3.0) -> None:
        self.args = [str(dynamo_python()), "-m", "sglang_kvbm.testing.dynamo_router_view",
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
        """``{worker id: {"device", "host", "disk"}}`` in tokens, cumulative; workers with no match are absent
        or all zero."""
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--endpoint", default=NAMESPACE_ENDPOINT, help="the workers' endpoint")
    parser.add_argument("--block-size", type=int, required=True, help="the workers' --page-size")
    parser.add_argument("--settle", type=float, default=3.0, help="seconds to let the router bootstrap")
    asyncio.run(serve(parser.parse_args(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
