"""The disk tier's directory: one per server identity, locked while a server uses it.

``<DYN_KVBM_DISK_CACHE_DIR>/sglang-kvbm-<identity>/`` holds one identity's
segment files and index. A server restarted with the same identity finds its
directory again (a warm start); a second live server with the same identity
gets a private directory and starts cold; directories of other identities that
no live server holds are removed at start-up (except the ``keep`` identities the
same server claims next: a hybrid model's sidecar pools have disk tiers of their own). A server whose weights are
replaced in memory renames its directory to a new identity (:func:`move`). Everything is created 0700 / 0600,
and a directory others can write is refused.

Claiming, reclaiming and moving hold one lock per user on the root (``.sglang-kvbm-claims-<uid>.lock``): a
directory is created and locked in one step as seen by every other process of that user, so one starting beside
another (the TP ranks or PP stages of one server, each its own identity, start together) never takes a
directory that was just created, but not yet locked, for a stale one and removes it under its owner (seen: a
PP stage's segment file vanished at start-up).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
from pathlib import Path
from typing import IO, Iterator

from sglang_kvbm.base.values import ConfigError

logger = logging.getLogger(__name__)

DIR_PREFIX = "sglang-kvbm-"


def identity_dir(root: str | Path, fingerprint: bytes) -> Path:
    return Path(root) / (DIR_PREFIX + fingerprint.hex()[:16])


def existing_bytes(root: str | Path, fingerprint: bytes) -> int:
    """Disk space an earlier run with this identity already holds (reused, not needed again)."""
    path = identity_dir(root, fingerprint)
    if not path.is_dir():
        return 0
    return sum(f.stat().st_size for f in path.glob("seg-*.kv"))


def _open_lock(directory: Path) -> IO:
    """The directory's lock file, created 0600 like every file of the disk tier."""
    return os.fdopen(os.open(directory / "lock", os.O_RDWR | os.O_CREAT, 0o600), "r+")


@contextlib.contextmanager
def _claims(root: Path) -> Iterator[None]:
    """Hold this user's claims lock on ``root`` (a shared root such as /tmp has one per user)."""
    fd = os.open(Path(root) / f".{DIR_PREFIX}claims-{os.getuid()}.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def claim(root: Path, fingerprint: bytes, keep: tuple[bytes, ...] = ()) -> tuple[Path, IO, bool]:
    """This identity's directory, locked for this process, and whether it is a warm start (``keep``: other
    identities of this server, not reclaimed)."""
    with _claims(root):
        return _claim(root, fingerprint, keep)


def _claim(root: Path, fingerprint: bytes, keep: tuple[bytes, ...]) -> tuple[Path, IO, bool]:
    path = identity_dir(root, fingerprint)
    path.mkdir(mode=0o700, exist_ok=True)
    stat = path.stat()
    if stat.st_uid != os.getuid() or stat.st_mode & 0o022:
        raise ConfigError(
            f"DYN_KVBM_DISK_CACHE_DIR: {path} is writable by others or not owned by this user; "
            f"remove it (sglang-kvbm creates it 0700) or point DYN_KVBM_DISK_CACHE_DIR elsewhere"
        )
    lock = _open_lock(path)
    warm = True
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        logger.warning(
            "kvbm: %s is in use by another live server with the same identity; "
            "this server uses a private directory and starts with an empty disk tier",
            path,
        )
        path = path.with_name(f"{path.name}-{os.getpid()}")
        path.mkdir(mode=0o700, exist_ok=True)
        lock = _open_lock(path)
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        warm = False
    reclaim_stale(root, keep={path, *(identity_dir(root, f) for f in keep)})
    return path, lock, warm


def reclaim_stale(root: Path, keep: set[Path]) -> None:
    """Remove directories of other identities that no live server holds."""
    for other in root.glob(DIR_PREFIX + "*"):
        if other not in keep:
            _reclaim(other)


def _reclaim(other: Path) -> bool:
    """Remove ``other`` if it is a disk cache no live server holds; whether it is gone."""
    if not other.is_dir() or not (other / "lock").exists():
        return False
    try:
        with _open_lock(other) as lock:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises if a live server holds it
            shutil.rmtree(other)
        logger.info("kvbm: reclaimed %s, a disk cache of another server identity that no server holds", other)
        return True
    except (BlockingIOError, OSError):
        return False


def move(current: Path, fingerprint: bytes) -> Path:
    """Rename this server's (locked) directory to ``fingerprint``'s name; returns the new path.

    The lock, the open segment files and their registrations go with it (they
    name inodes, not paths). The old identity's name is then free: a server
    started on it later starts cold. A directory already under the new name is
    reclaimed if no live server holds it; otherwise this one takes a private name.
    """
    target = identity_dir(current.parent, fingerprint)
    if target == current:
        return current
    with _claims(current.parent):
        return _move(current, target)


def _move(current: Path, target: Path) -> Path:
    if target.exists() and not _reclaim(target):
        target = target.with_name(f"{target.name}-{os.getpid()}")
        if target.exists():  # a private directory this process left under that identity before
            shutil.rmtree(target)
    try:
        os.rename(current, target)
    except OSError as exc:  # the new fingerprint alone still keeps the old identity from reading (journal, headers)
        logger.warning("kvbm: could not rename the disk tier directory %s to %s (%s); it keeps its name",
                       current, target, exc.strerror)
        return current
    logger.info("kvbm: disk tier directory %s is now %s", current, target)
    return target
