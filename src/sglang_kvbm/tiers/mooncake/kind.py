"""The ``mooncake`` tier's entry in ``tiers.registry``: a client of the worker's shared Mooncake Store.

One client per worker rank, for the full-attention KV only (a hybrid model's
sliding-window pages and Mamba states are not shared yet). Its objects are
named by the worker's identity with every rank alike (the rank is in each
name's suffix), so routers derive one name per page for the whole worker:
the plan hands its store on as :attr:`KindPlan.names`, and the integration
tells SGLang's scheduler (``integration.sglang.l3_layout``) and, inside
Dynamo's workers, Dynamo's router (``integration.dynamo.mooncake``).
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
from typing import Mapping, Optional

from sglang_kvbm.base.needs import pip_install, require
from sglang_kvbm.base.values import GIB, ConfigError
from sglang_kvbm.core.offload_filter import FrequencyFilter
from sglang_kvbm.tiers.registry import KindPlan, TierKind, WorkerPools

logger = logging.getLogger(__name__)
NAME = "mooncake"


def enabled(config) -> bool:
    return config.has_mooncake


def build(config, pools: WorkerPools) -> KindPlan:
    from sglang_kvbm.tiers.mooncake.address import advertised
    from sglang_kvbm.tiers.mooncake.store import MooncakeSettings, MooncakeStore, object_suffix
    from sglang_kvbm.tiers.mooncake.tier import MooncakeTier

    if importlib.util.find_spec("mooncake") is None:
        raise ConfigError("SGLANG_KVBM_MOONCAKE_MASTER is set but Mooncake's client is not installed in this "
                          f"environment: {pip_install('mooncake')} (or [mooncake-cuda]), or unset it")
    none = [None] * len(pools.names)
    if len(pools.names) > 1:
        logger.warning("kvbm: the mooncake tier (SGLANG_KVBM_MOONCAKE_MASTER) holds full-attention KV only; this "
                       "model's sliding-window/Mamba state is not shared yet, so it is off for this model")
        return KindPlan(none, summary="off for this model (hybrid pools)")
    ranks, layout = pools.ranks, pools.kv
    # One tag for every rank and pipeline stage of the worker (the router is told one): the tp and pp ranks are in
    # each name's suffix instead.
    fingerprint, _ = pools.fingerprint("kv", {"tp_rank": 0, "pp_rank": 0, "dp_rank": 0, "attn_cp_rank": 0})
    hostname = advertised(config.mooncake_master, os.environ).host  # what peers reach this client's memory at
    settings = MooncakeSettings(config.mooncake_master, config.mooncake_metadata, config.mooncake_protocol,
                                int(config.mooncake_segment_gb * GIB), hostname=hostname)
    # --served-model-name names the objects (as HiCache's L3 pages); without one, the tag alone: it names the model by
    # content, where a path or directory name would part two hosts holding the same model
    suffix = object_suffix(int(ranks.get("tp_rank", 0)), mla=pools.mla,
                           pp_rank=int(ranks.get("pp_rank", 0)), pp_size=int(ranks.get("pp_size", 1)))
    store = MooncakeStore(settings, fingerprint=fingerprint, model_name=pools.served_model_name, suffix=suffix,
                    page_size=layout.page_size, block_bytes=layout.block_bytes)

    def make(manager) -> MooncakeTier:
        return MooncakeTier(store, manager.host, manager.generation, observe=manager.observe,
                            offload_filter=FrequencyFilter() if config.mooncake_offload_filter else None)

    summary = f"master {config.mooncake_master}, objects {store.prefix}_<page hash>{store.suffix}, write-through"
    return KindPlan([make] + none[1:], summary=summary, names=store)  # routers derive the names from its tag, prefix


def doctor_rows(config, environ: Mapping[str, str]) -> list[tuple]:
    from sglang_kvbm.tiers.mooncake.doctor import g4_rows

    return g4_rows(config, environ)


def commands(subparsers) -> None:
    relay = subparsers.add_parser(
        "mooncake-events",
        help="publish a Mooncake master's objects as its KV events, for Dynamo's --shared-cache-type hicache",
        description="Poll a Mooncake master's object names and publish what appeared and what left as its KV "
                    "events (ZMQ), for Dynamo's router with --shared-cache-type hicache. Needs pyzmq: "
                    f"{pip_install('mooncake')}",
    )
    relay.add_argument("--master-http", required=True, metavar="HOST:PORT",
                       help="the master's HTTP port (mooncake_master --metrics_port, default 9003)")
    relay.add_argument("--bind", default="tcp://127.0.0.1:5557", metavar="ENDPOINT",
                       help="where routers subscribe: the workers' DYN_MOONCAKE_KV_EVENTS_ENDPOINT")
    relay.add_argument("--interval", type=float, default=1.0, metavar="SECONDS", help="how often the master is read")


def run(args: argparse.Namespace) -> Optional[int]:
    if args.command != "mooncake-events":
        return None
    require("mooncake-events", "mooncake", "zmq")
    from sglang_kvbm.tiers.mooncake.events import EventRelay

    url = args.master_http if "://" in args.master_http else f"http://{args.master_http}"
    relay = EventRelay(url, args.bind, interval=args.interval)
    try:
        relay.run()
    except KeyboardInterrupt:
        pass
    finally:
        relay.close()
    return 0


KIND = TierKind(NAME, enabled, build, doctor_rows=doctor_rows, commands=commands, run=run)
