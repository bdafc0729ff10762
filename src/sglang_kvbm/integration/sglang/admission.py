"""A request's admission against the tiers: what of its tail is restorable, and pinning it for the load, all or none.

What :meth:`KvbmLinker.lookup` and :meth:`KvbmLinker.load` do (their contracts are
stated there), agreed on by every pool, attention rank and pipeline stage
(``ranks``): SGLang takes one branch on all attention ranks and none across
stages, so a length one of them cannot restore, or a load one refuses, is every
one's miss. Hybrid models load the KV with every sidecar pool's part (sliding-window
pages, Mamba state) or not at all. Where SGLang cannot take a refusal (0.5.21),
``lookup`` pins what it reports and ``load`` takes those pins (``lookup_pins``).
Scheduler thread only.
"""

from __future__ import annotations

from typing import Optional

from sglang.srt.mem_cache.hicache_storage import PoolTransfer

from sglang_kvbm.integration.sglang.lookup_pins import LookupPins
from sglang_kvbm.integration.sglang.pool_transfers import kv_transfer, restorable_lengths, sidecar_loads
from sglang_kvbm.integration.sglang.ranks import LinkerSetup
from sglang_kvbm.manager.loads import LoadBatches


class Admissions:
    def __init__(self, connector, sidecars, loads: LoadBatches, setup: LinkerSetup,
                 pins: Optional[LookupPins]) -> None:
        self._connector = connector
        self._sidecars = sidecars
        self._loads = loads
        self._setup = setup
        self._pins = pins

    def lookup(self, rid: str, transfers: list[PoolTransfer]) -> list[int]:
        """The prefix lengths (pages) of the tail every rank and stage can restore (pinned first on 0.5.21)."""
        keys = kv_transfer(transfers).keys or []
        hit = self._pins.waiting(rid, keys) if self._pins is not None else 0  # 0.5.21: still waiting for its reads
        if not hit:
            hit = self._connector.lookup(rid, keys)
            if self._pins is not None:
                hit = self._pins.pin(rid, keys, hit)
        stages, across = self._setup.stages, self._setup.ranks_agreeing > 1
        if self._sidecars:  # hybrid: only boundaries whose window pages / state the sidecar tiers hold too
            lengths = self._sidecars.restorable(keys, hit, every=across or stages.many) if hit else []
            return stages.common(lengths, len(keys))
        return restorable_lengths(stages.shortest(hit), across)

    def load(self, rid: str, transfers: list[PoolTransfer], cache) -> bool:
        """Queue ``rid``'s load pinned whole on every rank and stage (``cache`` reduces over the ranks), or refuse."""
        kv = kv_transfer(transfers)
        if self._pins is not None:  # pinned by its lookup; every rank pinned at least what the ranks agreed on
            self._loads.queue(rid, self._pins.take(rid, kv.keys), kv.device_indices)
            return True
        connector, sidecars = self._connector, self._sidecars
        plan = side = None
        try:
            plan = connector.acquire(kv.keys)
            if plan is not None and sidecars:  # all or none: the KV with every sidecar pool's part
                wanted = sidecar_loads(transfers, sidecars.managers)
                try:
                    side = sidecars.acquire({n: t.keys for n, t in wanted.items()}) if wanted else None
                except BaseException:
                    connector.cancel(plan)
                    raise
                if side is None:
                    connector.refuse(plan, "a sliding-window page or Mamba state it needs is not held")
                    plan = None
        finally:  # also when acquire raised: the other ranks are in the reduction already
            if not self._setup.all_agree(plan is not None, cache):
                if plan is not None:
                    connector.cancel(plan)
                    sidecars.release(side or {}, reused=False)
                plan = None
        if plan is None:
            return False
        side = {name: (side[name], t.device_indices) for name, t in wanted.items()} if side else None
        self._loads.queue(rid, plan, kv.device_indices, side)
        return True
