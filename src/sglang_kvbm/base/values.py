"""One setting's text parsed and range-checked, or a :class:`ConfigError` naming it and the fix.

A parser gets the setting's name as its source shows it: an environment
variable (``DYN_KVBM_CPU_CACHE_GB``), or a ``--kvbm-config`` key
(:class:`JsonKey`), so the example in the fix is in the syntax the person typed
(``DYN_KVBM_CPU_CACHE_GB=4``, ``--kvbm-config '{"cpu_cache_gb": 4}'``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Callable

GIB = 1 << 30


class ConfigError(ValueError):
    """A configuration value is missing, malformed or out of range."""


class JsonKey(str):
    """A ``--kvbm-config`` key as a parser's ``name``: shown as ``--kvbm-config key``, fixed in JSON."""

    def __new__(cls, key: str) -> "JsonKey":
        name = super().__new__(cls, f"--kvbm-config {key}")
        name.key = key
        return name


def _eg(name: str, value: Any) -> str:
    """How to set ``name`` to ``value``, in the syntax of where it came from."""
    if isinstance(name, JsonKey):
        return f"--kvbm-config '{json.dumps({name.key: value})}'"
    return f"{name}={str(value).lower() if isinstance(value, bool) else value}"


def _unset(name: str) -> str:
    return "leave the key out" if isinstance(name, JsonKey) else "unset it"


def _gib(name: str, raw: str, unset: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number: set it to a size in GiB, e.g. {_eg(name, 4)}") from None
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(
            f"{name}={raw!r} must be a positive size in GiB: set it to one, e.g. {_eg(name, 4)}, or {_unset(name)} "
            f"{unset}"
        )
    return value


def _positive_float(name: str, raw: str) -> float:
    return _gib(name, raw, "to disable the tier")


def _wait_ms(name: str, raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number: set it to milliseconds, e.g. {_eg(name, 50)}") from None
    if not math.isfinite(value) or not 0 <= value <= 30_000:
        raise ConfigError(
            f"{name}={raw!r} must be 0-30000 milliseconds (a load never waits longer than 30 s): set it to one, "
            f"e.g. {_eg(name, 50)}, or {_unset(name)} for the default (50)"
        )
    return value


def _positive_int(name: str, raw: str) -> int:
    try:
        value = int(raw, 10)
    except ValueError:
        raise ConfigError(
            f"{name}={raw!r} is not a whole number: set it to a block count, e.g. {_eg(name, 1024)}"
        ) from None
    if value <= 0:
        raise ConfigError(f"{name}={raw!r} must be at least 1: set a block count, or {_unset(name)} to size the tier in GiB")
    return value


def _priority(name: str, raw: str) -> int:
    try:
        value = int(raw, 10)
    except ValueError:
        raise ConfigError(
            f"{name}={raw!r} is not a whole number: set a priority from 0 to 100, e.g. {_eg(name, 50)}"
        ) from None
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
        raise ConfigError(f"{name}={raw!r} is not a port number: set it to 1-65535, e.g. {_eg(name, 6880)}") from None
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
        raise ConfigError(
            f"{name}={raw!r} is not a block size: set it to the router's --block-size in tokens, e.g. {_eg(name, 16)}"
        )
    return value


def _directory(name: str, raw: str) -> str:
    if "\x00" in raw:
        raise ConfigError(f"{name} contains a NUL byte: set it to a directory path")
    if not raw:  # abspath("") would be the working directory
        raise ConfigError(f"{name} is empty: set it to a directory path, or {_unset(name)} for the default /tmp")
    return os.path.abspath(os.path.expanduser(raw))


def _staging_gib(name: str, raw: str) -> float:
    """GiB of host rows that reads from the tiers below host land in (not a tier: unsetting it keeps the default)."""
    return _gib(name, raw, "for the default (1 GiB)")


def _gib_or_zero(name: str, raw: str) -> float:
    """GiB that may be 0 (lend nothing: a standalone store process lends the memory)."""
    try:
        if float(raw) == 0:
            return 0.0
    except ValueError:
        pass
    return _positive_float(name, raw)


_IDENTITY_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._:@/+-")


def _identity_name(name: str, raw: str) -> str:
    """A name an operator gives a model's weights instead of their digest (a version they vouch for)."""
    bad = sorted(set(raw) - _IDENTITY_CHARS)
    if not raw or len(raw) > 128 or bad:
        why = "is empty" if not raw else ("is longer than 128 characters" if len(raw) > 128
                                          else f"contains {''.join(bad)!r}")
        raise ConfigError(
            f"{name}={raw!r} {why}: set it to a name for the exact weights this server loads (letters, digits and "
            f"._:@/+-, at most 128), e.g. {_eg(name, 'llama-3.1-8b-instruct@2024-07-23')}, and change it whenever the "
            f"weights change; or {_unset(name)} to name them by their content")
    return raw


def _file_path(name: str, raw: str) -> str:
    if "\x00" in raw or not raw:
        raise ConfigError(f"{name}={raw!r} is not a file path: set it to one, or {_unset(name)} for the default")
    return os.path.abspath(os.path.expanduser(raw))


@dataclasses.dataclass(frozen=True)
class Var:
    """One variable this library reads: its name, the ``KvbmConfig`` field it sets, its parser, one line of doc."""

    env: str
    field: str
    parse: Callable[[str, str], Any]
    doc: str
    text: bool = False  # a path or an address: in JSON, only a string (a number or true is a mistake)
    secret: bool = False  # a credential: never in a repr, a log line, doctor's table or an error message
