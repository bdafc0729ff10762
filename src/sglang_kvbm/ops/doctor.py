"""``sglang-kvbm doctor``: is this machine ready to serve with sglang-kvbm, and if not, why.

One table a person reads: versions, CUDA, the backend (``local``, the only one
today), every ``DYN_KVBM_*`` value, host memory and disk space against the
configured tiers, and the disk directory probed the way the server will probe
it; and each tier below it the configuration turns on, as that tier checks itself
(its ``kind.doctor_rows``: a store that answers, what listens where). Exit status 1 on a problem.

A tier sized in blocks (``DYN_KVBM_*_OVERRIDE_NUM_BLOCKS``) needs blocks times
the block size, which depends on the model and the page size, and the doctor
runs without either. Pass ``--block-bytes`` with the block size the server logs
at start-up (for an MHA model: layers x 2 x KV heads x head dim x dtype bytes x
page size, rounded up to 4 KiB) and the check is exact, failing like a tier
sized in GiB. Without it the doctor says so and checks against an assumed
2 MiB per block (an 8B Llama-class model, bf16, 16-token pages), warning, never
failing, when that would not fit. A disk block also takes a header sized from
the page (``format.header_bytes_for``: 4 KiB up to 341 tokens); the page size is
``page_size`` when given, else ``SGLANG_KVBM_ROUTER_BLOCK_SIZE`` (which must
equal it), else an assumed 16.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import re
import shutil
from importlib import metadata
from typing import Optional, TextIO

from sglang_kvbm.base.needs import DISTRIBUTION, installed, pip_install
from sglang_kvbm.base.versions import SUPPORTED_SGLANG, check_sglang_version
from sglang_kvbm.config import GIB, ConfigError, KvbmConfig
from sglang_kvbm.config.settings import hidden_variable
from sglang_kvbm.tiers import registry

MIB = 1 << 20
ASSUMED_BLOCK_BYTES = 2 * MIB
ASSUMED_PAGE_SIZE = 16


@dataclasses.dataclass
class Row:
    check: str
    status: str  # ok | warn | FAIL | info
    detail: str


def _version(dist: str) -> Optional[str]:
    """The installed version of ``dist`` (also its import name), or None when it cannot be imported: a package
    whose metadata is there but whose module is not counts as missing."""
    if not installed(dist):
        return None
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:  # importable without metadata (a source tree on the path)
        return "version unknown"


def _declared(dist: str) -> str:
    """``dist`` as this package's metadata requires it (``torch>=2.6``), or its bare name."""
    try:
        requirements = metadata.requires(DISTRIBUTION) or []
    except metadata.PackageNotFoundError:
        return dist
    for requirement in requirements:
        if re.match(rf"{re.escape(dist)}\s*(?:[<>=!~;]|$)", requirement) and "extra ==" not in requirement:
            return requirement.split(";")[0].strip()
    return dist


def _versions(rows: list[Row]) -> None:
    rows.append(Row("python", "info", platform.python_version()))
    sglang = _version("sglang")
    if sglang is None:
        rows.append(Row("sglang", "FAIL", f"not installed: pip install 'sglang{SUPPORTED_SGLANG}', or "
                        f"{pip_install('sglang')}"))
    else:
        try:
            check_sglang_version(sglang)
            rows.append(Row("sglang", "ok", sglang))
        except ConfigError as exc:
            rows.append(Row("sglang", "FAIL", str(exc)))
    fixes = {"torch": f"pip install '{_declared('torch')}'", "nixl": pip_install("disk"), "kvbm": None}
    for dist, why in (("torch", "required"), ("nixl", "disk tier"), ("kvbm", "kvbm backend (CUDA)")):
        version = _version(dist)
        if version:
            rows.append(Row(dist, "ok", version))
            continue
        fix = fixes[dist]
        rows.append(Row(dist, "FAIL" if why == "required" else "info",
                        f"not installed ({why})" + (f": {fix}" if fix else "")))


def _cuda(rows: list[Row]) -> bool:
    try:
        import torch
    except ImportError:
        rows.append(Row("cuda", "info", "not checked: torch is not installed"))
        return False
    if torch.cuda.is_available():
        rows.append(Row("cuda", "ok", f"{torch.cuda.get_device_name(0)} (torch CUDA {torch.version.cuda})"))
        return True
    rows.append(Row("cuda", "info", "no CUDA device: host memory is not pinned, copies use a worker thread"))
    return False


