"""What Dynamo's KV router believes each worker holds, per tier: a helper process in Dynamo's environment.

Runs with Dynamo's interpreter (``python -m sglang_kvbm.integration.dynamo.router_view`` in the
environment where ``ai-dynamo`` is installed), never imported by the library. Dynamo's frontend has no HTTP
route for its router's index, so this process builds a second ``dynamo.llm.KvRouter`` on the
workers' endpoint (``dynamo.backend.generate`` by default): it discovers the same workers,
bootstraps from their local indexers and then applies the same KV event stream the
frontend's router applies, and answers ``KvRouter.get_overlap_scores`` for a prompt. The
discovery backend and the planes come from the environment, as for every Dynamo process
(``DYN_DISCOVERY_BACKEND``, ``DYN_FILE_KV``, ``DYN_REQUEST_PLANE``, ``DYN_EVENT_PLANE``).

Protocol: one JSON object per line on stdin, one answer per line on stdout.

* ``{"token_ids": [...]}`` -> ``{"block_size": 4, "workers": {"<worker id>": {"device": t, "host": t,
  "disk": t}}}``, matched **tokens**, cumulative as the worker's ``POST /tiers`` answers them
  (``host`` counts device + host, ``disk`` all three); every worker the router knows is listed, all zero
  where nothing matched (as Dynamo 1.6.1's ``get_overlap_scores`` reports them).
* ``{"best_worker": true, "token_ids": [...]}`` -> ``{"worker_id": id, "overlap_blocks": n}``: the
  worker this router would pick (``KvRouter.best_worker``, query only: no state changes), with
  Dynamo's default ``KvRouterConfig`` (host hits credited 0.75 per block, disk hits 0.25); add
  ``"device_only": true`` for the pick of a router that credits device hits only (host and disk
  weights 0): what a router without lower-tier events would do.
* ``{"dump": true}`` -> ``{"events": n}``: how many events the router's indexer holds.

The first line written is ``{"ready": true}``, once the router has had ``--settle`` seconds to
bootstrap. Logs go to stderr. The tests' ``harness.router_view.RouterView`` starts this process and
asks it from their own environment.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys

from sglang_kvbm.core.tiers import DEVICE, DISK, HOST

NAMESPACE_ENDPOINT = "dynamo.backend.generate"  # where dynamo.sglang serves (namespace.component.endpoint)
# Each tier (as ``/tiers`` names it) -> the field of ``get_overlap_scores``' rows that counts its blocks
OVERLAP_FIELDS = {DEVICE.name: "device_blocks", HOST.name: "host_pinned_blocks", DISK.name: "disk_blocks"}


def tiers_of(scores: dict) -> dict:
    """``get_overlap_scores``' rows (blocks, per worker and dp rank) as cumulative tokens per worker."""
    block = int(scores["block_size"])
    workers: dict[str, dict[str, int]] = {}
    for row in scores.get("workers", []):
        mine = workers.setdefault(str(row["worker_id"]), dict.fromkeys(OVERLAP_FIELDS, 0))
        for tier, field in OVERLAP_FIELDS.items():
            mine[tier] += block * int(row.get(field) or 0)
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--endpoint", default=NAMESPACE_ENDPOINT, help="the workers' endpoint")
    parser.add_argument("--block-size", type=int, required=True, help="the workers' --page-size")
    parser.add_argument("--settle", type=float, default=3.0, help="seconds to let the router bootstrap")
    asyncio.run(serve(parser.parse_args(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
