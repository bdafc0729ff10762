"""The bad-input table: every variable and every --kvbm-config key, with wrong types,
out-of-range and unknown values, fails at start-up with an error naming it."""

from __future__ import annotations

import json

import pytest

from sglang_kvbm.config import _VARS, ConfigError, KvbmConfig

BAD = {
    "_positive_float": ["four", "-1", "0", "nan", "inf"],
    "_positive_int": ["1.5", "0", "-3", "ten"],
    "_block_size": ["1.5", "0", "sixteen"],
    "_priority": ["101", "-1", "high"],
    "_bool": ["maybe", "2", "yesno"],
    "_directory": ["/tmp/a\x00b"],
    "_port": ["0", "70000", "http"],
    "_host": ["localhost", "999.1.1.1", ""],
}
CASES = [(var, value) for var in _VARS for value in BAD[var.parse.__name__] if value != "" or var.parse.__name__ == "_host"]


@pytest.mark.parametrize("var, value", CASES, ids=[f"{v.env}={x!r}" for v, x in CASES])
def test_bad_environment_value_names_the_variable(var, value):
    if value == "":
        pytest.skip("an empty variable means unset")
    with pytest.raises(ConfigError, match=var.env):
        KvbmConfig.from_env({var.env: value})


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
    """The table as a person reads it (``pytest -s tests/test_bad_input.py -k table``)."""
    lines = []
    for var in _VARS:
        value = BAD[var.parse.__name__][0]
        try:
            KvbmConfig.from_env({var.env: value})
        except ConfigError as exc:
            lines.append(f"{var.env}={value!r} -> {exc}")
    assert len(lines) == len(_VARS)
    print("\n".join(lines))