def _memory_bytes() -> Optional[int]:
    """Memory available to a new process: the kernel's own estimate (``MemAvailable``: free memory plus the page cache
    and reclaimable slabs it can take back), not the free pages alone (a machine that cached files looks full)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class _Need:
    """The bytes a tier takes (``size`` says how they were counted) and whether the block size was assumed."""

    def __init__(self, gib: Optional[float], blocks: Optional[int], block_bytes: Optional[int], header: int = 0):
        self.assumed = gib is None and block_bytes is None
        self.note = " (block size assumed: pass --block-bytes, the block size the server logs at start-up)" if (
            self.assumed) else ""
        if gib is not None:
            self.bytes = int(gib * GIB)
            self.size = f"{gib:g} GiB"
            return
        block = block_bytes or ASSUMED_BLOCK_BYTES
        self.bytes = (blocks or 0) * (block + header)
        per_block = _bytes(block) + (f" + {_bytes(header)} header" if header else "")
        self.size = f"{blocks} blocks of {per_block} = {self.bytes / GIB:.2f} GiB"


def _bytes(n: int) -> str:
    for unit, name in ((MIB, "MiB"), (1024, "KiB")):
        if n % unit == 0:
            return f"{n // unit} {name}"
    return f"{n} bytes"


def _tiers(rows: list[Row], config: KvbmConfig, block_bytes: Optional[int], page_size: Optional[int]) -> None:
    if not config.has_host and not config.has_disk:
        rows.append(Row("tiers", "FAIL", "no tier configured: set DYN_KVBM_CPU_CACHE_GB and/or DYN_KVBM_DISK_CACHE_GB"))
        return
    if config.has_host:
        # The block count wins over the size, as in the server.
        gib = None if config.cpu_cache_blocks is not None else config.cpu_cache_gb
        var = "DYN_KVBM_CPU_CACHE_GB" if gib is not None else "DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS"
        _host(rows, _Need(gib, config.cpu_cache_blocks, block_bytes), var)
    else:
        rows.append(Row("host tier", "info", "off (disk only: pages go from the device straight to disk)"))
    if config.has_disk:
        try:
            from sglang_kvbm.tiers.format import header_bytes_for
        except ImportError as exc:  # numpy, msgspec or xxhash missing: the install is broken
            rows.append(Row("disk tier", "FAIL", f"cannot size disk blocks ({exc}): reinstall sglang-kvbm "
                            f"(pip install --force-reinstall {DISTRIBUTION})"))
            return
        gib = None if config.disk_cache_blocks is not None else config.disk_cache_gb
        page_size = page_size or config.router_block_size or ASSUMED_PAGE_SIZE
        _disk(rows, config, _Need(gib, config.disk_cache_blocks, block_bytes, header_bytes_for(page_size)))


def _host(rows: list[Row], need: _Need, var: str) -> None:
    available = _memory_bytes()
    detail = need.size + (f" of {available / GIB:.1f} GiB available" if available is not None else "") + need.note
    if available is not None and need.bytes > available:
        rows.append(Row("host tier", "warn" if need.assumed else "FAIL", detail + f": lower {var}"))
    elif available is not None and need.bytes > 0.8 * available:
        rows.append(Row("host tier", "warn", detail + f": leaves little for the server itself; lower {var}"))
    else:
        rows.append(Row("host tier", "info" if need.assumed else "ok", detail))


def _disk(rows: list[Row], config: KvbmConfig, need: _Need) -> None:
    from sglang_kvbm.tiers.disk.setup import probe

    try:
        found = probe(
            config.disk_cache_dir,
            0 if need.assumed else need.bytes,  # an assumption warns below; it never fails the probe
            zerofill_fallback=config.disk_zerofill_fallback,
            disable_o_direct=config.disk_disable_o_direct,
        )
    except ConfigError as exc:
        rows.append(Row("disk tier", "FAIL", str(exc)))
        return
    rows.append(Row("disk tier", "ok", f"{need.size} in {found.directory}, {found.free_bytes / GIB:.1f} GiB free{need.note}"))
    if need.assumed and need.bytes > found.free_bytes:
        rows.append(Row(
            "disk space", "warn",
            f"{need.bytes / GIB:.2f} GiB at the assumed {_bytes(ASSUMED_BLOCK_BYTES)} per block would not fit "
            f"the {found.free_bytes / GIB:.1f} GiB free: pass --block-bytes to check exactly, lower "
            "DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS, or free space",
        ))
    rows.append(Row("disk preallocation", "ok", found.preallocate))
    rows.append(Row("disk O_DIRECT", "ok", "on" if found.o_direct else "off (DYN_KVBM_DISK_DISABLE_O_DIRECT)"))
    rows.append(
        Row("disk bandwidth", "info", f"{found.write_bytes_per_s / 1e9:.2f} GB/s write, {found.read_bytes_per_s / 1e9:.2f} GB/s read (4 MiB probe)")
    )
    try:
        import nixl  # noqa: F401
    except ImportError:
        rows.append(Row("disk NIXL", "FAIL", f"the disk tier needs NIXL: {pip_install('disk')}"))


def diagnose(environ=None, *, block_bytes: Optional[int] = None, page_size: Optional[int] = None) -> list[Row]:
    """The table's rows; ``block_bytes`` and ``page_size`` are those of the server, when known."""
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
    shown = (f"{k}=<hidden>" if hidden_variable(k) else f"{k}={environ[k]}" for k in set_vars)
    rows.append(Row("configuration", "ok", ", ".join(shown) or "nothing set"))  # credentials are not printed
    rows.append(Row("backend", "ok", "local (host memory and disk through NIXL; events on SGLang's stream)"))
    _tiers(rows, config, block_bytes, page_size)
    rows.extend(Row(*row) for row in registry.doctor_rows(config, environ))
    if config.metrics:
        rows.append(_endpoint(config))
    _dynamo_addresses(rows, config, environ)
    return rows


