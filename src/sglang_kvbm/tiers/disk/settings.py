"""The disk tier's settings: KVBM's ``DYN_KVBM_DISK_*`` variables (``config.settings`` reads them with the rest)."""

from __future__ import annotations

from sglang_kvbm.base.values import ConfigError, Var, _bool, _directory, _positive_float, _positive_int

ONBOARD_MODES = ("measured", "always")


def onboard(name: str, raw: str) -> str:
    """``measured`` (a disk span is read when the read meter says it beats recomputing it) or ``always``."""
    if raw.lower() not in ONBOARD_MODES:
        raise ConfigError(f"{name}={raw!r} is not a disk onboard mode: set it to measured (read a disk hit when "
                          "reading beats recomputing it, as measured) or always (read every disk hit)")
    return raw.lower()


VARIABLES: tuple[Var, ...] = (
    Var("DYN_KVBM_DISK_CACHE_GB", "disk_cache_gb", _positive_float, "disk (G3) tier size in GiB"),
    Var(
        "DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS",
        "disk_cache_blocks",
        _positive_int,
        "disk (G3) tier size in blocks; overrides DYN_KVBM_DISK_CACHE_GB",
    ),
    Var("DYN_KVBM_DISK_CACHE_DIR", "disk_cache_dir", _directory, "where the disk tier's files live (default /tmp)",
         text=True),
    Var(
        "DYN_KVBM_DISK_ZEROFILL_FALLBACK",
        "disk_zerofill_fallback",
        _bool,
        "preallocate disk files by writing zeros where fallocate is unsupported (e.g. Lustre)",
    ),
    Var(
        "DYN_KVBM_DISK_DISABLE_O_DIRECT",
        "disk_disable_o_direct",
        _bool,
        "use buffered I/O where the filesystem rejects O_DIRECT",
    ),
    Var(
        "DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER",
        "disable_disk_offload_filter",
        _bool,
        "write every host block to disk, not only reused ones (shortens SSD life)",
    ),
    Var("SGLANG_KVBM_DISK_ONBOARD", "disk_onboard", onboard,
        "measured (default): a disk hit is read when the read meter says reading beats recomputing it; always: every "
        "disk hit is read (a disk known to be fast, or tests on a busy machine)"),
)
