"""Configuration: KVBM's ``DYN_KVBM_*`` and this library's ``SGLANG_KVBM_*`` variables, checked at start-up.

``settings`` holds the variable table and :class:`KvbmConfig`, ``values`` the
parsers each variable names, ``events`` SGLang's KV-event settings.
"""

from sglang_kvbm.config.settings import GIB, ConfigError, KvbmConfig

__all__ = ["GIB", "ConfigError", "KvbmConfig"]
