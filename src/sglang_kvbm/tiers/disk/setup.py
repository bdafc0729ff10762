"""Start-up probe of the disk cache directory, and file preallocation.

What breaks disk caches in the field is the set-up: filesystems without
``fallocate`` (Lustre, some NFS), filesystems that reject ``O_DIRECT`` with
EINVAL, too little free space. :func:`probe` tries each on a scratch file in the
directory before anything is allocated, and either picks the fallback the
environment allows or fails with the variable to set.

What works but defeats the tier is warned about (:func:`warn_placement`): a
directory on tmpfs or ramfs (memory, not disk), or the default ``/tmp``.
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import logging
import mmap
import os
import stat as stat_module
import time
from pathlib import Path

from sglang_kvbm.base.progress import Progress
from sglang_kvbm.base.values import GIB, ConfigError

logger = logging.getLogger(__name__)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
_PROBE_BYTES = 4 << 20
_UNSUPPORTED = (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)
_libc.statfs.argtypes = [ctypes.c_char_p, ctypes.c_void_p]
# statfs(2)'s f_type (the first field of struct statfs, a C long on every Linux ABI) of the filesystems that
# keep their files in memory (linux/magic.h).
_MEMORY_FILESYSTEMS = {0x01021994: "tmpfs", 0x858458F6: "ramfs"}
DEFAULT_DIRECTORY = "/tmp"  # KvbmConfig.disk_cache_dir's default
_warned: set[str] = set()  # the directories warn_placement has warned about in this process


@dataclasses.dataclass(frozen=True)
class DiskProbe:
    directory: Path
    free_bytes: int
    preallocate: str  # "fallocate" or "zerofill"
    o_direct: bool
    write_bytes_per_s: float
    read_bytes_per_s: float


def fallocate(fd: int, length: int) -> None:
    """Reserve ``length`` bytes for ``fd`` with the fallocate syscall (no zero-writing emulation)."""
    if _libc.fallocate(fd, 0, 0, length) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def zerofill(fd: int, length: int, *, o_direct: bool) -> None:
    """Reserve ``length`` bytes by writing zeros through page-aligned buffers (O_DIRECT-safe)."""
    chunk = mmap.mmap(-1, 8 << 20)  # page-aligned and zeroed
    try:
        with Progress(length, "zero-filling a disk cache file") as progress:
            offset = 0
            while offset < length:
                n = min(len(chunk), length - offset)
                n = n if not o_direct else -(-n // 4096) * 4096
                written = os.pwritev(fd, [memoryview(chunk)[:n]], offset)
                if written <= 0:
                    raise OSError(errno.EIO, "zero-fill wrote nothing")
                offset += written
                progress.update(written)
    finally:
        chunk.close()


def probe(
    directory: str | Path,
    need_bytes: int,
    *,
    zerofill_fallback: bool,
    disable_o_direct: bool,
    already_ours: int = 0,
) -> DiskProbe:
    """Check ``directory`` can hold ``need_bytes`` of disk cache; raise :class:`ConfigError` if not.

    ``already_ours`` is what an earlier run of this server left there (reused, so not needed again).
    """
    path = Path(directory)
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            f"DYN_KVBM_DISK_CACHE_DIR={str(path)!r} cannot be created ({exc.strerror}): point it at a writable directory"
        ) from None
    if not path.is_dir():
        raise ConfigError(f"DYN_KVBM_DISK_CACHE_DIR={str(path)!r} is not a directory")
    mode = path.stat().st_mode
    if mode & stat_module.S_IWOTH and not mode & stat_module.S_ISVTX:
        raise ConfigError(
            f"DYN_KVBM_DISK_CACHE_DIR={str(path)!r} is writable by every user without the sticky bit, so another "
            f"user could replace the cache's files: use a directory only this user can write (or chmod o-w, or +t)"
        )

    stat = os.statvfs(path)
    free = stat.f_bavail * stat.f_frsize
    if free + already_ours < need_bytes:
        raise ConfigError(
            f"the disk cache needs {need_bytes / GIB:.2f} GiB but DYN_KVBM_DISK_CACHE_DIR={str(path)!r} has "
            f"{(free + already_ours) / GIB:.2f} GiB free: lower DYN_KVBM_DISK_CACHE_GB "
            f"(or DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS), or free space"
        )

    scratch = path / f".sglang-kvbm-probe-{os.getpid()}"
    try:
        fd = os.open(scratch, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    except OSError as exc:
        raise ConfigError(
            f"DYN_KVBM_DISK_CACHE_DIR={str(path)!r} is not writable ({exc.strerror}): point it at a writable directory"
        ) from None
    try:
        preallocate = _probe_fallocate(fd, zerofill_fallback)
        os.close(fd)
        fd = -1
        write_bw, read_bw = _probe_io(scratch, o_direct=not disable_o_direct)
    finally:
        if fd >= 0:
            os.close(fd)
        scratch.unlink(missing_ok=True)
    result = DiskProbe(path, free, preallocate, not disable_o_direct, write_bw, read_bw)
    logger.info(
        "kvbm: disk cache dir %s: %.1f GiB free, preallocation by %s, O_DIRECT %s, probe %.2f GB/s write %.2f GB/s read",
        path,
        free / GIB,
        preallocate,
        "on" if result.o_direct else "off",
        write_bw / 1e9,
        read_bw / 1e9,
    )
    return result


def memory_filesystem(directory: str | Path) -> str | None:
    """``"tmpfs"`` or ``"ramfs"`` when ``directory`` (or, not made yet, its nearest existing parent) is on one.

    From statfs(2) of the path itself, so a bind mount, a symlink or a mount namespace cannot mislead it; None
    on any other filesystem, or where statfs fails.
    """
    path = Path(os.path.abspath(directory))
    while not path.exists() and path != path.parent:
        path = path.parent
    buf = ctypes.create_string_buffer(512)  # struct statfs is 120 bytes on x86_64 and aarch64
    if _libc.statfs(os.fsencode(path), buf) != 0:
        return None
    return _MEMORY_FILESYSTEMS.get(ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF)


def placement_warnings(directory: str | Path) -> list[str]:
    """What is wrong with keeping the disk tier in ``directory``, though it works: tmpfs or ramfs, or ``/tmp``."""
    path = os.path.normpath(os.path.abspath(directory))
    default = path == DEFAULT_DIRECTORY
    fs = memory_filesystem(path)
    if fs is not None:
        return [
            f"kvbm: DYN_KVBM_DISK_CACHE_DIR={path!r}{' (the default)' if default else ''} is on {fs}, which is "
            f"memory, not disk: the disk tier's blocks would take RAM the host tier could use, and are gone at "
            f"reboot. Set DYN_KVBM_DISK_CACHE_DIR to a directory on a local SSD (e.g. /nvme/kvbm)"
        ]
    if default:
        try:
            where = "the root filesystem" if os.stat(path).st_dev == os.stat("/").st_dev else "a filesystem"
        except OSError:
            where = "a filesystem"
        return [
            f"kvbm: DYN_KVBM_DISK_CACHE_DIR is {DEFAULT_DIRECTORY} (the default), on {where} every program "
            f"shares, which tmp cleaners may empty: set DYN_KVBM_DISK_CACHE_DIR to a directory of its own on a "
            f"local SSD (e.g. /nvme/kvbm)"
        ]
    return []


def warn_placement(directory: str | Path) -> list[str]:
    """Log :func:`placement_warnings` of ``directory``, once per process (every worker's build calls it)."""
    key = os.path.normpath(os.path.abspath(directory))
    if key in _warned:
        return []
    _warned.add(key)
    found = placement_warnings(key)
    for line in found:
        logger.warning("%s", line)
    return found


def _probe_fallocate(fd: int, zerofill_fallback: bool) -> str:
    try:
        fallocate(fd, 1 << 20)
        return "fallocate"
    except OSError as exc:
        if exc.errno not in _UNSUPPORTED:
            raise ConfigError(f"DYN_KVBM_DISK_CACHE_DIR: fallocate failed ({exc.strerror})") from None
        if zerofill_fallback:
            return "zerofill"
        raise ConfigError(
            f"DYN_KVBM_DISK_CACHE_DIR is on a filesystem without fallocate ({exc.strerror}): "
            f"set DYN_KVBM_DISK_ZEROFILL_FALLBACK=true to preallocate by writing zeros"
        ) from None


def _probe_io(path: Path, *, o_direct: bool) -> tuple[float, float]:
    """Write and read back 4 MiB the way the disk tier will, and time both."""
    flags = os.O_RDWR | (os.O_DIRECT if o_direct else 0)
    buf = mmap.mmap(-1, _PROBE_BYTES)
    buf.write(os.urandom(4096) * (_PROBE_BYTES // 4096))
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        buf.close()
        raise _o_direct_error(exc, path) from None
    try:
        start = time.perf_counter()
        if os.pwritev(fd, [buf], 0) != _PROBE_BYTES:
            raise OSError(errno.EIO, "short write")
        os.fsync(fd)
        wrote = time.perf_counter() - start
        back = mmap.mmap(-1, _PROBE_BYTES)
        start = time.perf_counter()
        if os.preadv(fd, [back], 0) != _PROBE_BYTES:
            raise OSError(errno.EIO, "short read")
        read = time.perf_counter() - start
        if back[:] != buf[:]:
            raise ConfigError("DYN_KVBM_DISK_CACHE_DIR: bytes read back differ from the bytes written")
        back.close()
    except OSError as exc:
        raise _o_direct_error(exc, path) if o_direct and exc.errno == errno.EINVAL else ConfigError(
            f"DYN_KVBM_DISK_CACHE_DIR: test I/O failed ({exc.strerror})"
        ) from None
    finally:
        os.close(fd)
        buf.close()
    return _PROBE_BYTES / max(wrote, 1e-6), _PROBE_BYTES / max(read, 1e-6)


def _o_direct_error(exc: OSError, scratch: Path) -> ConfigError:
    fs = memory_filesystem(scratch.parent)
    better = (f", or better (it is on {fs}, which is memory, not disk) point DYN_KVBM_DISK_CACHE_DIR at a "
              f"directory on a local SSD" if fs else "")
    return ConfigError(
        f"DYN_KVBM_DISK_CACHE_DIR rejects O_DIRECT I/O ({exc.strerror}): "
        f"set DYN_KVBM_DISK_DISABLE_O_DIRECT=true to use buffered I/O{better}"
    )
