"""Tiers as data: every kind in the registry is a folder with its entry point, and every tier implements the one
protocol below host, so the chain, the lookups and the counters never name a tier."""

from __future__ import annotations

import inspect
from pathlib import Path

from sglang_kvbm.config import KvbmConfig
from sglang_kvbm.tiers import registry
from sglang_kvbm.tiers.disk.tier import DiskTier
from sglang_kvbm.tiers.lower import LowerTier
from sglang_kvbm.tiers.mooncake.tier import MooncakeTier
from sglang_kvbm.tiers.object.tier import ObjectTier

PROTOCOL = {name for name, _ in inspect.getmembers(LowerTier) if not name.startswith("_")}
PROTOCOL |= set(LowerTier.__annotations__)


def test_every_kind_is_a_folder_with_its_entry():
    root = Path(registry.__file__).parent
    for name, kind in zip(registry.KINDS, registry.kinds()):
        assert isinstance(kind, registry.TierKind)
        assert kind.name == name and (root / name / "kind.py").is_file()


def test_every_tier_implements_the_protocol():
    assert {"start_read", "finish_read", "offer", "collect", "bind", "rekey", "forget", "close", "ask"} <= PROTOCOL
    for tier in (DiskTier, MooncakeTier, ObjectTier):
        missing = {name for name in PROTOCOL if not hasattr(tier, name) and name not in
                   ("header_bytes", "meter", "stats")}  # set per instance
        assert not missing, (tier.__name__, missing)
    assert {tier.name for tier in (DiskTier, MooncakeTier, ObjectTier)} == set(registry.KINDS)


def test_the_chain_is_in_registry_order_whatever_the_configuration_order():
    config = KvbmConfig(cpu_cache_gb=1, disk_cache_gb=1, mooncake_master="127.0.0.1:50051",
                        mooncake_metadata="P2PHANDSHAKE", object_enabled=True, object_bucket="kv")
    assert registry.names(config) == ["disk", "mooncake", "object"]
    assert registry.names(KvbmConfig(cpu_cache_gb=1, object_enabled=True, object_bucket="kv")) == ["object"]
    assert registry.names(KvbmConfig(cpu_cache_gb=1)) == []
