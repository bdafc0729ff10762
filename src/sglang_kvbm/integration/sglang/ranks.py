"""What a linker needs to know about the worker it serves: its configuration, identity and ranks.

Ranks follow SGLang's own rules: every TP rank stores its own shard (and has a
disk directory of its own: the rank is part of the identity), SGLang
intersects hits across attention ranks, the scheduler of attention-TP rank 0
publishes its DP rank's events, and that scheduler serves the metrics
endpoint, on ``DYN_KVBM_METRICS_PORT + dp_rank``.

Pipeline stages are not intersected by SGLang (see :class:`Stages`): the linker
makes its stages agree itself.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
from typing import Any, Callable, Mapping, Sequence

import torch
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

from sglang_kvbm.config import KvbmConfig
from sglang_kvbm.core.content_digest import DigestCache
from sglang_kvbm.integration.sglang.build import Identity
from sglang_kvbm.integration.sglang.kv_pool import UnsupportedPoolError
from sglang_kvbm.integration.sglang.server_identity import kv_settings

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
    stages: "Stages" = dataclasses.field(default_factory=lambda: Stages())  # pipeline stages the linker makes agree

    def all_agree(self, ok: bool, cache) -> bool:
        """MIN-reduce a rank's yes/no over the pipeline stages, then the attention ranks (the tree's own groups)."""
        ok = self.stages.agree(ok)
        if self.ranks_agreeing > 1:
            flag = torch.tensor([int(ok)], dtype=torch.int)
            cache._all_reduce_attn_groups(flag, torch.distributed.ReduceOp.MIN)
            ok = bool(flag[0])
        return ok


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
        if served == model_path:  # SGLang's default is the path: a location, not a name (it would part the hosts)
            served = ""
        revision = getattr(server_args, "revision", None)
        download_dir = getattr(server_args, "download_dir", None)
        settings = kv_settings(server_args, DigestCache(config.digest_cache))
    identity = extra_config.get("identity") or Identity(model_path, revision, settings, ranks, download_dir, served)
    serves = tp_rank == 0 and params.pp_rank == 0 and params.attn_cp_rank == 0
    agreeing = _group_rank(params.attn_tp_cache_group)[1] * _group_rank(params.attn_cp_cache_group)[1]
    agreeing = agreeing if agreeing > 1 else _group_rank(params.tp_cache_group)[1]
    return LinkerSetup(config, identity, tp_rank, tp_size, dp_rank, serves, agreeing, stages_of(params))


def stages_of(params) -> "Stages":
    pp_size = int(params.pp_size or 1)
    if pp_size == 1:
        return Stages()
    stages = Stages(params.pp_cache_group)
    if stages.size != pp_size:
        raise ValueError(f"sglang-kvbm: --pp-size {pp_size}, but the pipeline group SGLang passed holds "
                         f"{stages.size} stage(s): the stages could not agree on what to load")
    return stages


class Stages:
    """The pipeline stages of this rank, and the MIN-reductions that make them decide as one.

    Every stage runs its own scheduler, tree and linker over the same requests in
    the same order (SGLang's PP design, which its rank-consensus checker asserts
    across the PP group), but its tiers hold only its own layers, and SGLang
    reduces linker answers over the attention TP/CP groups only. A block one stage
    lacks is a miss for all, a load one refuses is refused by all, and an offload
    is reported finished (and held) only once every stage's copy is: otherwise the
    stages' trees (locks, evictions, hits) drift apart and the next collective, or
    the next micro-batch, pairs up wrong. Reductions run on the PP group's gloo
    group (``pp_cache_group``), on the scheduler thread; each is called by every
    stage at the same point; with one stage they answer for it alone, without one.
    """

    def __init__(self, group=None) -> None:
        self.group = group
        self.size = _group_rank(group)[1] if group is not None else 1
        self._agreed: collections.deque[bool] = collections.deque()  # offload verdicts every stage reached
        self._local: collections.deque[bool] = collections.deque()  # this stage's, not agreed yet

    @property
    def many(self) -> bool:
        return self.size > 1

    def _min(self, values: list[int]) -> list[int]:
        tensor = torch.tensor(values, dtype=torch.int64)
        torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MIN, group=self.group)
        return tensor.tolist()

    def agree(self, ok: bool) -> bool:
        """True when every stage says yes."""
        return bool(self._min([int(ok)])[0]) if self.many else ok

    def shortest(self, hit: int) -> int:
        """The fewest leading pages any stage holds (every shorter prefix is restorable)."""
        return self._min([hit])[0] if self.many else hit

    def common(self, lengths: Sequence[int], num_pages: int) -> list[int]:
        """The prefix lengths (1..``num_pages``) every stage can restore."""
        if not self.many:
            return list(lengths)
        mask = [0] * (num_pages + 1)
        for pages in lengths:
            if 0 < pages <= num_pages:
                mask[pages] = 1
        return [pages for pages, held in enumerate(self._min(mask)) if held]

    def completed_offloads(self, done: int, pop: Callable[[], bool], unpopped: int) -> int:
        """How many of the oldest offloads every stage finished (their verdicts: :meth:`pop_offload`).

        Of this stage's ``unpopped`` offloads, the oldest ``done`` finished; ``pop``
        takes the oldest one's verdict. The stages accept the same offloads and hand
        the same counts to their trees, so every stage has as many not handed yet.
        """
        if not self.many:
            return done
        for _ in range(done):
            self._local.append(pop())
        running = unpopped - done
        if self._local or running:  # one entry per offload no stage has handed to its tree: 0 running, 1 failed, 2 held
            verdicts = self._min([2 if ok else 1 for ok in self._local] + [0] * running)
            for verdict in verdicts:
                if not verdict:
                    break
                self._local.popleft()
                self._agreed.append(verdict == 2)
        return len(self._agreed)

    def pop_offload(self, pop: Callable[[], bool]) -> bool:
        return self._agreed.popleft() if self.many else pop()

    def forget_offloads(self) -> None:
        """The tree dropped its pending offloads (a reset, on every stage)."""
        self._agreed.clear()
        self._local.clear()
