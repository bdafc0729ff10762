"""G3: blocks in preallocated files on local disk, moved through NIXL's POSIX backend.

Layout: a directory per server identity (model, page size, dtype, KV layout,
rank) under ``DYN_KVBM_DISK_CACHE_DIR``, holding segment files of fixed slots
(``header | block``) and an index. A server restarted with the same identity
finds its directory, index and blocks again; a server with another identity
never opens them (and removes directories no live server holds).

Fail closed: a read is verified (header and checksum, see ``disk_format``) in a
host staging buffer before one byte goes to the device. A block that fails is
invalidated and reported; the caller turns it into a miss. A segment file that
was deleted or replaced under us is retired whole and recreated.

Threads: bookkeeping (reserve, commit, invalidate, lookups) belongs to the
scheduler thread. :meth:`write` runs on the disk worker, :meth:`read` on the
scheduler thread; they use separate buffers, and the NIXL agent is created in
its thread-safe mode.
"""

from __future__ import annotations

import collections
import dataclasses
import fcntl
import logging
import os
import shutil
import struct
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

import msgspec
import torch
import xxhash

from sglang_kvbm.backends.local.disk_format import (
    FORMAT_VERSION,
    HEADER_BYTES,
    BlockHeader,
    HeaderTooLarge,
    checksum,
    decode_header,
    encode_header,
)
from sglang_kvbm.backends.local.disk_setup import DiskProbe, fallocate, zerofill
from sglang_kvbm.config import ConfigError
from sglang_kvbm.core.identity import BlockId
from sglang_kvbm.core.ports import BlockMeta
from sglang_kvbm.kv_layout import aligned_empty

logger = logging.getLogger(__name__)

SEGMENT_BYTES = 1 << 30
# Staging chunks: a NIXL transfer's worth of blocks. Reads are double-buffered, so
# smaller chunks overlap more of the read with the checksum and the copy: 8 MiB chunks
# read 1.0-1.3x as fast as 64 MiB ones (2 MiB pages, benchmarks/tier_io.py, CPU VM,
# three alternating runs; that disk is noisy).
# Writes are not (the disk thread is off the critical path) and want large transfers:
# 32-block chunks wrote 1.3-1.6x faster than 8 MiB ones there.
READ_STAGING_BYTES = 8 << 20
MAX_READ_STAGING_BLOCKS = 256
WRITE_STAGING_BLOCKS = 32
_INDEX_MAGIC = b"SGKVIDX\x01"
_INDEX_PREFIX = struct.Struct("<8sQ")
DIR_PREFIX = "sglang-kvbm-"


def _open_lock(directory: Path):
    """The directory's lock file, created 0600 like every file of the disk tier."""
    return os.fdopen(os.open(directory / "lock", os.O_RDWR | os.O_CREAT, 0o600), "r+")


class DiskIOError(RuntimeError):
    """A NIXL transfer to or from the disk cache failed."""


_RECORD_PREFIX = struct.Struct("<IQ")  # payload length, payload xxh3-64


class _JournalRecord(msgspec.Struct, array_like=True):
    """One change to the index since the last snapshot: add (slot, header), remove (block_id) or clear."""

    op: str
    slot: int = -1
    header: Optional[BlockHeader] = None
    block_id: str = ""


class _IndexEntry(msgspec.Struct, array_like=True):
    slot: int
    header: BlockHeader


class _IndexFile(msgspec.Struct, array_like=True):
    version: int
    fingerprint: bytes
    block_bytes: int
    num_slots: int
    entries: list[_IndexEntry]


@dataclasses.dataclass
class DiskEntry:
    slot: int
    header: BlockHeader

    @property
    def meta(self) -> BlockMeta:
        return self.header.meta()


@dataclasses.dataclass(frozen=True)
class Reservation:
    slot: int
    segment_generation: int
    meta: BlockMeta


@dataclasses.dataclass
class DiskStats:
    writes: int = 0
    written_blocks: int = 0
    write_failures: int = 0
    reads: int = 0
    read_blocks: int = 0
    read_bytes: int = 0
    read_seconds: float = 0.0
    invalidated: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    segments_recreated: int = 0
    segments_lost: int = 0


