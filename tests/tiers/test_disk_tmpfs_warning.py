"""The disk tier warns at start-up when DYN_KVBM_DISK_CACHE_DIR is on tmpfs/ramfs (memory, not disk) or the default
/tmp, on real directories: /dev/shm is tmpfs on Linux, the repository's build/ directory is on a disk filesystem.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from sglang_kvbm.base.values import ConfigError
from sglang_kvbm.tiers.disk import setup
from sglang_kvbm.tiers.disk.setup import memory_filesystem, placement_warnings, probe, warn_placement

REPO = Path(__file__).resolve().parents[2]
SHM = Path("/dev/shm")


def _unescape(field: str) -> str:
    """A mountinfo path field: space, tab, newline and backslash are written as octal escapes."""
    for code in ("\\040", "\\011", "\\012", "\\134"):
        field = field.replace(code, chr(int(code[1:], 8)))
    return field


def mount_fstype(path: str | Path) -> str | None:
    """An oracle independent of statfs: the type of the mount whose point is the longest prefix of ``path``."""
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return None
    target = os.path.realpath(path)
    best, fstype = -1, None
    for line in lines:
        before, _, after = line.partition(" - ")
        point = _unescape(before.split()[4])
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= best:  # a later mount on the same point hides the earlier one
            best, fstype = len(point), after.split()[0]
    return fstype


@pytest.fixture
def fresh(monkeypatch):
    """Each test starts as a fresh process: nothing warned yet."""
    monkeypatch.setattr(setup, "_warned", set())


@pytest.fixture
def shm_dir():
    if not SHM.is_dir() or mount_fstype(SHM) != "tmpfs":
        pytest.skip("/dev/shm is not a tmpfs here")
    path = Path(tempfile.mkdtemp(prefix="kvbm-tmpfs-test-", dir=SHM))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def disk_dir():
    """A directory on a disk filesystem: the repository's build/ (tmp_path is tmpfs where /tmp is)."""
    (REPO / "build").mkdir(exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix="kvbm-disk-test-", dir=REPO / "build"))
    if mount_fstype(path) in ("tmpfs", "ramfs", None):
        shutil.rmtree(path)
        pytest.skip(f"the repository is on {mount_fstype(path)}, not a disk")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def ours(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name.startswith("sglang_kvbm") and r.levelno >= logging.WARNING]


def test_statfs_agrees_with_the_mount_table(shm_dir, disk_dir, tmp_path):
    for path in (shm_dir, disk_dir, tmp_path, Path("/")):
        expected = mount_fstype(path)
        assert memory_filesystem(path) == (expected if expected in ("tmpfs", "ramfs") else None), path
    assert memory_filesystem(shm_dir / "not" / "made" / "yet") == "tmpfs"  # its nearest existing parent's


def test_tmpfs_warns_with_the_variable_and_the_fix(fresh, shm_dir, caplog):
    with caplog.at_level(logging.WARNING, logger="sglang_kvbm"):
        warn_placement(shm_dir)
    [line] = ours(caplog)
    assert f"DYN_KVBM_DISK_CACHE_DIR={str(shm_dir)!r}" in line and "is on tmpfs" in line
    assert "memory, not disk" in line and "Set DYN_KVBM_DISK_CACHE_DIR to a directory on a local SSD" in line
    assert "(the default)" not in line


def test_a_disk_directory_does_not_warn(fresh, disk_dir, caplog):
    with caplog.at_level(logging.WARNING, logger="sglang_kvbm"):
        assert warn_placement(disk_dir) == []
        assert warn_placement(disk_dir / "made" / "later") == []
    assert ours(caplog) == []


def test_tmp_path_warns_only_if_it_is_memory(fresh, tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="sglang_kvbm"):
        warn_placement(tmp_path)
    assert len(ours(caplog)) == (mount_fstype(tmp_path) in ("tmpfs", "ramfs"))


