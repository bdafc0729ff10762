"""What the version patch's ``--enable-kvbm``/``--kvbm-config`` flags call, in the launcher.

The patch keeps SGLang's side to a few lines: it asks this module what the
radix-cache backend must be, and this module validates the configuration the
same way the scheduler will (environment, then the JSON), so a bad value stops
the launcher before any process is spawned.
"""

from __future__ import annotations

from typing import Optional

from sglang_kvbm.config import ConfigError, KvbmConfig
from sglang_kvbm.integration.sglang.plugin import BACKEND_NAME


def resolve_radix_cache_backend(enable_kvbm: bool, kvbm_config: Optional[str], radix_cache_backend: Optional[str]) -> Optional[str]:
    """The backend ``--enable-kvbm`` implies, or None to leave the flags as they are."""
    if not enable_kvbm:
        if kvbm_config:
            raise ConfigError("--kvbm-config is set but --enable-kvbm is not: add --enable-kvbm")
        return None
    if radix_cache_backend not in (None, BACKEND_NAME):
        raise ConfigError(
            f"--enable-kvbm selects --radix-cache-backend {BACKEND_NAME}; it cannot run with "
            f"--radix-cache-backend {radix_cache_backend}"
        )
    KvbmConfig.from_sources(json_text=kvbm_config).require_a_tier()
    return BACKEND_NAME


def ensure_registered() -> None:
    """Register the backend even where plugins are filtered out (``SGLANG_PLUGINS``)."""
    from sglang_kvbm.integration.sglang.plugin import register

    register()
