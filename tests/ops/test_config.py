"""Configuration: parsed once, every bad value named with its fix."""

import logging

import pytest

from sglang_kvbm.config import ConfigError, KvbmConfig


def test_defaults_and_values():
    assert KvbmConfig.from_env({}) == KvbmConfig()
    config = KvbmConfig.from_env(
        {
            "DYN_KVBM_CPU_CACHE_GB": "1.5",
            "DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": "",
            "DYN_KVBM_HOST_OFFLOAD_PREFIX_MIN_PRIORITY": "20",
            "PATH": "/bin",
        }
    )
    assert config == KvbmConfig(cpu_cache_gb=1.5, host_offload_min_priority=20)
    assert config.host_blocks(1 << 20) == 1536


def test_block_override_wins_over_size():
    config = KvbmConfig.from_env({"DYN_KVBM_CPU_CACHE_GB": "4", "DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": "10"})
    assert config.host_blocks(4096) == 10


@pytest.mark.parametrize(
    "name, value",
    [
        ("DYN_KVBM_CPU_CACHE_GB", "lots"),
        ("DYN_KVBM_CPU_CACHE_GB", "-1"),
        ("DYN_KVBM_CPU_CACHE_GB", "0"),
        ("DYN_KVBM_CPU_CACHE_GB", "nan"),
        ("DYN_KVBM_CPU_CACHE_GB", "inf"),
        ("DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS", "1.5"),
        ("DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS", "0"),
        ("DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS", "ten"),
        ("DYN_KVBM_HOST_OFFLOAD_PREFIX_MIN_PRIORITY", "101"),
        ("DYN_KVBM_HOST_OFFLOAD_PREFIX_MIN_PRIORITY", "-1"),
        ("DYN_KVBM_HOST_OFFLOAD_PREFIX_MIN_PRIORITY", "high"),
        ("DYN_KVBM_DISK_CACHE_GB", "big"),
        ("DYN_KVBM_DISK_CACHE_GB", "-2"),
        ("DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS", "0"),
        ("DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS", "x"),
        ("DYN_KVBM_DISK_CACHE_DIR", "/tmp/a\x00b"),
        ("DYN_KVBM_DISK_ZEROFILL_FALLBACK", "maybe"),
        ("DYN_KVBM_DISK_DISABLE_O_DIRECT", "2"),
        ("DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER", "yes please"),
        ("SGLANG_KVBM_DISK_ONBOARD", "sometimes"),
        ("SGLANG_KVBM_READ_STAGING_GB", "0"),
        ("SGLANG_KVBM_READ_STAGING_GB", "some"),
        ("SGLANG_KVBM_READ_STAGING_GB", "inf"),
    ],
)
def test_bad_value_names_the_variable(name, value):
    with pytest.raises(ConfigError, match=name):
        KvbmConfig.from_env({name: value})


def test_read_staging_holds_what_one_load_brings_from_below_host():
    """1 GiB unless set, at least 16 blocks, at most the device pool's pages."""
    assert KvbmConfig().read_staging_blocks(1 << 20, 10_000) == 1024
    assert KvbmConfig.from_env({"SGLANG_KVBM_READ_STAGING_GB": "4.5"}).read_staging_blocks(1 << 20, 10_000) == 4608
    assert KvbmConfig(read_staging_gb=64).read_staging_blocks(1 << 20, 10_000) == 10_000
    assert KvbmConfig(read_staging_gb=0.001).read_staging_blocks(1 << 20, 10_000) == 16


def test_too_small_to_hold_a_block():
    with pytest.raises(ConfigError, match="DYN_KVBM_CPU_CACHE_GB"):
        KvbmConfig(cpu_cache_gb=1e-9).host_blocks(1 << 20)


def test_no_tier_is_an_error_naming_both_variables():
    with pytest.raises(ConfigError, match="DYN_KVBM_CPU_CACHE_GB.*DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS"):
        KvbmConfig().require_a_tier()


def test_unknown_kvbm_variable_is_reported_with_a_suggestion(caplog):
    with caplog.at_level(logging.WARNING, logger="sglang_kvbm.config"):
        KvbmConfig.from_env({"DYN_KVBM_CPU_CACHE_G": "4", "DYN_KVBM_METRICS": "1"})
    assert "DYN_KVBM_CPU_CACHE_G is not a variable" in caplog.text
    assert "did you mean DYN_KVBM_CPU_CACHE_GB" in caplog.text
    assert "DYN_KVBM_METRICS" not in caplog.text


def test_kvbm_variables_of_parts_not_run_are_accepted_silently_each_with_its_reason(caplog):
    ignored = dict(KvbmConfig.ignored_variables())
    assert "DYN_KVBM_LEADER_WORKER_INIT_TIMEOUT_SECS" in ignored
    assert all(reason.strip() and "\n" not in reason for reason in ignored.values())
    assert not set(ignored) & {name for name, _ in KvbmConfig.variables()}  # read or ignored, never both
    with caplog.at_level(logging.WARNING, logger="sglang_kvbm.config"):
        config = KvbmConfig.from_env({name: "30" for name in ignored})
    assert config == KvbmConfig() and caplog.text == ""


def test_credentials_stay_out_of_repr_and_error_messages():
    config = KvbmConfig.from_env({"DYN_KVBM_CPU_CACHE_GB": "1", "DYN_KVBM_OBJECT_ENABLED": "1",
                                  "DYN_KVBM_OBJECT_BUCKET": "kv-cache", "DYN_KVBM_OBJECT_ACCESS_KEY": "AKIAEXAMPLEID",
                                  "DYN_KVBM_OBJECT_SECRET_KEY": "s3cr3t-v4lue"})
    assert config.object_secret_key == "s3cr3t-v4lue"  # the value itself is kept
    for shown in (repr(config), str(config), f"{config!r}"):
        assert "s3cr3t-v4lue" not in shown and "AKIAEXAMPLEID" not in shown
        assert "object_secret_key='***'" in shown and "cpu_cache_gb=1.0" in shown
    assert "object_secret_key=None" in repr(KvbmConfig())  # unset stays visibly unset
    with pytest.raises(ConfigError) as raised:
        KvbmConfig.from_sources({}, '{"object_secret_key": ["s3cr3t-v4lue"]}')
    assert "s3cr3t-v4lue" not in str(raised.value) and "object_secret_key" in str(raised.value)
    from sglang_kvbm.tiers.object.store import ObjectSettings

    assert "s3cr3t-v4lue" not in repr(ObjectSettings("kv-cache", None, None, "AKIAEXAMPLEID", "s3cr3t-v4lue"))


def test_disk_variables():
    config = KvbmConfig.from_env(
        {
            "DYN_KVBM_DISK_CACHE_GB": "2",
            "DYN_KVBM_DISK_CACHE_DIR": "/var/cache/kvbm",
            "DYN_KVBM_DISK_ZEROFILL_FALLBACK": "TRUE",
            "DYN_KVBM_DISK_DISABLE_O_DIRECT": "0",
            "DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER": "on",
        }
    )
    assert config.has_disk and not config.has_host
    assert config.disk_cache_dir == "/var/cache/kvbm" and config.disk_zerofill_fallback
    assert not config.disk_disable_o_direct and config.disable_disk_offload_filter
    assert config.disk_blocks(1 << 20) == 2048
    config.require_a_tier()  # disk alone is a valid configuration
