"""Inside ``python -m dynamo.sglang``: register the worker's G4 objects with Dynamo's router, as HiCache's are.

Dynamo 1.6.1's router scores Mooncake hits (``--shared-cache-type hicache``)
only for workers whose registration carries ``sglang_hicache_mooncake``
(``dynamo/sglang/register.py``), and ``dynamo.sglang`` publishes it only when
SGLang's HiCache writes to Mooncake (``--hicache-storage-backend mooncake``),
which this library replaces. :func:`install` wraps Dynamo's
``get_runtime_config`` so that a worker running this library with G4 on
publishes the same dict, built from the scheduler's L3 layout
(:mod:`sglang_kvbm.integration.sglang.l3_layout`): the tag (the server's
identity), the key prefix (tag + served model name), page size, TP/PP, MLA,
EAGLE, and ``DYN_MOONCAKE_KV_EVENTS_ENDPOINT``, where the router subscribes to
the master's events (``sglang-kvbm mooncake-events``). Nothing changes when
the worker is stock, or when Dynamo's own code already published the dict.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import sys
from typing import Any, Optional

from sglang_kvbm.integration.sglang.l3_layout import TAG_KEY

logger = logging.getLogger(__name__)

RUNTIME_KEY = "sglang_hicache_mooncake"  # Dynamo's SGLANG_HICACHE_MOONCAKE_RUNTIME_KEY
EVENTS_ENV = "DYN_MOONCAKE_KV_EVENTS_ENDPOINT"


def registration(layout: Optional[dict], server_args: Any, *, eagle: bool) -> Optional[dict]:
    """Dynamo 1.6.1's ``SglangHicacheMooncakeConfig`` for a scheduler's L3 layout written by this library."""
    if not layout or not layout.get("enabled") or TAG_KEY not in layout:
        return None
    inner = layout["hicache_object_layout"]
    return {
        "backend": "mooncake",
        "page_size": int(layout["page_size"]),
        "tp_size": int(getattr(server_args, "tp_size", 1) or 1),
        "pp_size": int(getattr(server_args, "pp_size", 1) or 1),
        "is_mla_model": bool(inner["is_mla_backend"]),
        "is_eagle": eagle,
        "tp_lcm_size": None,
        "should_split_heads": False,
        "extra_backend_tag": layout[TAG_KEY],
        "key_prefix": inner["key_prefix"],
        "kv_events_endpoint": os.environ.get(EVENTS_ENV) or None,
    }


def install() -> bool:
    """Wrap ``dynamo.sglang.register.get_runtime_config`` in this process (idempotent); False outside Dynamo."""
    register = sys.modules.get("dynamo.sglang.register")
    if register is None:
        return False
    original = register.get_runtime_config
    if getattr(original, "_kvbm", False):
        return True

    @functools.wraps(original)
    async def get_runtime_config(engine, server_args, dynamo_args):
        config = await original(engine, server_args, dynamo_args)
        if config is None or engine is None or config.get_engine_specific(RUNTIME_KEY) is not None:
            return config
        infos = engine._scheduler_init_result.scheduler_infos
        eagle = register._eagle_enabled_for(getattr(server_args, "speculative_algorithm", None))
        data = registration(infos[0].get("hicache_object_layout") if infos else None, server_args, eagle=eagle)
        if data is not None:
            config.set_engine_specific(RUNTIME_KEY, json.dumps(data))
            logger.info("kvbm: registered G4 objects %s_<page hash>... with Dynamo's router (events from %s)",
                        data["key_prefix"], data["kv_events_endpoint"] or f"nowhere: set {EVENTS_ENV}")
        return config

    get_runtime_config._kvbm = True
    register.get_runtime_config = get_runtime_config
    return True
