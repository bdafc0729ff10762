"""``--radix-cache-backend kvbm`` (and the version patch's ``--enable-kvbm``) as SGLang's linker flags.

The flag users type stays the radix-cache backend's. During SGLang's
server-argument resolution, in the launcher, it is turned into what the
installed SGLang needs to run this library on its default tree with the
scheduler's linker hooks on (which of two routes: ``compat``):

* where SGLang builds linkers from a configuration (0.5.23):
  ``--enable-unified-cache-external-linker --unified-cache-external-linker-backend
  dynamic --unified-cache-external-linker-config {"linker": "KvbmLinker", ...}``,
  and no radix-cache backend;
* where it does not (0.5.21, 0.5.22): ``--enable-unified-cache-external-linker``
  beside ``--radix-cache-backend kvbm``, whose factory builds the tree and
  attaches the linker (``factory``).

The configuration (environment, then ``--kvbm-config``) is validated here, so a
bad value stops the launcher before any process is spawned. No sglang import at
module level: the plugin imports this in every SGLang process.
"""

from __future__ import annotations

import json
from typing import Any, Optional

from sglang_kvbm.config import ConfigError, KvbmConfig
from sglang_kvbm.config.events import check_kv_events_config
from sglang_kvbm.integration.dynamo import worker

BACKEND_NAME = "kvbm"
SOURCE = "sglang-kvbm"
LINKER = "KvbmLinker"
LINKER_MODULE = "sglang_kvbm.integration.sglang.linker"


def linker_config(kvbm_config: Optional[str]) -> dict:
    """The value of ``--unified-cache-external-linker-config`` that runs this library."""
    return {"linker": LINKER, "linker_module_path": LINKER_MODULE, "linker_extra_config": {"kvbm_config": kvbm_config}}


def wanted(cfg: Any) -> bool:
    return cfg.radix_cache_backend == BACKEND_NAME or bool(getattr(cfg, "enable_kvbm", False))


def translate(server_args: Any) -> None:
    """Declare the linker flags on ``server_args`` if kvbm was asked for (idempotent)."""
    check_installed_sglang()  # before any other SGLang attribute is read
    from sglang.srt.arg_groups.overrides import declare_resolution, resolving_view

    from sglang_kvbm.integration.sglang.compat import seam
    from sglang_kvbm.integration.sglang.fingerprint import server_draw

    cfg = resolving_view(server_args)
    by_config = seam().linker_config_flag
    kvbm_config = getattr(cfg, "kvbm_config", None)
    if not wanted(cfg):
        if kvbm_config:
            raise ConfigError("--kvbm-config is set but neither --enable-kvbm nor --radix-cache-backend kvbm is")
        return
    if cfg.radix_cache_backend not in (None, BACKEND_NAME):
        raise ConfigError(f"--enable-kvbm cannot run with --radix-cache-backend {cfg.radix_cache_backend}")
    for flag, value in (
        ("--disable-radix-cache", cfg.disable_radix_cache),
        ("--enable-hierarchical-cache", cfg.enable_hierarchical_cache),
        ("--hicache-storage-backend", cfg.hicache_storage_backend),
        ("--enable-lmcache", getattr(cfg, "enable_lmcache", False)),
    ):
        if value:
            raise ConfigError(f"sglang-kvbm (--radix-cache-backend kvbm) replaces SGLang's host cache: remove {flag}")
    if by_config and cfg.unified_cache_external_linker_config not in (None, linker_config(kvbm_config)):
        raise ConfigError(
            "--radix-cache-backend kvbm sets --unified-cache-external-linker-config itself: remove that flag"
        )
    config = KvbmConfig.from_sources(json_text=kvbm_config)
    config.require_a_tier()
    server_draw()  # drawn here, in the launcher: every rank it starts inherits the one draw (see weight_settings)
    events = check_kv_events_config(cfg.kv_events_config, cfg.page_size or 1)  # the page size may be unresolved yet
    worker.on_launch(config, events)  # inside Dynamo's SGLang worker: what its router must be told
    if by_config:
        declare_resolution(
            server_args,
            SOURCE,
            radix_cache_backend=None,
            enable_unified_cache_external_linker=True,
            unified_cache_external_linker_backend="dynamic",
            unified_cache_external_linker_config=linker_config(kvbm_config),
        )
    else:  # the kvbm factory builds the tree and its linker; the flag turns the scheduler's linker hooks on
        declare_resolution(server_args, SOURCE, radix_cache_backend=BACKEND_NAME,
                           enable_unified_cache_external_linker=True)


def check_installed_sglang() -> None:
    """Refuse an SGLang outside the supported range, naming both (the linker contract changes between versions)."""
    from importlib import metadata

    from sglang_kvbm.base.versions import check_sglang_version

    check_sglang_version(metadata.version("sglang"))


def describe(kvbm_config: Optional[str] = None) -> str:
    """The raw SGLang flags ``--radix-cache-backend kvbm`` stands for (docs and ``doctor``)."""
    from sglang_kvbm.integration.sglang.compat import seam

    if not seam().linker_config_flag:
        return f"--radix-cache-backend {BACKEND_NAME} --enable-unified-cache-external-linker"
    return (
        "--enable-unified-cache-external-linker --unified-cache-external-linker-backend dynamic "
        f"--unified-cache-external-linker-config '{json.dumps(linker_config(kvbm_config))}'"
    )
