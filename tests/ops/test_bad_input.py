"""The bad-input table: every variable and every --kvbm-config key, with wrong types,
out-of-range and unknown values, fails at start-up with an error naming it."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from sglang_kvbm.config.settings import _VARS, ConfigError, KvbmConfig

BAD = {
    "_positive_float": ["four", "-1", "0", "nan", "inf"],
    "_positive_int": ["1.5", "0", "-3", "ten"],
    "_block_size": ["1.5", "0", "sixteen"],
    "_priority": ["101", "-1", "high"],
    "_bool": ["maybe", "2", "yesno"],
    "_directory": ["/tmp/a\x00b"],
    "_port": ["0", "70000", "http"],
    "_host": ["localhost", "999.1.1.1", ""],
    "address": ["nohost", "host:", ":50051", "127.0.0.1:99999", "127.0.0.1:rpc"],  # tiers/mooncake/settings.py
    "metadata_url": ["ftp://x/metadata", "127.0.0.1:8080/metadata"],
    "protocol": ["udp", "ib"],
    "onboard": ["sometimes", "0"],
    "bucket": ["Kv", "kv_cache", "-kv", "kv..cache", "k" * 64, "kv{rank}"],  # tiers/object/settings.py
    "endpoint": ["127.0.0.1:9000", "ftp://host/", "http://", "http://host:port"],
    "text": ["us east", "a\tb"],
    "_gib_or_zero": ["four", "-1", "nan", "inf"],
    "_staging_gib": ["four", "-1", "0", "nan", "inf"],
    "_identity_name": ["my model", "v1;rm", "x" * 129, "caf\u00e9"],
    "_file_path": ["/tmp/a\x00b"],
    "_wait_ms": ["-1", "30001", "nan", "inf", "soon"],
}
# Variables of other programs that break a setting of ours: (variable, value, our settings it breaks).
G4_HTTP = {"DYN_KVBM_CPU_CACHE_GB": "1", "SGLANG_KVBM_MOONCAKE_MASTER": "127.0.0.1:50051",
           "SGLANG_KVBM_MOONCAKE_METADATA": "http://127.0.0.1:8080/metadata"}
FOREIGN = [("MC_LEGACY_RPC_PORT_BINDING", value, G4_HTTP) for value in ("1", "0", "", "true")]  # Mooncake: present = on
CASES = [(var, value) for var in _VARS for value in BAD[var.parse.__name__] if value != "" or var.parse.__name__ == "_host"]


@pytest.mark.parametrize("var, value", CASES, ids=[f"{v.env}={x!r}" for v, x in CASES])
def test_bad_environment_value_names_the_variable(var, value):
    if value == "":
        pytest.skip("an empty variable means unset")
    with pytest.raises(ConfigError, match=var.env):
        KvbmConfig.from_env({var.env: value})


@pytest.mark.parametrize("name, value, settings", FOREIGN, ids=[f"{n}={x!r}" for n, x, _ in FOREIGN])
def test_a_foreign_variable_that_breaks_a_setting_fails_at_start_up(name, value, settings):
    """From the environment, and with the setting it breaks turned on by --kvbm-config."""
    with pytest.raises(ConfigError, match=name) as err:
        KvbmConfig.from_env({**settings, name: value})
    assert FIX.search(str(err.value)) and f"unset {name}" in str(err.value)
    with pytest.raises(ConfigError, match=name):
        KvbmConfig.from_sources({name: value}, json.dumps(settings))


def test_legacy_rpc_port_binding_is_harmless_without_g4_or_with_p2phandshake():
    """Measured: with P2PHANDSHAKE the client's setup works with it set; without G4 nothing reads it."""
    assert KvbmConfig.from_env({"MC_LEGACY_RPC_PORT_BINDING": "1", "DYN_KVBM_CPU_CACHE_GB": "1"}).cpu_cache_gb == 1
    p2p = {**G4_HTTP, "SGLANG_KVBM_MOONCAKE_METADATA": "P2PHANDSHAKE", "MC_LEGACY_RPC_PORT_BINDING": "1"}
    assert KvbmConfig.from_env(p2p).mooncake_metadata == "P2PHANDSHAKE"


@pytest.mark.parametrize("var, value", CASES, ids=[f"{v.field}={x!r}" for v, x in CASES])
def test_bad_json_value_names_the_key(var, value):
    for key in (var.env, var.field):
        with pytest.raises(ConfigError, match=key):
            KvbmConfig.from_sources({}, json.dumps({key: value}))


@pytest.mark.parametrize("raw", [[], {}, None])
@pytest.mark.parametrize("var", _VARS, ids=[v.field for v in _VARS])
def test_json_values_of_the_wrong_type_are_refused(var, raw):
    with pytest.raises(ConfigError, match=var.field):
        KvbmConfig.from_sources({}, json.dumps({var.field: raw}))


