"""The tiers below host, from the configuration: each kind in a folder of its own, in chain order.

A kind's folder has a ``kind`` module whose ``KIND`` is a :class:`TierKind`:
its name, whether the configuration turns it on, and how it builds a
:class:`KindPlan` for a worker's pools; optionally its ``sglang-kvbm doctor``
rows, KVBM's metric names for it, and ``sglang-kvbm`` subcommands. A tier
exports names and objects only: it patches no engine. What the engines must be
told of it (SGLang's L3 layout, Dynamo's registration) is said by
``integration`` from :attr:`KindPlan.names`.

A lookup walks the chain in :data:`KINDS` order after host: the nearest tier
that serves a block serves it. Adding a tier is a folder plus its line here (and its row, name to
medium and KVBM level, in ``core.tiers``).

The command line (to build its parser) and ``doctor`` import every kind, on the
base install too: a ``kind`` module imports only the standard library and this
package's light modules (``base``, ``core``, this module) at its top, and
everything else (torch, numpy, NIXL, Mooncake, zmq: its store and tier) inside
the function that needs it. A ``run`` checks what its command needs first
(``base.needs.require``). ``tests/ops/test_cli.py`` holds them to it.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
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
    lanes: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # tests: threads that replace a tier's

    @property
    def kv(self):
        return self.layouts[0]


@dataclasses.dataclass
class KindPlan:
    per_pool: list  # per pool: a factory (LocalBlockManager -> LowerTier), or None
    policy: Any = None  # an OnboardPolicy (the disk's read meter decides whether a span is worth reading)
    summary: str = ""  # its part of the start-up log line
    names: Any = None  # what a router derives this tier's object names from (mooncake: its store's tag, prefix)


def _no_rows(config, environ: Mapping[str, str]) -> list[tuple]:
    return []


@dataclasses.dataclass(frozen=True)
class TierKind:
    """One kind of tier below host, as its folder's ``kind`` module declares it (``KIND``)."""

    name: str
    enabled: Callable[[Any], bool]  # (config) -> whether the configuration turns it on
    build: Callable[[Any, WorkerPools], KindPlan]  # (config, pools): its tiers for one worker
    doctor_rows: Callable[[Any, Mapping[str, str]], list] = _no_rows  # (config, environ) -> (check, status, detail)
    metric_docs: Mapping[str, str] = dataclasses.field(default_factory=dict)  # KVBM's metric names for it -> help
    metrics: Callable[[dict], dict] = lambda snapshot: {}  # a published snapshot -> {metric name: value}
    commands: Callable[[Any], None] = lambda subparsers: None  # adds its ``sglang-kvbm`` subcommands
    run: Callable[[Any], Optional[int]] = lambda args: None  # runs one of them; None when ``args`` names none


def pool_blocks(kv_blocks: int, share: float) -> int:
    """A pool's blocks in a tier of ``kv_blocks`` KV blocks (at least 16 sidecar blocks: a few nodes' worth)."""
    return kv_blocks if share == 1.0 or not kv_blocks else max(16, math.ceil(kv_blocks * share))


def kinds() -> list[TierKind]:
    return [importlib.import_module(f"sglang_kvbm.tiers.{name}.kind").KIND for name in KINDS]


def enabled(config) -> list[TierKind]:
    return [kind for kind in kinds() if kind.enabled(config)]


@dataclasses.dataclass
class Built:
    """Every kind's plan for one worker, merged."""

    per_pool: list[list]  # per pool, the lower tiers' factories in chain order
    policy: Optional[Any]  # the onboard policy (the first kind's that brings one)
    summary: list[str]  # the log line's parts
    names: dict[str, Any]  # kind name -> its KindPlan.names, for the kinds that have them


def build(config, pools: WorkerPools) -> Built:
    built = Built([[] for _ in pools.names], None, [], {})
    for kind in kinds():
        if not kind.enabled(config):
            built.summary.append(f"{kind.name} off")
            continue
        plan = kind.build(config, pools)
        for factories, factory in zip(built.per_pool, plan.per_pool):
            if factory is not None:
                factories.append(factory)
        built.policy = built.policy or plan.policy
        built.summary.append(f"{kind.name} {plan.summary}")
        if plan.names is not None:
            built.names[kind.name] = plan.names
    return built


def doctor_rows(config, environ: Mapping[str, str]) -> list[tuple]:
    """``(check, status, detail)`` rows of every tier the configuration turns on."""
    return [row for kind in enabled(config) for row in kind.doctor_rows(config, environ)]


def add_commands(subparsers) -> None:
    for kind in kinds():
        kind.commands(subparsers)


def run_command(args) -> Optional[int]:
    """Run a tier's subcommand; None when ``args`` names none of theirs."""
    for kind in kinds():
        result = kind.run(args)
        if result is not None:
            return result
    return None


def metrics(snapshot: dict) -> dict:
    """KVBM's metric names the tiers give (``kind.metrics(snapshot)``), every tier's whether it is on or not (a
    dashboard sees zeros, not a missing series)."""
    out: dict = {}
    for kind in kinds():
        out.update(kind.metrics(snapshot))
    return out


def metric_docs() -> dict:
    out: dict = {}
    for kind in kinds():
        out.update(kind.metric_docs)
    return out


def names(config) -> Sequence[str]:
    return [kind.name for kind in enabled(config)]
