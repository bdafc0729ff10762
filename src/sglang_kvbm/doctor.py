"""``sglang-kvbm doctor``: is this machine ready to serve with sglang-kvbm, and if not, why.

One table a person reads: versions, CUDA, the backend ``auto`` picks, every
``DYN_KVBM_*`` value, host memory against the configured tiers, and the disk
directory probed the way the server will probe it. Exit status 1 on a problem.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import shutil
from importlib import metadata
from typing import Optional, TextIO

from sglang_kvbm.config import GIB, ConfigError, KvbmConfig

SUPPORTED_SGLANG = ">=0.5.23,<0.6"


@dataclasses.dataclass
class Row:
    check: str
    status: str  # ok | warn | FAIL | info
    detail: str


def _version(dist: str) -> Optional[str]:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _versions(rows: list[Row]) -> None:
    from packaging.specifiers import SpecifierSet

    rows.append(Row("python", "info", platform.python_version()))
    sglang = _version("sglang")
    if sglang is None:
        rows.append(Row("sglang", "FAIL", f"not installed: pip install 'sglang{SUPPORTED_SGLANG}'"))
    elif sglang not in SpecifierSet(SUPPORTED_SGLANG):
        rows.append(Row("sglang", "FAIL", f"{sglang} is outside the supported range {SUPPORTED_SGLANG}"))
    else:
        rows.append(Row("sglang", "ok", sglang))
    for dist, why in (("torch", "required"), ("nixl", "disk tier"), ("kvbm", "kvbm backend (CUDA)")):
        version = _version(dist)
        status = "ok" if version else ("FAIL" if why == "required" else "info")
        rows.append(Row(dist, status, version or f"not installed ({why})"))


def _cuda(rows: list[Row]) -> bool:
    try:
        import torch
    except ImportError:
        return False
    if torch.cuda.is_available():
        rows.append(Row("cuda", "ok", f"{torch.cuda.get_device_name(0)} (torch CUDA {torch.version.cuda})"))
        return True
    rows.append(Row("cuda", "info", "no CUDA device: host memory is not pinned, copies use a worker thread"))
    return False


def _memory_bytes() -> Optional[int]:
    try:
        import psutil

        return psutil.virtual_memory().available
    except ImportError:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _tiers(rows: list[Row], config: KvbmConfig) -> None:
    if not config.has_host and not config.has_disk:
        rows.append(Row("tiers", "FAIL", "no tier configured: set DYN_KVBM_CPU_CACHE_GB and/or DYN_KVBM_DISK_CACHE_GB"))
        return
    if config.cpu_cache_blocks is not None:
        rows.append(Row("host tier", "info", f"{config.cpu_cache_blocks} blocks (size depends on the model's page)"))
    elif config.cpu_cache_gb is not None:
        available = _memory_bytes()
        need = config.cpu_cache_gb * GIB
        detail = f"{config.cpu_cache_gb:g} GiB of {available / GIB:.1f} GiB available"
        if available is not None and need > available:
            rows.append(Row("host tier", "FAIL", detail + ": lower DYN_KVBM_CPU_CACHE_GB"))
        elif available is not None and need > 0.8 * available:
            rows.append(Row("host tier", "warn", detail + ": leaves little for the server itself"))
        else:
            rows.append(Row("host tier", "ok", detail))
    else:
        rows.append(Row("host tier", "info", "off (disk only: pages go from the device straight to disk)"))
    if config.has_disk:
        _disk(rows, config)


def _disk(rows: list[Row], config: KvbmConfig) -> None:
    from sglang_kvbm.backends.local.disk_setup import probe

    need = int((config.disk_cache_gb or 0) * GIB)
    try:
        found = probe(
            config.disk_cache_dir,
            need,
            zerofill_fallback=config.disk_zerofill_fallback,
            disable_o_direct=config.disk_disable_o_direct,
        )
    except ConfigError as exc:
        rows.append(Row("disk tier", "FAIL", str(exc)))
        return
    size = f"{config.disk_cache_gb:g} GiB" if config.disk_cache_gb else f"{config.disk_cache_blocks} blocks"
    rows.append(Row("disk tier", "ok", f"{size} in {found.directory}, {found.free_bytes / GIB:.1f} GiB free"))
    rows.append(Row("disk preallocation", "ok", found.preallocate))
    rows.append(Row("disk O_DIRECT", "ok", "on" if found.o_direct else "off (DYN_KVBM_DISK_DISABLE_O_DIRECT)"))
    rows.append(
        Row("disk bandwidth", "info", f"{found.write_bytes_per_s / 1e9:.2f} GB/s write, {found.read_bytes_per_s / 1e9:.2f} GB/s read (4 MiB probe)")
    )
    try:
        import nixl  # noqa: F401
    except ImportError:
        rows.append(Row("disk NIXL", "FAIL", "the disk tier needs NIXL: pip install 'sglang-kvbm[disk]'"))


def diagnose(environ=None) -> list[Row]:
    environ = os.environ if environ is None else environ
    rows: list[Row] = []
    _versions(rows)
    _cuda(rows)
    try:
        config = KvbmConfig.from_env(environ)
    except ConfigError as exc:
        rows.append(Row("configuration", "FAIL", str(exc)))
        return rows
    set_vars = sorted(k for k in environ if k.startswith(("DYN_KVBM_", "SGLANG_KVBM_")))
    rows.append(Row("configuration", "ok", ", ".join(f"{k}={environ[k]}" for k in set_vars) or "nothing set"))
    rows.append(Row("backend", "ok", "local (host memory and disk through NIXL; events on SGLang's stream)"))
    _tiers(rows, config)
    if config.metrics:
        rows.append(Row("metrics", "ok", f"http://{config.http_host}:{config.metrics_port}/metrics"))
    return rows


def render(rows: list[Row], out: TextIO) -> None:
    width = max(len(r.check) for r in rows)
    columns = shutil.get_terminal_size((120, 20)).columns
    for row in rows:
        line = f"{row.check:<{width}}  {row.status:<4}  {row.detail}"
        print(line if len(line) <= columns or not out.isatty() else line[: columns - 1], file=out)


def main(out: TextIO) -> int:
    rows = diagnose()
    render(rows, out)
    problems = [r for r in rows if r.status == "FAIL"]
    print(f"\n{len(problems)} problem(s)" if problems else "\nready", file=out)
    return 1 if problems else 0
