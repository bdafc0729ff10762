"""What the tiers do when SGLang replaces the weights in memory or pauses the KV cache.

Both happen in SGLang's scheduler-side weight updater
(``managers/scheduler_components/weight_updater.py``,
``SchedulerWeightUpdaterManager``), on the scheduler thread: the scheduler's
request dispatcher calls its methods between steps. ``hooks`` installs these
functions on its methods through SGLang's ``HookRegistry``; each finds the
scheduler's :class:`~sglang_kvbm.integration.sglang.linker.KvbmLinker` through
``updater.scheduler.tree_cache.linker.cache_linker`` (a server with another
linker, or none, is left alone).

* **Weights replaced** (AFTER ``update_weights_from_disk``, ``_distributed``,
  ``_tensor``, ``_ipc``, whatever they answer, and after a successful
  ``end_weight_update``): every tier's blocks hold KV of the old weights, and the
  disk tier's identity names files the served weights no longer are. The
  flush that may follow is optional (``recv_req.flush_cache``), so the tiers are
  dropped here (``KvbmLinker.drop_tiers``: copies quiesced, every host, disk and
  staging block forgotten with its removal event; the device cache is SGLang's),
  and the first update moves the disk tier to a private identity
  (:func:`~sglang_kvbm.integration.sglang.fingerprint.rekeyed`, ``DiskStore.rekey``):
  no server started from the files, nor this one after a restart, reads what it
  writes from then on. Later updates only drop: that identity is already
  private to this run. A failed answer is no proof the weights are unchanged:
  SGLang answers failure after the weights changed when the flush is refused or
  a draft runner fails after the target, and a failed disk load rolls back from
  the new path; ``end_weight_update`` ends sessions whose weights were written
  by a peer (P2P/RDMA) with no ``update_*`` call at all.
* **KV cache paused** (BEFORE ``release_memory_occupation`` with the KV cache
  among its tags): with ``--enable-memory-saver`` SGLang pauses the KV pool's
  device memory before it flushes the cache, so a quiesce in ``reset()`` comes
  too late; the copies that read or write device KV are waited for first.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Optional

from sglang_kvbm.core.tiers import HOST

logger = logging.getLogger(__name__)

UPDATER = "sglang.srt.managers.scheduler_components.weight_updater.SchedulerWeightUpdaterManager"
WEIGHT_UPDATES = ("update_weights_from_disk", "update_weights_from_distributed",
                  "update_weights_from_tensor", "update_weights_from_ipc")
QUIESCE_WARN_S = 60.0  # how often a pause still waiting for copies says so

def linker_of(updater: Any) -> Optional[Any]:
    """The scheduler's KvbmLinker, or None (another linker, no linker, or an updater with no scheduler)."""
    tree = getattr(getattr(updater, "scheduler", None), "tree_cache", None)
    linker = getattr(getattr(tree, "linker", None), "cache_linker", None)
    return linker if callable(getattr(linker, "drop_tiers", None)) else None


def weights_replaced(linker: Any, how: str) -> None:
    """Drop every tier; move every tier below host off the files' identity (each says what that means for it)."""
    linker.drop_tiers()
    managers = [linker.manager, *linker.sidecars.managers.values()]  # hybrid models: every pool's tiers
    for manager in managers:
        for tier in manager.tiers.values():
            tier.rekey(how)
    names = ", ".join([HOST.name, *linker.manager.tiers])
    logger.warning("kvbm: weights replaced (%s): %s tiers dropped; those below host moved to an identity of this run "
                   "that no server started from the model files reads (a restart starts them cold)", how, names)


def _describe(method: str, recv_req: Any) -> str:
    path = getattr(recv_req, "model_path", None)
    return f"{method}({path})" if path else method


def after_weight_update(method: str, result: Any, updater: Any, recv_req: Any = None, *args, **kwargs) -> Any:
    """AFTER hook of ``update_weights_from_*``: whatever it answered, the weights may have changed."""
    linker = linker_of(updater)
    if linker is not None:
        weights_replaced(linker, _describe(method, recv_req))
    return result


def after_session_end(result: Any, updater: Any, *args, **kwargs) -> Any:
    """AFTER hook of ``end_weight_update``: a session can change weights with no ``update_*`` call (P2P/RDMA)."""
    linker = linker_of(updater)
    if linker is not None and getattr(result, "success", False):
        weights_replaced(linker, "end_weight_update")
    return result


def before_release_memory(updater: Any, recv_req: Any = None, *args, **kwargs) -> None:
    """BEFORE hook of ``release_memory_occupation``: no copy may touch device KV once it is paused."""
    from sglang.srt.constants import GPU_MEMORY_ALL_TYPES, GPU_MEMORY_TYPE_KV_CACHE

    tags = getattr(recv_req, "tags", None) or GPU_MEMORY_ALL_TYPES
    linker = linker_of(updater)
    if linker is None or GPU_MEMORY_TYPE_KV_CACHE not in tags:
        return None
    while not linker.quiesce(QUIESCE_WARN_S):  # pausing under a live copy would fault: wait, and say so
        logger.warning("kvbm: release_memory_occupation waits for copies still in flight on the KV cache")
    return None


def hooks() -> list[tuple[str, Any, str]]:
    """``(target, hook, "before" | "after")`` for ``hooks.install``."""
    out = [(f"{UPDATER}.{m}", functools.partial(after_weight_update, m), "after") for m in WEIGHT_UPDATES]
    out.append((f"{UPDATER}.end_weight_update", after_session_end, "after"))
    out.append((f"{UPDATER}.release_memory_occupation", before_release_memory, "before"))
    return out