def _endpoint(config: KvbmConfig) -> Row:
    """What this library's endpoint binds, and who can reach it."""
    from sglang_kvbm.tiers.mooncake.address import loopback

    host, url = config.http_host, f"http://{config.http_host}:{config.metrics_port}/metrics"
    if loopback(host):
        return Row("metrics", "ok", f"{url}: binds loopback, this host only (SGLANG_KVBM_HTTP_HOST=<this host's "
                   "address> for a Prometheus on another host)")
    if host in ("0.0.0.0", "::"):
        return Row("metrics", "warn", f"{url}: binds every address of this machine (/stats and /tiers answer anyone who "
                   "reaches it): set SGLANG_KVBM_HTTP_HOST to the one address Prometheus scrapes")
    return Row("metrics", "ok", f"{url}: binds {host} only")


DYNAMO_ADDRESSES = ("DYN_TCP_RPC_HOST", "DYN_EVENT_PLANE_HOST", "DYN_SYSTEM_HOST", "SGLANG_HOST_IP")


def _dynamo_addresses(rows: list[Row], config: KvbmConfig, environ) -> None:
    """Under Dynamo: the addresses it binds and advertises (docs/fleet.md); loopback facing a G4 master elsewhere (a
    deployment across hosts) is a warning: peers on other hosts would reach themselves."""
    from sglang_kvbm.tiers.mooncake.address import loopback, split

    given = {name: environ[name] for name in DYNAMO_ADDRESSES if environ.get(name)}
    if not given:
        return
    shown = ", ".join(f"{k}={v}" for k, v in given.items())
    remote = config.mooncake_master is not None and not loopback(split(config.mooncake_master)[0])
    looped = [k for k, v in given.items() if loopback(v)]
    if remote and looped:
        rows.append(Row("Dynamo addresses", "warn", f"{shown}: {', '.join(looped)} is loopback while the G4 master is "
                        "on another host: set each to this host's own address (docs/fleet.md)"))
    else:
        rows.append(Row("Dynamo addresses", "info", f"{shown}: what Dynamo binds and advertises to the other hosts"))


def render(rows: list[Row], out: TextIO) -> None:
    width = max(len(r.check) for r in rows)
    columns = shutil.get_terminal_size((120, 20)).columns
    for row in rows:
        line = f"{row.check:<{width}}  {row.status:<4}  {row.detail}"
        print(line if len(line) <= columns or not out.isatty() else line[: columns - 1], file=out)


def main(out: TextIO, block_bytes: Optional[int] = None, page_size: Optional[int] = None) -> int:
    rows = diagnose(block_bytes=block_bytes, page_size=page_size)
    render(rows, out)
    problems = [r for r in rows if r.status == "FAIL"]
    print(f"\n{len(problems)} problem(s)" if problems else "\nready", file=out)
    return 1 if problems else 0
