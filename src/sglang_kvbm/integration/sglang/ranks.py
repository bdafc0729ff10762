"""What a linker needs to know about the worker it serves: its configuration, identity and ranks.

Ranks follow SGLang's own rules: every TP rank stores its own shard (and has a
disk directory of its own: the rank is part of the identity), SGLang
intersects hits across attention ranks, the scheduler of attention-TP rank 0
publishes its DP rank's events, and that scheduler serves the metrics
endpoint, on ``DYN_KVBM_METRICS_PORT + dp_rank``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any, Mapping

import torch
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

from sglang_kvbm.config import KvbmConfig
from sglang_kvbm.integration.sglang.build import Identity
from sglang_kvbm.integration.sglang.fingerprint import weight_settings
from sglang_kvbm.integration.sglang.kv_pool import UnsupportedPoolError

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class LinkerSetup:
    config: KvbmConfig
    identity: Identity
    tp_rank: int = 0
    tp_size: int = 1
    dp_rank: int = 0
    serves_endpoint: bool = True
    ranks_agreeing: int = 1  # attention ranks SGLang intersects lookups across


def check_components(components, params) -> None:
    """Refuse, with the reason, tree components this linker cannot store (the pools themselves: ``pool_group``)."""
    unsupported = {c for c in components if c not in (ComponentType.FULL, ComponentType.SWA, ComponentType.MAMBA)}
    if unsupported:
        names = ", ".join(sorted(c.name for c in unsupported))
        raise UnsupportedPoolError(
            f"sglang-kvbm stores full-attention, sliding-window and Mamba state; this model also keeps {names} "
            f"state, which SGLang's linker seam does not carry: run it without --radix-cache-backend kvbm"
        )


def _group_rank(group) -> tuple[int, int]:
    if group is not None and torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(group=group), torch.distributed.get_world_size(group=group)
    return 0, 1


def _dp_rank() -> int:
    try:
        from sglang.srt.runtime_context import get_parallel

        parallel = get_parallel()
        if parallel.attn_dp_size > 1:
            return int(parallel.attn_dp_rank or 0)
        return int(parallel.dp_rank or 0)
    except Exception:  # a custom server publishes no parallel context
        return 0


def setup_of(server_args: Any, params, extra_config: Mapping[str, Any]) -> LinkerSetup:
    config = extra_config.get("config")  # a KvbmConfig, from a custom server (build_cache)
    if config is None:
        raw = extra_config.get("kvbm_config")
        config = KvbmConfig.from_sources(json_text=raw if raw is None or isinstance(raw, str) else json.dumps(raw))
    tp_rank, tp_size = _group_rank(params.attn_tp_cache_group or params.tp_cache_group)
    dp_rank = _dp_rank()
    ranks = {"tp_rank": tp_rank, "tp_size": tp_size, "pp_rank": params.pp_rank, "pp_size": params.pp_size,
             "attn_cp_rank": params.attn_cp_rank, "dp_rank": dp_rank}
    settings = {}
    model_path, revision, download_dir, served = "", None, None, ""
    if server_args is not None:
        model_path = str(getattr(server_args, "model_path", "") or "")
        served = str(getattr(server_args, "served_model_name", "") or "")
        revision = getattr(server_args, "revision", None)
        download_dir = getattr(server_args, "download_dir", None)
        settings = {"quantization": getattr(server_args, "quantization", None),
                    "kv_cache_dtype": str(getattr(server_args, "kv_cache_dtype", None)),
                    **weight_settings(getattr(server_args, "load_format", None),
                                      getattr(server_args, "json_model_override_args", None))}
    identity = extra_config.get("identity") or Identity(model_path, revision, settings, ranks, download_dir, served)
    serves = tp_rank == 0 and params.pp_rank == 0 and params.attn_cp_rank == 0
    agreeing = _group_rank(params.attn_tp_cache_group)[1] * _group_rank(params.attn_cp_cache_group)[1]
    agreeing = agreeing if agreeing > 1 else _group_rank(params.tp_cache_group)[1]
    return LinkerSetup(config, identity, tp_rank, tp_size, dp_rank, serves, agreeing)
