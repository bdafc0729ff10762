"""One worker's block managers from its pools and the configuration, whatever the engine.

The engine's integration describes the worker's pools (:class:`~sglang_kvbm.tiers.registry.WorkerPools`: their
layouts, each pool's share of a block, how to fingerprint what a pool's bytes depend on) and the size of its device
pool; this sizes the host tier and the read staging from the configuration, has every tier kind the configuration
turns on build its tiers (``tiers.registry``), and makes one :class:`LocalBlockManager` per pool over them.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Optional

from sglang_kvbm.base.values import GIB
from sglang_kvbm.core.onboard_policy import OnboardPolicy
from sglang_kvbm.manager.block_manager import LocalBlockManager
from sglang_kvbm.tiers import registry
from sglang_kvbm.tiers.registry import WorkerPools, pool_blocks

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class WorkerManagers:
    managers: list[LocalBlockManager]  # per pool, in ``WorkerPools.names`` order (the KV's first)
    policy: Optional[OnboardPolicy]  # the onboard policy a tier brought (the disk's read meter), or None
    summary: list[str]  # each tier kind's part of the start-up log line
    names: dict[str, Any]  # tier kind -> what routers derive its object names from (``KindPlan.names``)
    row_bytes: int  # one KV block with its share of the other pools' blocks
    host_blocks: int  # the host tier's KV blocks


def build_managers(config, worker: WorkerPools, device_pages: int, *, observer=None,
                   executor=None) -> WorkerManagers:
    """``config``: the worker's ``KvbmConfig``; ``device_pages``: its device KV pool's pages (the host tier warns
    below it, the read staging stays within it); ``observer`` and ``executor`` (tests) go to the KV pool's manager."""
    row_bytes = round(sum(each.block_bytes * share for each, share in zip(worker.layouts, worker.shares)))
    host_blocks = config.host_blocks(row_bytes)
    staging_blocks = config.read_staging_blocks(row_bytes, device_pages)
    if config.has_host and host_blocks < device_pages:
        logger.warning(
            "kvbm: the host tier (%d blocks) is smaller than the device KV pool (%d pages): "
            "it can only hold what the device already holds, so it will churn without hits. "
            "Raise DYN_KVBM_CPU_CACHE_GB to at least %.3g.",
            host_blocks, device_pages, device_pages * row_bytes / GIB,
        )
    built = registry.build(config, worker)
    managers = []
    for name, pool_layout, share, tiers in zip(worker.names, worker.layouts, worker.shares, built.per_pool):
        kv = name == "kv"  # the tests' gated threads and the metrics observe the KV pool's copies
        managers.append(LocalBlockManager(
            pool_layout, pool_blocks(host_blocks, share), pin=worker.kv.is_cuda, tiers=tiers,
            staging_blocks=pool_blocks(staging_blocks, share),
            policy=built.policy, observer=observer if kv else None, executor=executor if kv else None,
            wait_floor=None if config.load_wait_ms is None else config.load_wait_ms / 1000,
            keep_reads=config.keep_reads,
        ))
    return WorkerManagers(managers, built.policy, built.summary, built.names, row_bytes, host_blocks)
