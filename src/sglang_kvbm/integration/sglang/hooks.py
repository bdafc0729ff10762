"""The places SGLang hands the linker what its contract does not: the tree, the model worker, the weight updater.

A linker is constructed before the tree cache adopts it, and it is never
given the cache, the model worker or word of a weight update. Hooks through SGLang's own
``HookRegistry`` close that gap, for a :class:`~sglang_kvbm.integration.sglang.linker.KvbmLinker`
only (any other linker passes through untouched):

* ``UnifiedCacheLinkerWrapper.__init__`` (the tree adopting a linker) ->
  ``linker.attach_kvbm(cache)``: the linker wraps *that cache instance's*
  ``insert`` (to know the key whose pages an offload stores),
  ``init_load_back`` (to set ``req.storage_hit_length`` for the part of a hit
  that came from disk, which SGLang reports as storage hits) and
  ``take_events`` (to put its tiers' events on the cache's one event stream).
  Not ``UnifiedRadixCache.init_cache_linker``: SGLang looks that bound method
  up before it builds the linker, so a hook installed by the linker's
  constructor would come too late for it;
* ``TpModelWorker.register_hicache_layer_transfer_counter`` ->
  ``counter.attach_kvbm_worker(worker)``: the disk onboarding policy times prefill
  on *that* worker instance;
* ``Scheduler.on_idle`` (before) -> ``linker.wait_while_idle()``: a
  scheduler with no batch to run whose waiting requests wait for reads below
  host (SGLang 0.5.21, ``lookup_pins``) waits for the first of those reads
  instead of spinning through rounds (SGLang's ``on_idle`` returns at once
  while requests wait), then looks them up again;
* ``SchedulerWeightUpdaterManager``'s ``update_weights_from_*``,
  ``end_weight_update`` (AFTER) and ``release_memory_occupation`` (BEFORE) ->
  ``weight_updates``: weights replaced in memory drop the tiers and move the
  disk identity; copies are quiesced before the KV cache is paused.

Installed when the linker module is imported (in the scheduler process, SGLang
imports it to build the linker), so before SGLang calls any of them;
installing twice is a no-op. The scheduler builds its tree (importing the
linker) before its weight updater and request dispatcher, so the dispatcher
binds the hooked methods.
"""

from __future__ import annotations

_installed = False

_CACHE_TARGET = "sglang.srt.mem_cache.unified_cache.unified_cache_linker.UnifiedCacheLinkerWrapper.__init__"
_WORKER_TARGET = "sglang.srt.managers.tp_worker.TpModelWorker.register_hicache_layer_transfer_counter"
_IDLE_TARGET = "sglang.srt.managers.scheduler.Scheduler.on_idle"


def _after_wrapper_init(result, wrapper, cache, cache_linker, *args, **kwargs):
    attach = getattr(cache_linker, "attach_kvbm", None)
    if attach is not None:
        attach(cache)
    return result


def _after_register_counter(result, worker, counter, *args, **kwargs):
    attach = getattr(counter, "attach_kvbm_worker", None)
    if attach is not None:
        attach(worker)
    return result


def _before_idle(scheduler, *args, **kwargs):
    wrapper = getattr(getattr(scheduler, "tree_cache", None), "linker", None)
    wait_while_idle = getattr(getattr(wrapper, "cache_linker", None), "wait_while_idle", None)
    if wait_while_idle is not None:
        wait_while_idle()  # until a read some waiting request waits for lands (or its wait runs out)
    return None


def install() -> None:
    global _installed
    if _installed:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookSource, HookType

    source = HookSource("kvbm", "sglang-kvbm")
    HookRegistry.register(_CACHE_TARGET, _after_wrapper_init, HookType.AFTER, source=source)
    HookRegistry.register(_WORKER_TARGET, _after_register_counter, HookType.AFTER, source=source)
    HookRegistry.register(_IDLE_TARGET, _before_idle, HookType.BEFORE, source=source)
    from sglang_kvbm.integration.sglang import weight_updates

    kinds = {"before": HookType.BEFORE, "after": HookType.AFTER}
    for target, hook, kind in weight_updates.hooks():
        HookRegistry.register(target, hook, kinds[kind], source=source)
    HookRegistry.apply_hooks()
    _installed = True
