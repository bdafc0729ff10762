"""Files named by their content: SHA-256 digests, cached so a restart does not read the weights again.

A model's identity must be the same on two hosts that hold the same bytes,
whatever the path or the mtimes, so every file that decides KV bytes is named by
the SHA-256 of its content. That is also how the Hugging Face cache names a
large file's blob (``blobs/<sha256>``), so a hub snapshot costs nothing to digest
and a local copy of it digests to the same names (small files, which the hub
names by git's SHA-1, are read: they are a few KB).

Reading a multi-GB model once is the price (SHA-256 runs at ~1.6 GB/s a core on
the project's CPU machine, files are read in parallel; `benchmarks/README.md`
has the figure for a first start). A digest is then cached by what identifies
the file's bytes on this host without reading them: device, inode, size and
mtime (ns), and ctime, which no ``touch`` can set back, so bytes rewritten in
place under a restored mtime are read again. The cache is a small JSON file
(``SGLANG_KVBM_DIGEST_CACHE``, default ``$XDG_CACHE_HOME/sglang-kvbm/digests.json``);
the ranks of one server take a file lock while they digest, so one reads the
weights and the others find its digests.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator, Optional, Sequence

logger = logging.getLogger(__name__)

CACHE_ENV = "SGLANG_KVBM_DIGEST_CACHE"
_CHUNK = 8 << 20
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_MAX_ENTRIES = 100_000  # files; past it the oldest half goes (a cache, not a record)


def default_cache_path() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "sglang-kvbm" / "digests.json"


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(view[:n])  # hashlib releases the GIL for large updates: files digest in parallel
    return digest.hexdigest()


def hub_blob_digest(path: Path) -> Optional[str]:
    """The SHA-256 a Hugging Face cache already names ``path``'s content by (a link into ``blobs/``), or None."""
    if not path.is_symlink():
        return None
    target = Path(os.path.realpath(path))
    if target.parent.name == "blobs" and _SHA256.match(target.name):
        return target.name
    return None


class DigestCache:
    """SHA-256 of files, remembered by (device, inode, size, mtime_ns, ctime_ns) in one JSON file."""

    def __init__(self, path: Optional[Path] = None) -> None:
        self.path = Path(path) if path is not None else default_cache_path()
        self.read_bytes = 0  # what this instance had to read (0 on a warm restart)
        self.read_seconds = 0.0

    def digests(self, files: Sequence[Path]) -> list[str]:
        """The content digest of each of ``files`` (symlinks followed), reading only those not known yet."""
        known = {f: hub_blob_digest(f) for f in files}
        rest = [f for f, d in known.items() if d is None]
        if rest:
            with self._locked() as entries:
                keys = {f: _stat_key(f) for f in rest}
                todo = [f for f in rest if keys[f] not in entries]
                if todo:
                    started = time.perf_counter()
                    with ThreadPoolExecutor(max_workers=max(1, min(8, os.cpu_count() or 1, len(todo)))) as pool:
                        for f, digest in zip(todo, pool.map(sha256_of, todo)):
                            entries[keys[f]] = digest
                    self.read_bytes += sum(f.stat().st_size for f in todo)
                    self.read_seconds += time.perf_counter() - started
                for f in rest:
                    known[f] = entries[keys[f]]
        return [known[f] for f in files]

    @contextlib.contextmanager
    def _locked(self) -> Iterator[dict]:
        """The cache's entries under an exclusive lock, written back (atomically) if they changed."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            lock = open(self.path.with_name(self.path.name + ".lock"), "a+")
        except OSError as exc:  # no cache: digests are still right, only read at every start
            logger.warning("kvbm: cannot use the content digest cache %s (%s): model files are read at every start; "
                           "set %s to a writable file", self.path, exc, CACHE_ENV)
            yield {}
            return
        with lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            entries = self._load()
            before = dict(entries)
            yield entries
            if entries != before:
                self._save(entries)

    def _load(self) -> dict:
        try:
            data = json.loads(self.path.read_text())
            if isinstance(data, dict) and all(isinstance(v, str) and _SHA256.match(v) for v in data.values()):
                return data
            logger.warning("kvbm: content digest cache %s is not what this library writes: starting it anew", self.path)
        except FileNotFoundError:
            pass
        except (OSError, ValueError) as exc:
            logger.warning("kvbm: content digest cache %s is unreadable (%s): starting it anew", self.path, exc)
        return {}

    def _save(self, entries: dict) -> None:
        if len(entries) > _MAX_ENTRIES:
            entries = dict(list(entries.items())[len(entries) // 2:])
        try:
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=self.path.name + ".")
            with os.fdopen(fd, "w") as f:
                json.dump(entries, f)
            os.replace(tmp, self.path)
        except OSError as exc:
            logger.warning("kvbm: could not write the content digest cache %s (%s)", self.path, exc)


def _stat_key(path: Path) -> str:
    st = path.stat()
    return f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"
