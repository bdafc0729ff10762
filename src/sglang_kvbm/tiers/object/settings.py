"""The object tier's settings: KVBM's ``DYN_KVBM_OBJECT_*`` variables, parsed and checked (``config.settings``)."""

from __future__ import annotations

import re
import urllib.parse

from sglang_kvbm.base.values import ConfigError, Var, _bool, _eg, _positive_int, _unset

# S3's bucket naming rules: 3-63 of a-z, 0-9, '.', '-', a letter or digit first and last (checked with the
# placeholder standing for the widest rank number likely: a name that fits it fits every rank's)
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


def bucket(name: str, raw: str) -> str:
    named = raw.replace("{worker_id}", "9999")
    if not _BUCKET.match(named) or ".." in named:
        raise ConfigError(f"{name}={raw!r} is not an S3 bucket name: set it to 3-63 lowercase letters, digits, '.' "
                          f"and '-' (and {{worker_id}}, this rank's number), e.g. {_eg(name, 'kv-cache-{worker_id}')}")
    return raw


def endpoint(name: str, raw: str) -> str:
    parsed = urllib.parse.urlsplit(raw)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ConfigError(f"{name}={raw!r} is not an http(s) URL: set it to the object store's address, "
                          f"e.g. {_eg(name, 'http://127.0.0.1:9000')}, or {_unset(name)} for AWS S3 itself")
    try:
        parsed.port
    except ValueError:
        raise ConfigError(f"{name}={raw!r} has a port that is not a number: set it as "
                          f"{_eg(name, 'http://host:9000')}") from None
    return raw.rstrip("/")


def text(name: str, raw: str) -> str:
    if any(c.isspace() for c in raw) or not raw.isprintable():
        raise ConfigError(f"{name} has blanks or control characters: set it to the value alone")
    return raw


def check(config) -> None:
    """Settings that are wrong only together (start-up, with the object tier on)."""
    if not config.object_enabled:
        return
    if config.object_bucket is None:
        raise ConfigError("DYN_KVBM_OBJECT_ENABLED=1 but DYN_KVBM_OBJECT_BUCKET is not set: name the bucket, e.g. "
                          "DYN_KVBM_OBJECT_BUCKET=kv-cache-{worker_id} (it must exist), or set "
                          "DYN_KVBM_OBJECT_ENABLED=0")
    if (config.object_access_key is None) != (config.object_secret_key is None):
        given, missing = (("DYN_KVBM_OBJECT_ACCESS_KEY", "DYN_KVBM_OBJECT_SECRET_KEY")
                          if config.object_secret_key is None else
                          ("DYN_KVBM_OBJECT_SECRET_KEY", "DYN_KVBM_OBJECT_ACCESS_KEY"))
        raise ConfigError(f"{given} is set but {missing} is not: set both, or neither (the AWS SDK's own "
                          "credentials are used then)")
    if not config.has_host:
        raise ConfigError("DYN_KVBM_OBJECT_ENABLED=1 needs a host tier (every object transfer is staged in host "
                          "memory, as in KVBM): set DYN_KVBM_CPU_CACHE_GB (e.g. DYN_KVBM_CPU_CACHE_GB=4) or "
                          "DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS")


VARIABLES: tuple[Var, ...] = (
    Var("DYN_KVBM_OBJECT_ENABLED", "object_enabled", _bool, "KVBM's G4: the object tier, an S3-compatible bucket "
         "through NIXL's OBJ backend (default 0)"),
    Var("DYN_KVBM_OBJECT_BUCKET", "object_bucket", bucket,
         "the bucket (it must exist); {worker_id} becomes this rank's number", text=True),
    Var("DYN_KVBM_OBJECT_ENDPOINT", "object_endpoint", endpoint,
         "the object store's URL, e.g. http://127.0.0.1:9000 (path-style); unset: AWS S3", text=True),
    Var("DYN_KVBM_OBJECT_REGION", "object_region", text, "the bucket's region", text=True),
    Var("DYN_KVBM_OBJECT_ACCESS_KEY", "object_access_key", text,
         "with _SECRET_KEY; unset: the AWS SDK's own credentials", text=True, secret=True),
    Var("DYN_KVBM_OBJECT_SECRET_KEY", "object_secret_key", text, "with _ACCESS_KEY", text=True,
         secret=True),
    Var("DYN_KVBM_OBJECT_WRITE_THROUGH", "object_write_through", _bool,
         "keep a block in host after it is written to the bucket (default 1; 0: it leaves host)"),
    Var("DYN_KVBM_OBJECT_NUM_BLOCKS", "object_num_blocks", _positive_int,
         "blocks the worker remembers being in the bucket (default 100000)"),
)