def test_the_default_tmp_warns(fresh, caplog):
    with caplog.at_level(logging.WARNING, logger="sglang_kvbm"):
        warn_placement("/tmp")
    [line] = ours(caplog)
    assert "DYN_KVBM_DISK_CACHE_DIR" in line and "(the default)" in line and "local SSD" in line
    if mount_fstype("/tmp") in ("tmpfs", "ramfs"):
        assert f"is on {mount_fstype('/tmp')}, which is memory, not disk" in line
    else:
        assert "tmp cleaners" in line
    assert placement_warnings("/tmp/") == placement_warnings("/tmp")  # the same directory, however written


def test_once_per_process(fresh, shm_dir, caplog):
    with caplog.at_level(logging.WARNING, logger="sglang_kvbm"):
        assert len(warn_placement(shm_dir)) == 1
        assert warn_placement(shm_dir) == [] and warn_placement(str(shm_dir) + "/") == []
    assert len(ours(caplog)) == 1


def test_the_disk_tier_warns_at_start_up(fresh, stack_factory, shm_dir, caplog):
    # buffered: kernels before 6.6 refuse O_DIRECT on tmpfs, which the next test covers
    with caplog.at_level(logging.WARNING, logger="sglang_kvbm"):
        stack = stack_factory(disk_dir=shm_dir, host_blocks=4, disk_blocks=16, config={"disk_disable_o_direct": True})
        stack_factory(disk_dir=shm_dir, host_blocks=4, disk_blocks=16, config={"disk_disable_o_direct": True})
    assert "disk" in stack.manager.tiers  # it works: a warning, not a refusal
    [line] = [m for m in ours(caplog) if "DYN_KVBM_DISK_CACHE_DIR" in m]  # two builds, one warning
    assert "is on tmpfs" in line


def test_a_disk_directory_starts_without_the_warning(fresh, stack_factory, disk_dir, caplog):
    with caplog.at_level(logging.WARNING, logger="sglang_kvbm"):
        stack_factory(disk_dir=disk_dir, host_blocks=4, disk_blocks=16)
    assert not [m for m in ours(caplog) if "DYN_KVBM_DISK_CACHE_DIR" in m]


class _RefusingODirect:
    """``os`` for the probe, as a filesystem that refuses O_DIRECT (tmpfs before Linux 6.6) answers."""

    def __getattr__(self, name):
        return getattr(os, name)

    @staticmethod
    def open(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return os.open(path, flags, *args)


def test_o_direct_refused_on_tmpfs_names_both_fixes(shm_dir, monkeypatch):
    monkeypatch.setattr(setup, "os", _RefusingODirect())
    with pytest.raises(ConfigError) as raised:
        probe(shm_dir, 1 << 20, zerofill_fallback=True, disable_o_direct=False)
    message = str(raised.value)
    assert message.startswith("DYN_KVBM_DISK_CACHE_DIR rejects O_DIRECT I/O (Invalid argument): set "
                              "DYN_KVBM_DISK_DISABLE_O_DIRECT=true to use buffered I/O")
    assert "it is on tmpfs, which is memory, not disk" in message and "local SSD" in message
    probe(shm_dir, 1 << 20, zerofill_fallback=True, disable_o_direct=True)  # the first fix works


def test_o_direct_refused_on_disk_names_only_the_variable(disk_dir, monkeypatch):
    monkeypatch.setattr(setup, "os", _RefusingODirect())
    with pytest.raises(ConfigError, match="set DYN_KVBM_DISK_DISABLE_O_DIRECT=true to use buffered I/O$"):
        probe(disk_dir, 1 << 20, zerofill_fallback=True, disable_o_direct=False)


def test_the_real_kernel_on_tmpfs(shm_dir):
    """O_DIRECT on tmpfs: Linux 6.6 and later accept it; earlier ones refuse it, and the error names tmpfs."""
    try:
        found = probe(shm_dir, 1 << 20, zerofill_fallback=True, disable_o_direct=False)
    except ConfigError as exc:
        assert "DYN_KVBM_DISK_DISABLE_O_DIRECT=true" in str(exc) and "tmpfs" in str(exc)
    else:
        assert found.o_direct
