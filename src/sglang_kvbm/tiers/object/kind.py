"""The ``object`` tier's entry in ``tiers.registry``: KVBM's G4, configured by KVBM's own variables.

``DYN_KVBM_OBJECT_ENABLED=1`` turns it on; ``DYN_KVBM_OBJECT_BUCKET`` names the
bucket (``{worker_id}`` becomes this rank's number:
``(dp_rank * pp_size + pp_rank) * tp_size + tp_rank``); ``_ENDPOINT``,
``_REGION``, ``_ACCESS_KEY``, ``_SECRET_KEY`` reach it (without keys, the AWS
SDK's own credential chain); ``_WRITE_THROUGH`` and ``_NUM_BLOCKS`` as in
KVBM. Objects are named by the rank's identity (model by content, weights,
KV layout and dtype, ranks), so servers of one identity share a bucket and
no other server reads from it.
"""

from __future__ import annotations

import logging
import socket
import urllib.parse
from typing import Mapping

from sglang_kvbm.base.needs import pip_install
from sglang_kvbm.tiers.registry import KindPlan, TierKind, WorkerPools

logger = logging.getLogger(__name__)
NAME = "object"


def enabled(config) -> bool:
    return config.object_enabled


def worker_id(ranks: Mapping[str, int]) -> int:
    get = lambda name, default=0: int(ranks.get(name, default))  # noqa: E731
    return (get("dp_rank") * get("pp_size", 1) + get("pp_rank")) * get("tp_size", 1) + get("tp_rank")


def build(config, pools: WorkerPools) -> KindPlan:
    from sglang_kvbm.tiers.object.store import ObjectSettings, ObjectStore
    from sglang_kvbm.tiers.object.tier import ObjectTier
    from sglang_kvbm.tiers.staging import JOB_BYTES

    none = [None] * len(pools.names)
    if len(pools.names) > 1:
        logger.warning("kvbm: the object tier (DYN_KVBM_OBJECT_ENABLED) holds full-attention KV only; this model's "
                       "sliding-window/Mamba state is not stored there yet, so it is off for this model")
        return KindPlan(none, summary="off for this model (hybrid pools)")
    layout = pools.kv
    fingerprint, _ = pools.fingerprint("kv", {})
    bucket = config.object_bucket.replace("{worker_id}", str(worker_id(pools.ranks)))
    settings = ObjectSettings(bucket, config.object_endpoint, config.object_region, config.object_access_key,
                              config.object_secret_key)
    store = ObjectStore(settings, fingerprint=fingerprint, page_size=layout.page_size,
                        block_bytes=layout.block_bytes, batch_blocks=max(1, JOB_BYTES // layout.block_bytes))

    def make(manager) -> ObjectTier:
        return ObjectTier(store, manager.host, manager.generation, observe=manager.observe,
                          write_through=config.object_write_through,
                          num_blocks=config.object_num_blocks)

    summary = (f"bucket {bucket} at {config.object_endpoint or 'AWS'}, objects {store.tag}/<page hash>, "
               f"write-through {'on' if config.object_write_through else 'off (blocks leave host once written)'}")
    return KindPlan([make] + none[1:], summary=summary)


METRIC_DOCS = {  # KVBM's names for its G4, which is this tier
    "kvbm_offload_blocks_h2obj": "Offload blocks from host to object storage",
    "kvbm_onboard_blocks_obj2h": "Onboard blocks from object storage to host",
    "kvbm_g4_lookup_hits": "Blocks found in object storage (G4) by lookups",
    "kvbm_g4_lookup_misses": "Blocks looked up in object storage (G4) and not found",
}


def metrics(snapshot: dict) -> dict:
    """KVBM's G4 counters from a published snapshot (zeros while the tier is off)."""
    connector, own = snapshot.get("connector", {}), snapshot.get(NAME, {})
    return {"kvbm_offload_blocks_h2obj": connector.get("offload_blocks", {}).get(f"host->{NAME}", 0),
            "kvbm_onboard_blocks_obj2h": connector.get("onboard_blocks", {}).get(NAME, 0),
            "kvbm_g4_lookup_hits": own.get("lookup_hits", 0), "kvbm_g4_lookup_misses": own.get("lookup_misses", 0)}


def doctor_rows(config, environ: Mapping[str, str]) -> list[tuple]:
    """NIXL's OBJ backend loads, and the endpoint accepts a connection."""
    rows = []
    try:
        from nixl._api import nixl_agent, nixl_agent_config

        plugins = nixl_agent("sglang-kvbm-doctor-object", nixl_agent_config(backends=[])).get_plugin_list()
        rows.append(("object backend", "ok" if "OBJ" in plugins else "FAIL",
                     "NIXL's OBJ plugin loads" if "OBJ" in plugins else f"NIXL has no OBJ plugin (has {plugins})"))
    except ImportError as exc:
        rows.append(("object backend", "FAIL", f"NIXL is not installed ({exc}): {pip_install('disk')}"))
    endpoint = config.object_endpoint
    if endpoint:
        parsed = urllib.parse.urlsplit(endpoint)
        port = parsed.port or (443 if parsed.scheme == "https" else 80)
        try:
            socket.create_connection((parsed.hostname, port), timeout=2).close()
            rows.append(("object endpoint", "ok", f"{endpoint} accepts connections (bucket {config.object_bucket})"))
        except OSError as exc:
            rows.append(("object endpoint", "warn", f"{endpoint} did not accept a connection ({exc}): the server "
                         "starts, and the object tier misses until it does (DYN_KVBM_OBJECT_ENDPOINT)"))
    return rows


KIND = TierKind(NAME, enabled, build, doctor_rows=doctor_rows, metric_docs=METRIC_DOCS, metrics=metrics)
