"""The tiers below host, from the configuration: each kind in a folder of its own, in chain order.

A kind is a module ``sglang_kvbm.tiers.<name>.kind`` with:

* ``NAME`` and ``enabled(config)``: whether the configuration turns it on;
* ``build(config, pools) -> KindPlan``: a tier factory per pool of the
  worker (None where the kind does not hold that pool), the onboard policy if
  the kind brings one, and its part of the start-up log line;
* optionally ``doctor_rows(config, environ)`` (``sglang-kvbm doctor``),
  ``METRIC_DOCS`` and ``metrics(snapshot)`` (KVBM's metric names for it),
  ``commands(subparsers)`` and ``run(args) -> Optional[int]`` (``sglang-kvbm``
  subcommands), and ``on_launch(config)`` (the SGLang launcher, before ranks
  start).

A lookup walks the chain in :data:`KINDS` order after host: the nearest tier
that serves a block serves it. Adding a tier is a folder plus its line here.

The command line (to build its parser) and ``doctor`` import every kind, on the
base install too: a ``kind`` module imports only the standard library and this
package's light modules (configuration, ``core``, ``ops.needs``) at its top, and
everything else (torch, numpy, NIXL, Mooncake, zmq: its store and tier) inside
the function that needs it. A ``run`` checks what its command needs first
(``ops.needs.require``). ``tests/test_cli.py`` holds them to it.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
from types import ModuleType
from typing import Any, Callable, Mapping, Optional, Sequence

KINDS = ("disk", "mooncake", "object")  # chain order, below host


@dataclasses.dataclass(frozen=True)
class WorkerPools:
    """What a tier's builder needs of a worker's KV pools (the integration fills it in).

    ``names[0]`` is the full-attention KV (``kv``), the rest are a hybrid
    model's sidecar pools, each ``shares`` of a KV block's bytes.
    ``fingerprint(pool, rank_overrides)`` is ``(identity, description)`` of what
    that pool's bytes depend on (``integration.sglang.fingerprint``), with the
    ranks overridden (a tier shared by every rank names them all alike).
    """

    names: tuple[str, ...]
    layouts: tuple[Any, ...]
    shares: tuple[float, ...]
    fingerprint: Callable[[str, Mapping[str, int]], tuple[bytes, str]]
    ranks: Mapping[str, int] = dataclasses.field(default_factory=dict)
    served_model_name: str = ""
    mla: bool = False
    under_scheduler: bool = False  # in SGLang's scheduler process (routers can be told names)
    lanes: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # tests: threads that replace a tier's

    @property
    def kv(self):
        return self.layouts[0]


@dataclasses.dataclass
class KindPlan:
    per_pool: list  # per pool: a factory (LocalBlockManager -> LowerTier), or None
    policy: Any = None  # an OnboardPolicy (the disk's read meter decides whether a span is worth reading)
    summary: str = ""  # its part of the start-up log line


def pool_blocks(kv_blocks: int, share: float) -> int:
    """A pool's blocks in a tier of ``kv_blocks`` KV blocks (at least 16 sidecar blocks: a few nodes' worth)."""
    return kv_blocks if share == 1.0 or not kv_blocks else max(16, math.ceil(kv_blocks * share))


def kinds() -> list[ModuleType]:
    return [importlib.import_module(f"sglang_kvbm.tiers.{name}.kind") for name in KINDS]


def enabled(config) -> list[ModuleType]:
    return [kind for kind in kinds() if kind.enabled(config)]


def build(config, pools: WorkerPools) -> tuple[list[list], Optional[Any], list[str]]:
    """Per pool, the lower tiers' factories in chain order; the onboard policy; the log line's parts."""
    per_pool: list[list] = [[] for _ in pools.names]
    policy, summary = None, []
    for kind in kinds():
        if not kind.enabled(config):
            summary.append(f"{kind.NAME} off")
            continue
        plan = kind.build(config, pools)
        for factories, factory in zip(per_pool, plan.per_pool):
            if factory is not None:
                factories.append(factory)
        policy = policy or plan.policy
        summary.append(f"{kind.NAME} {plan.summary}")
    return per_pool, policy, summary


def doctor_rows(config, environ: Mapping[str, str]) -> list[tuple]:
    """``(check, status, detail)`` rows of every tier the configuration turns on."""
    rows: list[tuple] = []
    for kind in enabled(config):
        if hasattr(kind, "doctor_rows"):
            rows.extend(kind.doctor_rows(config, environ))
    return rows


def add_commands(subparsers) -> None:
    for kind in kinds():
        if hasattr(kind, "commands"):
            kind.commands(subparsers)


def run_command(args) -> Optional[int]:
    """Run a tier's subcommand; None when ``args`` names none of theirs."""
    for kind in kinds():
        if hasattr(kind, "run"):
            result = kind.run(args)
            if result is not None:
                return result
    return None


def metrics(snapshot: dict) -> dict:
    """KVBM's metric names the tiers give (``kind.metrics(snapshot)``), every tier's whether it is on or not (a
    dashboard sees zeros, not a missing series)."""
    out: dict = {}
    for kind in kinds():
        if hasattr(kind, "metrics"):
            out.update(kind.metrics(snapshot))
    return out


def metric_docs() -> dict:
    out: dict = {}
    for kind in kinds():
        out.update(getattr(kind, "METRIC_DOCS", {}))
    return out


def on_launch(config) -> None:
    """The SGLang launcher parsed its flags: what each tier the configuration turns on must set up first."""
    for kind in enabled(config):
        if hasattr(kind, "on_launch"):
            kind.on_launch(config)


def names(config) -> Sequence[str]:
    return [kind.NAME for kind in enabled(config)]