class _Segment:
    __slots__ = ("index", "path", "fd", "inode", "slots", "generation", "alive", "reg")

    def __init__(self, index: int, path: Path, slots: int) -> None:
        self.index = index
        self.path = path
        self.slots = slots
        self.fd = -1
        self.inode = -1
        self.generation = 0
        self.alive = False
        self.reg = None


class DiskStore:
    """Fixed-slot block storage in segment files, with an LRU index of registered blocks."""

    def __init__(
        self,
        *,
        probe: DiskProbe,
        num_slots: int,
        block_bytes: int,
        fingerprint: bytes,
        page_size: int,
        staging_blocks: Optional[int] = None,
    ) -> None:
        try:
            from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t
        except ImportError as exc:
            raise ConfigError(
                f"the disk tier (DYN_KVBM_DISK_CACHE_GB) moves blocks through NIXL, which is not installed "
                f"({exc}): pip install 'sglang-kvbm[disk]'"
            ) from None

        if num_slots <= 0:
            raise ValueError(f"num_slots must be positive, got {num_slots}")
        self.block_bytes = block_bytes
        self.header_bytes = self.header_bytes_for(page_size)
        self.slot_bytes = self.header_bytes + block_bytes
        self.num_slots = num_slots
        self.fingerprint = fingerprint
        self.o_direct = probe.o_direct
        self._preallocate = probe.preallocate
        self.stats = DiskStats()
        if staging_blocks is None:  # each direction its measured best (see the constants)
            self._read_staging = max(1, min(MAX_READ_STAGING_BLOCKS, READ_STAGING_BYTES // self.slot_bytes))
            self._write_staging = WRITE_STAGING_BLOCKS
        else:  # one size for both (tests use small chunks)
            self._read_staging = self._write_staging = max(1, staging_blocks)
        self._retired: list[BlockMeta] = []
        self._old_fds: list[int] = []

        self.directory, self._lock_file, warm = self._claim_directory(probe.directory, fingerprint)
        self._agent = nixl_agent(
            f"sglang-kvbm-disk-{os.getpid()}-{id(self):x}",
            nixl_agent_config(backends=[], sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT),
        )
        self._agent.create_backend("POSIX", {})

        per_file = max(1, min(num_slots, SEGMENT_BYTES // self.slot_bytes))
        self._per_file = per_file
        self._segments: list[_Segment] = []
        for k in range(-(-num_slots // per_file)):
            slots = min(per_file, num_slots - k * per_file)
            self._segments.append(_Segment(k, self.directory / f"seg-{k:04d}.kv", slots))
        for segment in self._segments:
            self._open_segment(segment)
        self._remove_extra_segments()

        # Separate staging for the two threads that do I/O; reads get two buffers, so
        # that the next chunk is read while the last one is verified and copied.
        self._read_buffers = [
            (aligned_empty((self._read_staging, self.header_bytes)), aligned_empty((self._read_staging, block_bytes)))
            for _ in range(2)
        ]
        self._write_headers = aligned_empty((self._write_staging, self.header_bytes))
        self.write_data = aligned_empty((self._write_staging, block_bytes))
        for tensor in (*(t for pair in self._read_buffers for t in pair), self._write_headers, self.write_data):
            self._agent.register_memory(tensor)

        self._entries: collections.OrderedDict[BlockId, DiskEntry] = collections.OrderedDict()  # first = LRU
        self._inflight: dict[BlockId, Reservation] = {}
        self._free: list[int] = []
        self._dirty = False
        self._last_persist = time.monotonic()
        restored = self._load_index() if warm else 0
        used = {e.slot for e in self._entries.values()}
        self._free = [s for s in range(num_slots - 1, -1, -1) if s not in used and self._slot_alive(s)]
        if restored:
            logger.info("kvbm: disk tier restored %d blocks from %s (each is verified when read)", restored, self.directory)
        journal_fd = os.open(self.directory / "journal", os.O_RDWR | os.O_CREAT, 0o600)
        self._journal = os.fdopen(journal_fd, "r+b")
        self._journal.seek(0, os.SEEK_END)
        self._journal_records = 0
        self._snapshot()  # compact what was restored; the journal starts empty

    @staticmethod
    def header_bytes_for(page_size: int) -> int:
        """Room for a page's token ids (msgpack, up to 9 bytes each) and its event identity, 4 KiB-aligned."""
        return -(-(1024 + 9 * page_size) // HEADER_BYTES) * HEADER_BYTES

    @staticmethod
    def existing_bytes(root: str | Path, fingerprint: bytes) -> int:
        """Disk space an earlier run with this identity already holds (reused, not needed again)."""
        path = Path(root) / (DIR_PREFIX + fingerprint.hex()[:16])
        if not path.is_dir():
            return 0
        return sum(f.stat().st_size for f in path.glob("seg-*.kv"))

    def register_dram(self, tensor: torch.Tensor) -> None:
        """Let NIXL move bytes to and from ``tensor`` (the host tier's slab)."""
        self._agent.register_memory(tensor)

    # -- directory and files ------------------------------------------------

    @staticmethod
    def _claim_directory(root: Path, fingerprint: bytes) -> tuple[Path, object, bool]:
        """This identity's directory, locked for this process; stale ones of other identities are removed."""
        name = DIR_PREFIX + fingerprint.hex()[:16]
        path = root / name
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
            path = root / f"{name}-{os.getpid()}"
            path.mkdir(mode=0o700, exist_ok=True)
            lock = _open_lock(path)
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            warm = False
        DiskStore._reclaim_stale(root, keep=path)
        return path, lock, warm

    @staticmethod
    def _reclaim_stale(root: Path, keep: Path) -> None:
        for other in root.glob(DIR_PREFIX + "*"):
            if other == keep or not other.is_dir() or not (other / "lock").exists():
                continue
            try:
                with _open_lock(other) as lock:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held: a live server owns it
                    shutil.rmtree(other)
                logger.info("kvbm: reclaimed %s, a disk cache of another server identity that no server holds", other)
            except (BlockingIOError, OSError):
                continue

    def _open_segment(self, segment: _Segment) -> None:
        flags = os.O_RDWR | os.O_CREAT | (os.O_DIRECT if self.o_direct else 0)
        fd = os.open(segment.path, flags, 0o600)
        try:
            size = segment.slots * self.slot_bytes
            current = os.fstat(fd).st_size
            if current > size:
                os.ftruncate(fd, size)
            elif current < size:
                if self._preallocate == "fallocate":
                    fallocate(fd, size)
                else:
                    zerofill(fd, size, o_direct=self.o_direct)
            reg = self._agent.register_memory([(0, size, fd, segment.path.name)], "FILE")
        except BaseException:
            os.close(fd)
            raise
        segment.fd = fd
        segment.inode = os.fstat(fd).st_ino
        segment.reg = reg
        segment.alive = True

    def _remove_extra_segments(self) -> None:
        for path in self.directory.glob("seg-*.kv"):
            if path not in {s.path for s in self._segments}:
                path.unlink(missing_ok=True)

    def _segment_of(self, slot: int) -> tuple[_Segment, int]:
        segment = self._segments[slot // self._per_file]
        return segment, (slot % self._per_file) * self.slot_bytes

    def _slot_alive(self, slot: int) -> bool:
        return self._segments[slot // self._per_file].alive

    def _check_segment(self, segment: _Segment) -> bool:
        """Whether the file behind ``segment`` is still the one we opened; if not, retire and recreate it."""
        if not segment.alive:
            return False
        try:
            same = os.stat(segment.path).st_ino == segment.inode
        except FileNotFoundError:
            same = False
        if same:
            return True
        self._retire_segment(segment, reason="file missing or replaced")
        return False

    def _retire_segment(self, segment: _Segment, *, reason: str) -> list[BlockMeta]:
        """Drop every block of a segment; recreate its file if the directory allows."""
        lost = [bid for bid, e in self._entries.items() if e.slot // self._per_file == segment.index]
        removed = self.invalidate(lost, reason=reason)
        segment.generation += 1
        segment.alive = False
        self._retired.extend(removed)
        # The old fd stays open until close(): a write to it may still be in flight.
        self._old_fds.append(segment.fd)
        segment.fd = -1
        first = segment.index * self._per_file
        seg_slots = set(range(first, first + segment.slots))
        self._free = [s for s in self._free if s not in seg_slots]
        try:
            self._open_segment(segment)
        except OSError as exc:
            self.stats.segments_lost += 1
            logger.error(
                "kvbm: disk segment %s lost (%s) and cannot be recreated (%s); the disk tier continues without it",
                segment.path, reason, exc.strerror,
            )
            return removed
        self.stats.segments_recreated += 1
        logger.warning("kvbm: disk segment %s %s; recreated it empty", segment.path, reason)
        self._free.extend(sorted(seg_slots, reverse=True))
        return removed

    # -- bookkeeping (scheduler thread) --------------------------------------

    def __len__(self) -> int:
        return len(self._entries)

    def holds(self, block_id: BlockId) -> bool:
        return block_id in self._entries or block_id in self._inflight

    def registered(self, block_id: BlockId) -> bool:
        return block_id in self._entries

    def touch(self, block_ids: Sequence[BlockId]) -> None:
        for block_id in reversed(block_ids):
            if block_id in self._entries:
                self._entries.move_to_end(block_id)

    def reserve(self, metas: Sequence[BlockMeta]) -> tuple[list[Reservation], list[BlockMeta]]:
        """Slots for these blocks, in order, evicting least-recently-used ones; stops at the first that finds none."""
        reserved: list[Reservation] = []
        evicted: list[BlockMeta] = []
        for meta in metas:
            if not self._free:
                if not self._entries:
                    break
                victim_id, victim = self._entries.popitem(last=False)
                evicted.append(victim.meta)
                self._free.append(victim.slot)
                self._log(_JournalRecord("del", block_id=victim_id))
            slot = self._free.pop()
            segment, _ = self._segment_of(slot)
            reservation = Reservation(slot, segment.generation, meta)
            self._inflight[meta.block_id] = reservation
            reserved.append(reservation)
        return reserved, evicted

    def commit(self, reserved: Sequence[Reservation], headers: Sequence[BlockHeader]) -> list[BlockMeta]:
        """The writes completed: register the blocks (those whose segment was not retired meanwhile)."""
        registered = []
        for reservation, header in zip(reserved, headers):
            self._inflight.pop(reservation.meta.block_id, None)
            segment, _ = self._segment_of(reservation.slot)
            if segment.generation != reservation.segment_generation:
                continue  # written into a file that has since been retired; the slot went with it
            self._entries[reservation.meta.block_id] = DiskEntry(reservation.slot, header)
            self._log(_JournalRecord("add", reservation.slot, header))
            registered.append(reservation.meta)
        return registered

    def abort(self, reserved: Sequence[Reservation]) -> None:
        for reservation in reserved:
            if self._inflight.get(reservation.meta.block_id) is reservation:
                del self._inflight[reservation.meta.block_id]
            segment, _ = self._segment_of(reservation.slot)
            if segment.generation == reservation.segment_generation and segment.alive:
                self._free.append(reservation.slot)

    def invalidate(self, block_ids: Sequence[BlockId], *, reason: str) -> list[BlockMeta]:
        """Remove blocks whose bytes cannot be trusted; returns the metas removed."""
        removed = []
        for block_id in block_ids:
            entry = self._entries.pop(block_id, None)
            if entry is None:
                continue
            self._free.append(entry.slot)
            removed.append(entry.meta)
            self.stats.invalidated[reason] += 1
            self._log(_JournalRecord("del", block_id=block_id))
        return removed

    def take_retired(self) -> list[BlockMeta]:
        """Blocks lost with retired segments since the last call (for the caller's removal events)."""
        retired, self._retired = self._retired, []
        return retired

    def entries(self, block_ids: Sequence[BlockId]) -> Optional[list[DiskEntry]]:
        out = []
        for block_id in block_ids:
            entry = self._entries.get(block_id)
            if entry is None:
                return None
            out.append(entry)
        return out

    def registered_metas(self) -> list[BlockMeta]:
        return [entry.meta for entry in self._entries.values()]

    def forget(self) -> None:
        for entry in self._entries.values():
            self._free.append(entry.slot)
        self._entries.clear()
        self._inflight.clear()  # their slots come back through abort() when the writes finish
        self._log(_JournalRecord("clear"))

    def free_slots(self) -> int:
        return len(self._free)

    def accounting(self) -> dict:
        """Where every slot is: registered, free, being written, or lost with a segment."""
        lost = sum(s.slots for s in self._segments if not s.alive)
        return {"slots": self.num_slots, "registered": len(self._entries), "free": len(self._free),
                "writing": len(self._inflight), "lost": lost}

    # -- I/O ------------------------------------------------------------------

    def write(self, reserved: Sequence[Reservation], rows: Sequence[torch.Tensor]) -> list[BlockHeader]:
        """Write blocks (disk worker thread). Returns their headers; raises :class:`DiskIOError`."""
        headers = []
        for start in range(0, len(reserved), self._write_staging):
            chunk = reserved[start : start + self._write_staging]
            local, remote = [], []
            for i, (reservation, row) in enumerate(zip(chunk, rows[start : start + len(chunk)])):
                header = BlockHeader.of(reservation.meta, checksum(row), self.fingerprint)
                try:
                    encode_header(header, self._write_headers[i])
                except HeaderTooLarge as exc:
                    raise DiskIOError(str(exc)) from None
                headers.append(header)
                self._describe(reservation.slot, self._write_headers[i], row, local, remote)
            self._transfer("WRITE", local, remote)
        self.stats.writes += 1
        self.stats.written_blocks += len(reserved)
        return headers

    def read(
        self,
        entries: Sequence[DiskEntry],
        consume: Callable[[torch.Tensor, int, int], None],
    ) -> list[tuple[int, str]]:
        """Read and verify blocks (scheduler thread), a staging chunk at a time.

        ``consume(data_rows, first, count)`` receives each verified chunk (rows
        ``0..count-1`` of ``data_rows``, valid until ``consume`` returns). Returns
        ``(index, reason)`` for the blocks that failed (nothing after the first
        failing chunk is consumed); the caller invalidates them.

        Reads are double-buffered: chunk k+1 is in flight while chunk k is
        verified and consumed, so the read overlaps the checksum and the copy.
        """
        for segment in {self._segment_of(e.slot)[0].index: self._segment_of(e.slot)[0] for e in entries}.values():
            self._check_segment(segment)
        started = time.perf_counter()
        step = self._read_staging
        chunks = [entries[start : start + step] for start in range(0, len(entries), step)]
        following = self._post_read(chunks[0], 0) if chunks else None
        try:
            for k, chunk in enumerate(chunks):
                headers, data = self._read_buffers[k % 2]
                pending, following = following, None
                if k + 1 < len(chunks):
                    following = self._post_read(chunks[k + 1], (k + 1) % 2)
                failed: dict[int, str] = {}
                try:
                    self._finish(pending)
                except DiskIOError:
                    for i, entry in enumerate(chunk):  # find which block(s) failed
                        try:
                            self._finish(self._post_read([entry], k % 2, first_row=i))
                        except DiskIOError:
                            failed[i] = "I/O error"
                for i, entry in enumerate(chunk):
                    if i not in failed:
                        reason = self._verify(entry, headers[i], data[i])
                        if reason is not None:
                            failed[i] = reason
                if failed:
                    start = k * step
                    return [(start + i, reason) for i, reason in sorted(failed.items())]
                consume(data, k * step, len(chunk))
        finally:
            self._abandon(following)  # a read still in flight must land before its buffer is reused
        self.stats.reads += 1
        self.stats.read_blocks += len(entries)
        self.stats.read_bytes += len(entries) * self.slot_bytes
        self.stats.read_seconds += time.perf_counter() - started
        return []

    def _post_read(self, entries: Sequence[DiskEntry], buffer: int, first_row: int = 0):
        """Start reading ``entries`` into read buffer ``buffer`` from row ``first_row`` on.

        Returns the transfer, or the error that kept it from starting (raised by :meth:`_finish`).
        """
        headers, data = self._read_buffers[buffer]
        rows = range(first_row, first_row + len(entries))
        headers[rows.start : rows.stop].zero_()  # a read that moves nothing cannot pass for a good one
        local, remote = [], []
        try:
            for entry, i in zip(entries, rows):
                segment = self._segment_of(entry.slot)[0]
                if not segment.alive:
                    raise DiskIOError(f"segment {segment.path.name} is gone")
                self._describe(entry.slot, headers[i], data[i], local, remote)
            return self._post("READ", local, remote)
        except DiskIOError as exc:
            return exc

    def _describe(self, slot: int, header_row: torch.Tensor, data_row: torch.Tensor, local: list, remote: list) -> None:
        """Append one slot's header and block, memory side and file side, to a transfer's descriptors."""
        segment, offset = self._segment_of(slot)
        local += [(header_row.data_ptr(), self.header_bytes, 0), (data_row.data_ptr(), self.block_bytes, 0)]
        remote += [(offset, self.header_bytes, segment.fd), (offset + self.header_bytes, self.block_bytes, segment.fd)]

    def _verify(self, entry: DiskEntry, header_row: torch.Tensor, data_row: torch.Tensor) -> Optional[str]:
        """None if the staging rows hold exactly ``entry``'s block, else why not."""
        header = decode_header(header_row)
        if header is None:
            return "bad header"
        if header.fingerprint != self.fingerprint or header.block_id != entry.header.block_id:
            return "wrong block"
        if header.checksum != entry.header.checksum or checksum(data_row) != header.checksum:
            return "checksum mismatch"
        return None

    def _transfer(self, op: str, local: list, remote: list) -> None:
        self._finish(self._post(op, local, remote))

    def _post(self, op: str, local: list, remote: list):
        """Start a transfer; returns ``(op, handle, state)`` for :meth:`_finish`."""
        agent = self._agent
        try:
            handle = agent.initialize_xfer(
                op, agent.get_xfer_descs(local, "DRAM"), agent.get_xfer_descs(remote, "FILE"), agent.name
            )
        except Exception as exc:  # NIXL raises its own error types
            raise DiskIOError(f"{op} could not be set up: {exc!r}") from None
        try:
            state = agent.transfer(handle)
        except Exception as exc:
            agent.release_xfer_handle(handle)
            raise DiskIOError(f"{op} could not be started: {exc!r}") from None
        if state not in ("PROC", "DONE"):
            agent.release_xfer_handle(handle)
            raise DiskIOError(f"{op} failed ({state})")
        return op, handle, state

    def _finish(self, posted) -> None:
        """Wait for a posted transfer and release it; raises :class:`DiskIOError` if it failed."""
        if isinstance(posted, DiskIOError):
            raise posted
        op, handle, state = posted
        agent = self._agent
        try:
            wait = 20e-6
            while state == "PROC":
                time.sleep(wait)
                wait = min(wait * 2, 1e-3)
                state = agent.check_xfer_state(handle)
            if state != "DONE":
                raise DiskIOError(f"{op} failed ({state})")
        finally:
            agent.release_xfer_handle(handle)

    def _abandon(self, posted) -> None:
        """Wait out a read whose data is no longer wanted (its buffer must not be written later)."""
        if posted is not None:
            try:
                self._finish(posted)
            except DiskIOError:
                pass

    # -- persistence ----------------------------------------------------------

    def _load_index(self) -> int:
        """Snapshot plus journal from the last run; anything unreadable is discarded, never trusted."""
        path = self.directory / "index.msgpack"
        owners: dict[int, BlockId] = {}
        if path.exists():
            try:
                raw = path.read_bytes()
                magic, digest = _INDEX_PREFIX.unpack_from(raw)
                payload = raw[_INDEX_PREFIX.size :]
                if magic != _INDEX_MAGIC or xxhash.xxh3_64_intdigest(payload) != digest:
                    raise ValueError("bad magic or checksum")
                index = msgspec.msgpack.decode(payload, type=_IndexFile)
                if (index.version, index.fingerprint, index.block_bytes) != (
                    FORMAT_VERSION, self.fingerprint, self.block_bytes,
                ):
                    raise ValueError("written by another configuration")
                for entry in index.entries:
                    self._restore(entry.slot, entry.header, owners)
            except (OSError, ValueError, struct.error, msgspec.DecodeError) as exc:
                logger.warning("kvbm: discarded the disk index %s (%s); the disk tier starts empty", path, exc)
                self._entries.clear()
                owners.clear()
                (self.directory / "journal").unlink(missing_ok=True)
        replayed = self._replay_journal(owners)
        if replayed:
            logger.info("kvbm: replayed %d disk index changes from the journal", replayed)
        return len(self._entries)

    def _restore(self, slot: int, header: BlockHeader, owners: dict[int, BlockId]) -> None:
        if not 0 <= slot < self.num_slots or header.fingerprint != self.fingerprint:
            return
        previous = owners.get(slot)  # a slot holds one block: the later record wins
        if previous is not None:
            self._entries.pop(previous, None)
        old = self._entries.pop(header.block_id, None)
        if old is not None:
            owners.pop(old.slot, None)
        self._entries[header.block_id] = DiskEntry(slot, header)
        owners[slot] = header.block_id

    def _replay_journal(self, owners: dict[int, BlockId]) -> int:
        path = self.directory / "journal"
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return 0
        offset = count = 0
        while offset + _RECORD_PREFIX.size <= len(raw):
            length, digest = _RECORD_PREFIX.unpack_from(raw, offset)
            payload = raw[offset + _RECORD_PREFIX.size : offset + _RECORD_PREFIX.size + length]
            if len(payload) != length or xxhash.xxh3_64_intdigest(payload) != digest:
                logger.warning("kvbm: the disk index journal ends in a torn or corrupt record; ignoring the rest")
                break
            try:
                record = msgspec.msgpack.decode(payload, type=_JournalRecord)
            except msgspec.DecodeError:
                break
            if record.op == "add" and record.header is not None:
                self._restore(record.slot, record.header, owners)
            elif record.op == "del":
                entry = self._entries.pop(record.block_id, None)
                if entry is not None:
                    owners.pop(entry.slot, None)
            elif record.op == "clear":
                self._entries.clear()
                owners.clear()
            offset += _RECORD_PREFIX.size + length
            count += 1
        return count

    def _log(self, record: _JournalRecord) -> None:
        payload = msgspec.msgpack.encode(record)
        self._journal.write(_RECORD_PREFIX.pack(len(payload), xxhash.xxh3_64_intdigest(payload)) + payload)
        self._journal_records += 1
        self._dirty = True

    def persist(self, force: bool = False, interval: float = 60.0) -> None:
        """Flush the journal; compact it into a snapshot when forced, or when it is long and old."""
        if not self._dirty:
            return
        try:
            self._journal.flush()
        except OSError as exc:
            logger.warning("kvbm: could not append to the disk index journal (%s)", exc.strerror)
        now = time.monotonic()
        if force or (self._journal_records > 4 * max(1024, len(self._entries)) and now - self._last_persist > interval):
            self._snapshot()
            self._last_persist = now
        self._dirty = False

    def _snapshot(self) -> None:
        index = _IndexFile(
            FORMAT_VERSION,
            self.fingerprint,
            self.block_bytes,
            self.num_slots,
            [_IndexEntry(e.slot, e.header) for e in self._entries.values()],
        )
        payload = msgspec.msgpack.encode(index)
        path = self.directory / "index.msgpack"
        tmp = path.with_suffix(".tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(_INDEX_PREFIX.pack(_INDEX_MAGIC, xxhash.xxh3_64_intdigest(payload)))
                f.write(payload)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            self._journal.truncate(0)
            self._journal.seek(0)
            self._journal_records = 0
        except OSError as exc:
            logger.warning("kvbm: could not write the disk index %s (%s)", path, exc.strerror)

    def close(self) -> None:
        self._dirty = True
        self.persist(force=True)
        self._journal.close()
        for fd in [s.fd for s in self._segments if s.fd >= 0] + self._old_fds:
            os.close(fd)
        for segment in self._segments:
            segment.fd = -1
        self._old_fds.clear()
        self._lock_file.close()