def test_unknown_keys_and_variables():
    with pytest.raises(ConfigError, match="'cpu_cache_gib' is unknown"):
        KvbmConfig.from_sources({}, '{"cpu_cache_gib": 4}')
    with pytest.raises(ConfigError, match="SGLANG_KVBM_HTTP_HOTS.*did you mean SGLANG_KVBM_HTTP_HOST"):
        KvbmConfig.from_env({"SGLANG_KVBM_HTTP_HOTS": "127.0.0.1"})
    with pytest.raises(ConfigError, match="not valid JSON"):
        KvbmConfig.from_sources({}, "{cpu_cache_gb: 4}")
    with pytest.raises(ConfigError, match="must be a JSON object"):
        KvbmConfig.from_sources({}, "[4]")


def test_json_overrides_the_environment():
    config = KvbmConfig.from_sources({"DYN_KVBM_CPU_CACHE_GB": "4"}, '{"cpu_cache_gb": 2, "DYN_KVBM_METRICS": true}')
    assert config.cpu_cache_gb == 2 and config.metrics


def test_print_the_table(capsys):
    """The table as a person reads it (``pytest -s tests/ops/test_bad_input.py -k table``): every bad value from
    both sources, each row naming its variable or key and saying the fix."""
    lines = []
    for var, value in CASES:
        for source, run in (
            (var.env, lambda: KvbmConfig.from_env({var.env: value})),
            (var.field, lambda: KvbmConfig.from_sources({}, json.dumps({var.field: value}))),
        ):
            if value == "" and source == var.env:
                continue  # an empty variable means unset
            with pytest.raises(ConfigError) as err:
                run()
            row = f"{source}={value!r} -> {err.value}"
            assert source in str(err.value), row
            assert FIX.search(str(err.value)), f"no fix in: {row}"
            lines.append(row)
    for name, value, settings in FOREIGN:
        with pytest.raises(ConfigError) as err:
            KvbmConfig.from_env({**settings, name: value})
        lines.append(f"{name}={value!r} (with {', '.join(settings)}) -> {err.value}")
    assert len(lines) >= 2 * len(_VARS)
    print("\n".join(lines))


# --- every field, both sources; each message names its source and says the fix --------------------------------

FIX = re.compile(r"\b(set|unset|remove|leave|raise|lower|use|pass|give)\b")


def test_every_field_has_a_variable():
    assert sorted(v.field for v in _VARS) == sorted(f.name for f in dataclasses.fields(KvbmConfig))


def _json_cases():
    """Every bad environment value, plus what only JSON can say: the empty string and values of the wrong type."""
    cases = [(var, value) for var, value in CASES if value != ""]
    for var in _VARS:
        cases.append((var, ""))
        if var.parse.__name__ in ("_directory", "_host"):
            cases += [(var, 5), (var, True)]
    return cases


JSON_CASES = _json_cases()


@pytest.mark.parametrize("var, value", JSON_CASES, ids=[f"{v.field}={x!r}" for v, x in JSON_CASES])
def test_bad_json_value_gets_a_json_fix(var, value):
    with pytest.raises(ConfigError) as err:
        KvbmConfig.from_sources({}, json.dumps({var.field: value}))
    message = str(err.value)
    assert var.field in message and FIX.search(message), message
    assert "unset it" not in message, message
    if "e.g." in message:
        assert '{"' in message.split("e.g.", 1)[1], f"the example is not JSON: {message}"


def test_json_empty_directory_is_not_the_working_directory():
    with pytest.raises(ConfigError, match="disk_cache_dir.*empty"):
        KvbmConfig.from_sources({}, '{"disk_cache_dir": ""}')


def test_json_key_given_twice_is_refused():
    with pytest.raises(ConfigError, match="cpu_cache_gb.*more than once"):
        KvbmConfig.from_sources({}, '{"cpu_cache_gb": 4, "cpu_cache_gb": 2}')
    with pytest.raises(ConfigError, match="sets cpu_cache_gb more than once .'DYN_KVBM_CPU_CACHE_GB' and 'cpu_cache_gb'.: remove one"):
        KvbmConfig.from_sources({}, '{"DYN_KVBM_CPU_CACHE_GB": 4, "cpu_cache_gb": 2}')


def test_unknown_json_key_suggests_the_close_one():
    with pytest.raises(ConfigError, match="'cpu_cache_gib' is unknown.*did you mean 'cpu_cache_gb'"):
        KvbmConfig.from_sources({}, '{"cpu_cache_gib": 4}')


def test_json_strings_are_trimmed_like_the_environment():
    config = KvbmConfig.from_sources({}, '{"http_host": " 0.0.0.0 ", "cpu_cache_gb": " 2 "}')
    assert config.http_host == "0.0.0.0" and config.cpu_cache_gb == 2
