"""Blocks to and from their disk slots: headers, checksums, pipelined NIXL transfers, verification.

A slot is ``header | block``. A write builds each block's header (id, server
identity, xxh3 of the bytes) on the writer thread while the previous chunk is
in flight, and writes header and block in one transfer. A read lands header
and block in host rows and is verified (header intact, same identity, same
block, checksum of the bytes) while the next chunk is in flight; a chunk that
fails as a whole is retried block by block to find the blocks at fault.
A block whose header cannot fit its row (a cache_salt or LoRA name too long)
is left out of the write: its header comes back None, and it stays a miss.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from typing import Optional, Sequence

import torch

from sglang_kvbm.core.pages import Page
from sglang_kvbm.tiers.disk.nixl_io import DiskIOError
from sglang_kvbm.tiers.disk.slot_index import DiskEntry, Reservation
from sglang_kvbm.tiers.format import (
    BlockHeader,
    HeaderTooLarge,
    checksum,
    decode_header,
    encode_header,
    header_fits,
)

# ``store`` below is the ``store.DiskStore`` whose slots are moved (its segments, io, identity, stats).

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class DiskStats:
    writes: int = 0
    written_blocks: int = 0
    write_failures: int = 0
    headers_too_large: int = 0  # blocks not written: their header did not fit
    reads: int = 0
    read_blocks: int = 0
    read_bytes: int = 0
    read_seconds: float = 0.0
    invalidated: collections.Counter = dataclasses.field(default_factory=collections.Counter)


def _descriptors(store, slot: int, header_row: torch.Tensor, data_row: torch.Tensor, local, remote):
    fd, offset = store.segments.address(slot)
    if fd < 0:
        raise DiskIOError(f"the segment of slot {slot} is gone")
    local += [(header_row.data_ptr(), store.header_bytes, 0), (data_row.data_ptr(), store.block_bytes, 0)]
    remote += [(offset, store.header_bytes, fd), (offset + store.header_bytes, store.block_bytes, fd)]


def write_blocks(
    store,
    reserved: Sequence[Reservation],
    metas: Sequence[Page],
    rows: Sequence[torch.Tensor],
    header_buffer: torch.Tensor,
    chunk: int,
    depth: int,
) -> list[Optional[BlockHeader]]:
    """Write each block's header and bytes into its reserved slot; raises :class:`DiskIOError` on any failure.

    Returns the headers in order, None for a block left out because its header does not fit.
    """
    headers: list[Optional[BlockHeader]] = [None] * len(reserved)
    fits = [header_fits(metas[i], store.fingerprint, store.header_bytes) for i in range(len(reserved))]
    todo = [i for i, ok in enumerate(fits) if ok]
    if len(todo) < len(reserved):
        _header_too_large(store, [metas[i] for i, ok in enumerate(fits) if not ok])
    count = -(-len(todo) // chunk)
    failure: list[DiskIOError] = []

    def prepare(k: int):
        local, remote = [], []
        base = (k % depth) * chunk  # `depth` chunks in flight, each with its own part of the header buffer
        for j, i in enumerate(todo[k * chunk : (k + 1) * chunk]):
            header = BlockHeader.of(metas[i], checksum(rows[i]), store.fingerprint)
            try:
                encode_header(header, header_buffer[base + j])
            except HeaderTooLarge as exc:  # cannot happen (header_fits is an upper bound); never write a bad header
                raise DiskIOError(str(exc)) from None
            headers[i] = header
            _descriptors(store, reserved[i].slot, header_buffer[base + j], rows[i], local, remote)
        return local, remote

    def done(k: int, error: Optional[DiskIOError]) -> None:
        if error is not None:
            failure.append(error)

    store.io.pipeline("WRITE", count, prepare, done, depth=depth)
    if failure:
        store.stats.write_failures += 1
        raise failure[0]
    store.stats.writes += 1
    store.stats.written_blocks += len(todo)
    return headers


def _header_too_large(store, metas: Sequence[Page]) -> None:
    """Count blocks left out of a write; the first time, say why (once per store, not once per write)."""
    if not store.stats.headers_too_large:
        names = tuple(len((s or "").encode()) for s in (metas[0].cache_salt, metas[0].lora_name))
        logger.warning(
            "kvbm: block %s is not written to disk: its header (%d tokens, a cache_salt of %d bytes, a lora_name of "
            "%d bytes) does not fit the %d-byte disk header; blocks like it stay off disk (a miss), counted in "
            "headers_too_large, without another log line",
            metas[0].block_id[:16], len(metas[0].token_ids), *names, store.header_bytes,
        )
    store.stats.headers_too_large += len(metas)


def read_blocks(
    store,
    entries: Sequence[DiskEntry],
    data_rows: Sequence[torch.Tensor],
    header_rows: Sequence[torch.Tensor],
    chunk: int,
    depth: int,
) -> list[tuple[int, str]]:
    """Read blocks into host rows and verify them; ``(index, reason)`` of every block that failed."""
    import time

    started = time.perf_counter()
    failed: dict[int, str] = {}
    count = -(-len(entries) // chunk)

    def span(k: int) -> range:
        return range(k * chunk, min(len(entries), (k + 1) * chunk))

    def prepare_rows(indices) -> tuple[list, list]:
        local, remote = [], []
        for i in indices:
            header_rows[i].zero_()  # a read that moves nothing cannot pass for a good one
            _descriptors(store, entries[i].slot, header_rows[i], data_rows[i], local, remote)
        return local, remote

    def done(k: int, error: Optional[DiskIOError]) -> None:
        indices = span(k)
        if error is not None:  # find which block(s) failed
            for i in indices:
                try:
                    store.io.transfer("READ", *prepare_rows([i]))
                except DiskIOError:
                    failed[i] = "I/O error"
        for i in indices:
            if i not in failed:
                reason = verify(store, entries[i], header_rows[i], data_rows[i])
                if reason is not None:
                    failed[i] = reason

    store.io.pipeline("READ", count, lambda k: prepare_rows(span(k)), done, depth=depth)
    store.stats.reads += 1
    store.stats.read_blocks += len(entries) - len(failed)
    store.stats.read_bytes += len(entries) * store.slot_bytes
    store.stats.read_seconds += time.perf_counter() - started
    return sorted(failed.items())


def verify(store, entry: DiskEntry, header_row: torch.Tensor, data_row: torch.Tensor) -> Optional[str]:
    """None if the rows hold exactly ``entry``'s block, else why not."""
    header = decode_header(header_row)
    if header is None:
        return "bad header"
    if header.fingerprint != store.fingerprint or header.block_id != entry.header.block_id:
        return "wrong block"
    if header.checksum != entry.header.checksum or checksum(data_row) != header.checksum:
        return "checksum mismatch"
    return None
