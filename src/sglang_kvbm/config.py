"""One frozen configuration, built once at start-up from KVBM's environment variables.

Variable names are KVBM's own (``DYN_KVBM_*``), so a deployment that already
configures KVBM for vLLM or TensorRT-LLM configures this library the same way.
Every value is parsed and range-checked here; a bad one raises
:class:`ConfigError` naming the variable and how to fix it, before any memory
is allocated or any request is served.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import logging
import math
import os
from typing import Any, Callable, Mapping, Optional

logger = logging.getLogger(__name__)

GIB = 1 << 30


class ConfigError(ValueError):
    """A configuration value is missing, malformed or out of range."""


def _positive_float(name: str, raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number: set it to a size in GiB, e.g. {name}=4") from None
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{name}={raw!r} must be a positive size in GiB, e.g. {name}=4; unset it to disable the tier")
    return value


def _positive_int(name: str, raw: str) -> int:
    try:
        value = int(raw, 10)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a whole number: set it to a block count, e.g. {name}=1024") from None
    if value <= 0:
        raise ConfigError(f"{name}={raw!r} must be at least 1; unset it to size the tier in GiB instead")
    return value


def _priority(name: str, raw: str) -> int:
    try:
        value = int(raw, 10)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a whole number: set a priority from 0 to 100, e.g. {name}=50") from None
    if not 0 <= value <= 100:
        raise ConfigError(f"{name}={raw!r} is out of range: set a priority from 0 to 100 (0 offloads everything)")
    return value


def _bool(name: str, raw: str) -> bool:
    value = raw.lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{name}={raw!r} is not a boolean: set it to true or false")


def _port(name: str, raw: str) -> int:
    try:
        value = int(raw, 10)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a port number: set it to 1-65535, e.g. {name}=6880") from None
    if not 1 <= value <= 65535:
        raise ConfigError(f"{name}={raw!r} is out of range: set it to 1-65535")
    return value


def _host(name: str, raw: str) -> str:
    import ipaddress

    try:
        return str(ipaddress.ip_address(raw))
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not an IP address: set it to 127.0.0.1 (default) or 0.0.0.0") from None


def _block_size(name: str, raw: str) -> int:
    try:
        value = int(raw, 10)
    except ValueError:
        value = 0
    if value <= 0:
        raise ConfigError(f"{name}={raw!r} is not a block size: set it to the router's --block-size in tokens, e.g. 16")
    return value


def _directory(name: str, raw: str) -> str:
    if "\x00" in raw:
        raise ConfigError(f"{name} contains a NUL byte: set it to a directory path")
    return os.path.abspath(os.path.expanduser(raw))


@dataclasses.dataclass(frozen=True)
class _Var:
    env: str
    field: str
    parse: Callable[[str, str], Any]
    doc: str


# The variables this library reads, in the order a person would set them.
_VARS: tuple[_Var, ...] = (
    _Var("DYN_KVBM_CPU_CACHE_GB", "cpu_cache_gb", _positive_float, "host (G2) tier size in GiB"),
    _Var(
        "DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS",
        "cpu_cache_blocks",
        _positive_int,
        "host (G2) tier size in blocks; overrides DYN_KVBM_CPU_CACHE_GB",
    ),
    _Var("DYN_KVBM_DISK_CACHE_GB", "disk_cache_gb", _positive_float, "disk (G3) tier size in GiB"),
    _Var(
        "DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS",
        "disk_cache_blocks",
        _positive_int,
        "disk (G3) tier size in blocks; overrides DYN_KVBM_DISK_CACHE_GB",
    ),
    _Var("DYN_KVBM_DISK_CACHE_DIR", "disk_cache_dir", _directory, "where the disk tier's files live (default /tmp)"),
    _Var(
        "DYN_KVBM_DISK_ZEROFILL_FALLBACK",
        "disk_zerofill_fallback",
        _bool,
        "preallocate disk files by writing zeros where fallocate is unsupported (e.g. Lustre)",
    ),
    _Var(
        "DYN_KVBM_DISK_DISABLE_O_DIRECT",
        "disk_disable_o_direct",
        _bool,
        "use buffered I/O where the filesystem rejects O_DIRECT",
    ),
    _Var(
        "DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER",
        "disable_disk_offload_filter",
        _bool,
        "write every host block to disk, not only reused ones (shortens SSD life)",
    ),
    _Var("DYN_KVBM_METRICS", "metrics", _bool, "serve Prometheus metrics and /tiers on DYN_KVBM_METRICS_PORT"),
    _Var("DYN_KVBM_METRICS_PORT", "metrics_port", _port, "port of the metrics endpoint (default 6880)"),
    _Var("SGLANG_KVBM_HTTP_HOST", "http_host", _host, "address the metrics endpoint binds (default 127.0.0.1)"),
    _Var(
        "SGLANG_KVBM_ROUTER_BLOCK_SIZE",
        "router_block_size",
        _block_size,
        "the block size Dynamo's router runs with; start-up fails unless it equals the page size",
    ),
    _Var(
        "DYN_KVBM_HOST_OFFLOAD_PREFIX_MIN_PRIORITY",
        "host_offload_min_priority",
        _priority,
        "requests below this priority (0-100) are not offloaded to host",
    ),
)
_BY_ENV = {v.env: v for v in _VARS}

# KVBM variables that belong to parts this library does not run (or runs through
# the kvbm package itself); accepted without a warning.
_KVBM_PASSTHROUGH = frozenset({"DYN_KVBM_LEADER_WORKER_INIT_TIMEOUT_SECS"})


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
    metrics: bool = False
    metrics_port: int = 6880
    http_host: str = "127.0.0.1"
    router_block_size: Optional[int] = None
    host_offload_min_priority: int = 0

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
        return cls(**values)

    @classmethod
    def from_sources(cls, environ: Optional[Mapping[str, str]] = None, json_text: Optional[str] = None) -> "KvbmConfig":
        """The environment, overridden by a ``--kvbm-config`` JSON object with the same settings.

        JSON keys are the variable names (``"DYN_KVBM_CPU_CACHE_GB"``) or the field
        names (``"cpu_cache_gb"``); values go through the same parsing as the
        environment's. An unknown key is an error.
        """
        config = cls.from_env(environ)
        if not json_text:
            return config
        try:
            data = json.loads(json_text)
        except ValueError as exc:
            raise ConfigError(f"--kvbm-config is not valid JSON ({exc}): pass an object, e.g. '{{\"cpu_cache_gb\": 4}}'") from None
        if not isinstance(data, dict):
            raise ConfigError("--kvbm-config must be a JSON object, e.g. '{\"cpu_cache_gb\": 4}'")
        by_field = {v.field: v for v in _VARS}
        values = {}
        for key, raw in data.items():
            var = _BY_ENV.get(key) or by_field.get(str(key).lower())
            if var is None:
                known = ", ".join(sorted(by_field))
                raise ConfigError(f"--kvbm-config key {key!r} is unknown; known keys: {known}")
            if isinstance(raw, bool):
                raw = "true" if raw else "false"
            elif raw is None or isinstance(raw, (list, dict)):
                raise ConfigError(f"--kvbm-config key {key!r} needs a number, string or boolean, got {raw!r}")
            values[var.field] = var.parse(f"--kvbm-config {key}", str(raw))
        return dataclasses.replace(config, **values)

    def host_blocks(self, block_bytes: int) -> int:
        """Blocks in the host tier for blocks of ``block_bytes`` (0 when the tier is off)."""
        return _blocks(self.cpu_cache_blocks, self.cpu_cache_gb, block_bytes, "DYN_KVBM_CPU_CACHE_GB")

    def disk_blocks(self, slot_bytes: int) -> int:
        """Blocks in the disk tier for slots of ``slot_bytes`` (0 when the tier is off)."""
        return _blocks(self.disk_cache_blocks, self.disk_cache_gb, slot_bytes, "DYN_KVBM_DISK_CACHE_GB")

    @property
    def has_host(self) -> bool:
        return self.cpu_cache_gb is not None or self.cpu_cache_blocks is not None

    @property
    def has_disk(self) -> bool:
        return self.disk_cache_gb is not None or self.disk_cache_blocks is not None

    def require_a_tier(self) -> None:
        """Fail when no tier below the device is configured: the backend would do nothing."""
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
