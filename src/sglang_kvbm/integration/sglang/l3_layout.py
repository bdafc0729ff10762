"""What this worker's G4 objects are called, told through SGLang's own channel for it: the scheduler's L3 layout.

SGLang 0.5.23's scheduler hands the launcher a description of the objects its
HiCache writes to Mooncake (``Scheduler.get_init_info()["hicache_object_layout"]``,
the same dict ``GET /hicache/l3_layout`` answers): backend, page size, and the
object names' prefix and suffixes, so a router can derive them from request
tokens. With this library SGLang's HiCache is off, so the scheduler would say
"disabled"; :func:`advertise` makes it describe this library's G4 objects
instead, in the same shape, plus the ``extra_backend_tag`` Dynamo 1.6.1's
registration asks for (:mod:`sglang_kvbm.integration.dynamo.mooncake`).

The layout is told once, at start-up: after a weight update re-keys G4
(``weight_updates``), a router keeps deriving the old names and sees no shared
hits for the new identity until the worker restarts.
"""

from __future__ import annotations

from typing import Any

TAG_KEY = "extra_backend_tag"


def layout(g4: Any, *, page_size: int, tp_size: int, pp_size: int, mla: bool) -> dict:
    """SGLang's L3 layout dict for the objects ``g4`` (a ``MooncakeStore``) and the worker's other ranks write."""
    from sglang_kvbm.tiers.mooncake.store import object_suffix

    if mla:
        suffixes = sorted({object_suffix(0, mla=True, pp_rank=p, pp_size=pp_size) for p in range(pp_size)})
    else:
        suffixes = [object_suffix(t, pp_rank=p, pp_size=pp_size) for p in range(pp_size) for t in range(tp_size)]
    return {
        "enabled": True,
        "backend": "mooncake",
        "page_size": page_size,
        TAG_KEY: g4.tag,
        "hicache_object_layout": {
            "pools": [{"suffixes": suffixes, "hit_policy": "all_pages"}],
            "key_prefix": g4.prefix,
            "is_mla_backend": mla,
            "pp_rank": None,
            "pp_size": pp_size,
        },
    }


def advertise(described: dict) -> None:
    """Make this process's scheduler report ``described`` as its L3 layout (SGLang's HiCache being off).

    SGLang 0.5.21 and 0.5.22 report no L3 layout at all: there their scheduler's start-up info (what
    ``get_init_info`` hands the launcher, and Dynamo's worker reads) gets the same key, with this description.
    """
    from sglang.srt.managers.scheduler import Scheduler

    if not hasattr(Scheduler, "_hicache_l3_layout"):
        info = getattr(Scheduler.get_init_info, "__wrapped__", Scheduler.get_init_info)

        def get_init_info(self) -> dict:
            return {**info(self), "hicache_object_layout": described}

        get_init_info.__wrapped__ = info
        Scheduler.get_init_info = get_init_info
        return
    original = getattr(Scheduler._hicache_l3_layout, "__wrapped__", Scheduler._hicache_l3_layout)

    def _hicache_l3_layout(self) -> dict:
        return original(self) if self.enable_hierarchical_cache else described

    _hicache_l3_layout.__wrapped__ = original
    Scheduler._hicache_l3_layout = _hicache_l3_layout
