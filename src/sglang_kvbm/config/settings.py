"""One frozen configuration, built once at start-up from KVBM's environment variables.

Variable names are KVBM's own (``DYN_KVBM_*``), so a deployment that already
configures KVBM for vLLM or TensorRT-LLM configures this library the same way;
``--kvbm-config`` (JSON) overrides them with the same settings.
Every value is parsed and range-checked here; a bad one raises
:class:`ConfigError` naming the variable and how to fix it, before any memory
is allocated or any request is served.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import logging
import os
from types import MappingProxyType
from typing import Any, Mapping, Optional

from sglang_kvbm.base.values import (  # ConfigError: everyone imports it from here
    GIB,
    ConfigError,
    JsonKey,
    Var,
    _block_size,
    _bool,
    _file_path,
    _host,
    _identity_name,
    _port,
    _positive_float,
    _positive_int,
    _priority,
    _staging_gib,
    _wait_ms,
)
from sglang_kvbm.tiers.disk import settings as disk
from sglang_kvbm.tiers.mooncake import settings as mooncake
from sglang_kvbm.tiers.object import settings as object_tier

logger = logging.getLogger(__name__)



# The variables this library reads, in the order a person would set them.
_VARS: tuple[Var, ...] = (
    Var("DYN_KVBM_CPU_CACHE_GB", "cpu_cache_gb", _positive_float, "host (G2) tier size in GiB"),
    Var(
        "DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS",
        "cpu_cache_blocks",
        _positive_int,
        "host (G2) tier size in blocks; overrides DYN_KVBM_CPU_CACHE_GB",
    ),
    *disk.VARIABLES,
    Var("DYN_KVBM_METRICS", "metrics", _bool, "serve Prometheus metrics and /tiers on DYN_KVBM_METRICS_PORT"),
    Var("DYN_KVBM_METRICS_PORT", "metrics_port", _port, "port of the metrics endpoint (default 6880)"),
    Var("SGLANG_KVBM_HTTP_HOST", "http_host", _host, "address the metrics endpoint binds (default 127.0.0.1)",
         text=True),
    Var(
        "SGLANG_KVBM_ROUTER_BLOCK_SIZE",
        "router_block_size",
        _block_size,
        "the block size Dynamo's router runs with; start-up fails unless it equals the page size",
    ),
    Var(
        "DYN_KVBM_HOST_OFFLOAD_PREFIX_MIN_PRIORITY",
        "host_offload_min_priority",
        _priority,
        "requests below this priority (0-100) are not offloaded to host",
    ),
    Var("SGLANG_KVBM_LOAD_WAIT_MS", "load_wait_ms", _wait_ms,
         "the least a load waits for its own disk and G4 reads before the request recomputes them (default 50 ms, "
         "plus 3x what the read meter expects; a first G4 read 500)"),
    Var("SGLANG_KVBM_READ_STAGING_GB", "read_staging_gb", _staging_gib,
         "host memory (pinned on CUDA) that reads from disk and the shared tiers land in before the device copy "
         "(default 1 GiB, at most the device pool): the longest prefix one load brings from below host, the rest "
         "of a longer hit is recomputed"),
    Var("SGLANG_KVBM_KEEP_READS", "keep_reads", _bool,
         "keep what a load read from disk or a shared tier in the host tier, announced CPU_PINNED (default on; 0: "
         "such reads are staged for the load only)"),
    Var(
        "DYN_KVBM_CACHE_STATS_MAX_REQUESTS",
        "cache_stats_max_requests",
        _positive_int,
        "requests in the sliding window of the host and disk hit rates (default 1000)",
    ),
    *mooncake.VARIABLES,
    *object_tier.VARIABLES,
    Var("SGLANG_KVBM_MODEL_IDENTITY", "model_identity", _identity_name,
         "names the model's weights (a version you vouch for) instead of their content digest, read at first start",
         text=True),
    Var("SGLANG_KVBM_DIGEST_CACHE", "digest_cache", _file_path,
         "file caching the model files' content digests (default ~/.cache/sglang-kvbm/digests.json)", text=True),
)
_BY_ENV = {v.env: v for v in _VARS}

# KVBM variables that belong to parts this library does not run (or runs through
# the kvbm package itself): accepted without a warning, and without effect. Name -> why
# (one line each: the configuration reference prints it).
_KVBM_PASSTHROUGH: Mapping[str, str] = MappingProxyType({
    "DYN_KVBM_LEADER_WORKER_INIT_TIMEOUT_SECS": (
        "how long KVBM's leader waits for its workers to register; sglang-kvbm has no leader and workers (each "
        "rank builds its own tiers in its own process), so nothing waits"
    ),
})
_SECRET_FIELDS = frozenset(v.field for v in _VARS if v.secret)
MASK = "***"


def hidden_variable(name: str) -> bool:
    """Whether a variable's value is a credential, never shown (``doctor``): the table's secret ones, and any
    name that reads like one."""
    var = _BY_ENV.get(name)
    return (var is not None and var.secret) or any(w in name for w in ("SECRET", "PASSWORD", "TOKEN")) or (
        name.endswith("_KEY"))


def _blocks(count: Optional[int], gib: Optional[float], block_bytes: int, gib_var: str) -> int:
    if count is not None:
        return count
    if gib is None:
        return 0
    blocks = int(gib * GIB) // block_bytes
    if blocks == 0:
        raise ConfigError(
            f"{gib_var}={gib} holds no block of {block_bytes} bytes: raise it to at least {block_bytes / GIB:.6f}"
        )
    return blocks


class _Pairs(list):
    """A JSON object as its ``(key, value)`` pairs, in order, duplicates kept."""


def _json_var(key: str) -> Var:
    by_field = {v.field: v for v in _VARS}
    var = _BY_ENV.get(key) or by_field.get(str(key).lower())
    if var is None:
        close = difflib.get_close_matches(str(key), list(by_field) + list(_BY_ENV), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ConfigError(
            f"--kvbm-config key {key!r} is unknown: {hint}remove it, or use one of {', '.join(sorted(by_field))}"
        )
    return var


def _json_text(var: Var, key: str, raw: Any) -> str:
    """A JSON value as the text the environment would carry, or a ConfigError naming the key."""
    if isinstance(raw, bool) and not var.text:
        return "true" if raw else "false"
    if isinstance(raw, str):
        if not raw.strip():
            raise ConfigError(f"--kvbm-config key {key!r} is empty: set a value, or leave the key out for the default")
        return raw.strip()
    if var.text or raw is None or isinstance(raw, (bool, list, dict)):
        kind = "a string" if var.text else "a number, string or boolean"
        shown = MASK if var.secret else json.dumps(dict(raw) if isinstance(raw, _Pairs) else raw)
        raise ConfigError(f"--kvbm-config key {key!r} needs {kind}, got {shown}: set it to {kind}, "
                          "or leave the key out for the default")
    return str(raw)


@dataclasses.dataclass(frozen=True)
class KvbmConfig:
    """What the tiers look like. Build it with :meth:`from_env` (or directly, in code)."""

    cpu_cache_gb: Optional[float] = None
    cpu_cache_blocks: Optional[int] = None
    disk_cache_gb: Optional[float] = None
    disk_cache_blocks: Optional[int] = None
    disk_cache_dir: str = "/tmp"
    disk_zerofill_fallback: bool = False
    disk_disable_o_direct: bool = False
    disable_disk_offload_filter: bool = False
    disk_onboard: str = "measured"
    metrics: bool = False
    metrics_port: int = 6880
    http_host: str = "127.0.0.1"
    router_block_size: Optional[int] = None
    host_offload_min_priority: int = 0
    cache_stats_max_requests: int = 1000
    load_wait_ms: Optional[float] = None
    read_staging_gb: Optional[float] = None
    keep_reads: bool = True
    mooncake_master: Optional[str] = None
    mooncake_metadata: Optional[str] = None
    mooncake_protocol: str = "tcp"
    mooncake_segment_gb: float = 0.0
    mooncake_offload_filter: bool = False
    object_enabled: bool = False
    object_bucket: Optional[str] = None
    object_endpoint: Optional[str] = None
    object_region: Optional[str] = None
    object_access_key: Optional[str] = None
    object_secret_key: Optional[str] = None
    object_write_through: bool = True
    object_num_blocks: int = 100_000
    model_identity: Optional[str] = None
    digest_cache: Optional[str] = None

    def __repr__(self) -> str:
        """The dataclass's repr, credentials masked (``object_secret_key='***'``): a config is logged and shown."""
        shown = (f"{f.name}={MASK!r}" if f.name in _SECRET_FIELDS and getattr(self, f.name) is not None
                 else f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self) if f.repr)
        return f"{type(self).__name__}({', '.join(shown)})"

    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None) -> "KvbmConfig":
        """Read every ``DYN_KVBM_*`` variable this library knows; raise on a bad one."""
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for name, raw in environ.items():
            if not name.startswith(("DYN_KVBM_", "SGLANG_KVBM_")):
                continue
            var = _BY_ENV.get(name)
            if var is None and name.startswith("SGLANG_KVBM_"):
                close = difflib.get_close_matches(name, list(_BY_ENV), n=1)
                hint = f"; did you mean {close[0]}?" if close else ""
                raise ConfigError(f"{name} is not a setting of sglang-kvbm: remove it{hint}")
            if var is None:
                if name not in _KVBM_PASSTHROUGH:
                    close = difflib.get_close_matches(name, list(_BY_ENV) + list(_KVBM_PASSTHROUGH), n=1)
                    hint = f" (did you mean {close[0]}?)" if close else ""
                    logger.warning("kvbm: %s is not a variable sglang-kvbm reads; ignoring it%s", name, hint)
                continue
            if raw.strip() == "":
                continue
            values[var.field] = var.parse(name, raw.strip())
        return cls(**values)._checked(environ)

    @classmethod
    def from_sources(cls, environ: Optional[Mapping[str, str]] = None, json_text: Optional[str] = None) -> "KvbmConfig":
        """The environment, overridden by a ``--kvbm-config`` JSON object with the same settings.

        JSON keys are the variable names (``"DYN_KVBM_CPU_CACHE_GB"``) or the field
        names (``"cpu_cache_gb"``); values go through the same parsing as the
        environment's. An unknown key, a setting given twice, an empty value, and a
        number where a path or an address belongs are errors.
        """
        config = cls.from_env(environ)
        if not json_text:
            return config
        try:
            pairs = json.loads(json_text, object_pairs_hook=_Pairs)  # pairs, so a key given twice is seen
        except ValueError as exc:
            raise ConfigError(f"--kvbm-config is not valid JSON ({exc}): pass an object, e.g. '{{\"cpu_cache_gb\": 4}}'") from None
        if not isinstance(pairs, _Pairs):
            raise ConfigError("--kvbm-config must be a JSON object: pass one, e.g. '{\"cpu_cache_gb\": 4}'")
        values: dict[str, Any] = {}
        given: dict[str, str] = {}  # field -> the key that set it
        for key, raw in pairs:
            var = _json_var(key)
            if var.field in given:
                raise ConfigError(
                    f"--kvbm-config sets {var.field} more than once ({given[var.field]!r} and {key!r}): "
                    "remove one of them"
                )
            given[var.field] = key
            values[var.field] = var.parse(JsonKey(key), _json_text(var, key, raw))
        return dataclasses.replace(config, **values)._checked(os.environ if environ is None else environ)

    def _checked(self, environ: Mapping[str, str]) -> "KvbmConfig":
        if self.has_mooncake:  # Mooncake's own variables that break it
            mooncake.check_environment(environ, self.mooncake_master, self.mooncake_metadata)
        object_tier.check(self)
        return self

    def host_blocks(self, block_bytes: int) -> int:
        """Blocks in the host tier for blocks of ``block_bytes`` (0 when the tier is off)."""
        return _blocks(self.cpu_cache_blocks, self.cpu_cache_gb, block_bytes, "DYN_KVBM_CPU_CACHE_GB")

    def disk_blocks(self, slot_bytes: int) -> int:
        """Blocks in the disk tier for slots of ``slot_bytes`` (0 when the tier is off)."""
        return _blocks(self.disk_cache_blocks, self.disk_cache_gb, slot_bytes, "DYN_KVBM_DISK_CACHE_GB")

    def read_staging_blocks(self, block_bytes: int, device_pages: int) -> int:
        """Rows of the read staging for KV blocks of ``block_bytes`` (their share of every pool's bytes): what one
        load can bring from below host, at least 16 and at most the device pool's pages."""
        budget = int((self.read_staging_gb if self.read_staging_gb is not None else 1.0) * GIB)
        return max(16, min(device_pages, budget // block_bytes))

    @property
    def has_host(self) -> bool:
        return self.cpu_cache_gb is not None or self.cpu_cache_blocks is not None

    @property
    def has_disk(self) -> bool:
        return self.disk_cache_gb is not None or self.disk_cache_blocks is not None

    @property
    def has_mooncake(self) -> bool:
        return self.mooncake_master is not None

    def require_a_tier(self) -> None:
        """Fail when no tier below the device is configured: the backend would do nothing."""
        mooncake.check(self)
        object_tier.check(self)
        if not self.has_host and not self.has_disk:
            raise ConfigError(
                "--radix-cache-backend kvbm needs a tier below the GPU: set DYN_KVBM_CPU_CACHE_GB "
                "(GiB, e.g. DYN_KVBM_CPU_CACHE_GB=4) or DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS for host "
                "memory, and/or DYN_KVBM_DISK_CACHE_GB or DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS for disk"
            )

    @staticmethod
    def variables() -> tuple[tuple[str, str], ...]:
        """``(name, meaning)`` of every variable read, for docs and ``doctor``."""
        return tuple((v.env, v.doc) for v in _VARS)

    @staticmethod
    def ignored_variables() -> tuple[tuple[str, str], ...]:
        """``(name, why)`` of every KVBM variable accepted without effect (no warning), for docs."""
        return tuple(_KVBM_PASSTHROUGH.items())
