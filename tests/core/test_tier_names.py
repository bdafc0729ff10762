"""One table names every tier: its name, the medium of its KV events, KVBM's level (``core.tiers``)."""

import enum

import pytest

from sglang_kvbm.core.connector import ConnectorStats
from sglang_kvbm.core.hit_rate import HitRateWindow
from sglang_kvbm.core.tiers import DISK, HOST, MOONCAKE, OBJECT, ROUTER_MEDIA, TIERS, Tier, by_medium, by_name
from sglang_kvbm.tiers import registry


def test_the_table_in_every_vocabulary():
    assert [(t.name, t.level, t.medium and t.medium.value) for t in TIERS] == [
        ("device", "G1", "GPU"), ("host", "G2", "CPU_PINNED"), ("disk", "G3", "DISK"),
        ("mooncake", "G4", None), ("object", "G4", None)]
    assert all(t.description and "\n" not in t.description for t in TIERS)
    assert [t.announced for t in TIERS] == [True, True, True, False, False]


def test_the_wire_spellings_are_unchanged_and_the_router_reads_them():
    assert {m.name: m.value for m in Tier} == {"DEVICE": "GPU", "HOST": "CPU_PINNED", "DISK": "DISK"}
    assert all(m.medium == m.value for m in Tier)
    assert {t.medium.value for t in TIERS if t.announced} <= ROUTER_MEDIA
    assert {t.medium for t in TIERS if t.announced} == set(Tier)  # every medium belongs to exactly one tier


def test_lookups_by_name_and_by_medium():
    for tier in TIERS:
        assert by_name(tier.name) is tier
        if tier.announced:
            assert by_medium(tier.medium) is tier and by_medium(tier.medium.value) is tier
    engine_enum = enum.Enum("StorageMedium", {"CPU_PINNED": "CPU_PINNED"})  # as SGLang's: the same spellings
    assert by_medium(engine_enum.CPU_PINNED) is HOST
    for name in ("staging", "Host", "G2"):
        with pytest.raises(KeyError):
            by_name(name)
    for medium in ("CPU", "NVME", "EXTERNAL", None):  # Dynamo's aliases name no tier of ours
        with pytest.raises(KeyError):
            by_medium(medium)


def test_every_kind_in_the_registry_has_its_row_in_chain_order():
    below_host = [t.name for t in TIERS[TIERS.index(HOST) + 1:]]
    assert list(registry.KINDS) == below_host
    assert [kind.name for kind in registry.kinds()] == below_host


def test_the_lower_tiers_take_their_name_and_medium_from_the_table():
    pytest.importorskip("torch")
    from sglang_kvbm.tiers.disk.tier import DiskTier
    from sglang_kvbm.tiers.object.tier import ObjectTier

    assert (DiskTier.name, DiskTier.medium) == (DISK.name, DISK.medium)
    assert (ObjectTier.name, ObjectTier.medium) == (OBJECT.name, OBJECT.medium)
    try:
        from sglang_kvbm.tiers.mooncake.tier import MooncakeTier
    except ImportError:  # pragma: no cover - a base install without Mooncake's light dependencies
        return
    assert (MooncakeTier.name, MooncakeTier.medium) == (MOONCAKE.name, MOONCAKE.medium)


def test_kvbm_counters_and_hit_rates_read_the_tiers_by_name():
    stats = ConnectorStats()
    stats.offload_blocks.update({"device->host": 1, "host->disk": 2, "device->disk": 3})
    stats.onboard_blocks.update({"host": 4, "disk": 5})
    out = stats.as_dict()
    assert [out[k] for k in ("offload_blocks_d2h", "offload_blocks_h2d", "offload_blocks_d2d", "onboard_blocks_h2d",
                             "onboard_blocks_d2d")] == [1, 2, 3, 4, 5]
    window = HitRateWindow(10)
    window.record("r", {"host": 1, "disk": 2}, 4)
    assert (window.host_rate, window.disk_rate) == (0.25, 0.5)


def test_the_router_view_maps_dynamos_fields_onto_the_tier_names():
    from sglang_kvbm.integration.dynamo.router_view import tiers_of

    rows = [{"worker_id": 7, "device_blocks": 1, "host_pinned_blocks": 2, "disk_blocks": 3},
            {"worker_id": 7, "device_blocks": 1}]
    assert tiers_of({"block_size": 4, "workers": rows}) == {"block_size": 4,
                                                           "workers": {"7": {"device": 8, "host": 8, "disk": 12}}}

