"""Every copy between tiers, in one place, keyed by (source, target).

Each function runs on the worker thread that owns its path and its buffers
(streams are created by the caller before the worker starts):

=====================  ==============================  ===================
(source, target)       function                        thread
=====================  ==============================  ===================
(DEVICE, HOST)         :func:`device_to_host_parts`    ``kvbm-offload``
(DEVICE, DISK)         :func:`device_to_disk`          ``kvbm-disk-write``
(HOST, DISK)           :func:`host_to_disk`            ``kvbm-disk-write``
(DISK, staging)        :func:`disk_to_staging`         ``kvbm-disk-read``
(staging, HOST)        :func:`staging_to_host`         ``kvbm-keep``
(HOST/staging, DEVICE) :func:`load_layer`              the engine's loader
=====================  ==============================  ===================

A disk block never goes straight to the device: it is read into a host staging
row and verified there first, then loaded like a host block.

On CUDA every copy runs on its worker's stream after the events it was handed
(the scheduler's stream computed the slots; the forward wrote the pages), and
everything computed from device slots (page numbers, their selection) is
computed there, after those waits (``PagedKvLayout.copying``).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Optional, Sequence

import torch

from sglang_kvbm.core.pages import Page
from sglang_kvbm.core.ports import StoreRequest
from sglang_kvbm.core.tiers import HOST
from sglang_kvbm.transfer.indexes import index, run_start, to_device
from sglang_kvbm.transfer.kv_layout import PagedKvLayout


def _pages(layout: PagedKvLayout, request: StoreRequest, positions: Sequence[int]) -> torch.Tensor:
    """The device pages at ``positions`` of a store (call inside ``layout.copying``: it reads device slots)."""
    if layout.is_cuda:
        request.pages.record_stream(torch.cuda.current_stream())  # made on the scheduler's stream, read on this one
    pages = layout.pages_of(request.pages)
    if len(positions) != pages.numel() or list(positions) != list(range(len(positions))):
        pages = pages.index_select(0, index(positions, pages.device))
    return pages


def device_to_host(layout, stream, request: StoreRequest, positions, slab, rows) -> tuple[tuple[Page, ...], float]:
    """Device pages into host rows; returns the pages' metas, built here, off the scheduler thread, as a tuple (the
    scheduler registers and announces them as they are: no copy touching each page there)."""
    started = time.perf_counter()
    with layout.copying(stream, request.ready):
        layout.save(_pages(layout, request, positions), slab, index(rows))
    seconds = time.perf_counter() - started
    return tuple(request.describe(positions)), seconds


def device_to_host_parts(layout, stream, parts, slab) -> None:
    """A step's device -> host copies, one job: each part's future gets its result, or its own error."""
    for future, request, positions, rows in parts:
        if not future.set_running_or_notify_cancel():
            continue
        try:
            future.set_result(device_to_host(layout, stream, request, positions, slab, rows))
        except BaseException as exc:  # one node's fault fails that node's copy only
            future.set_exception(exc)


def device_to_disk(layout, stream, disk, request: StoreRequest, positions, reserved) -> tuple[list[Page], list, float]:
    """Device pages to disk slots through the writer's staging rows (when no host row was free)."""
    started = time.perf_counter()
    metas = request.describe(positions)
    staging = disk.write_staging
    step = staging.shape[0]
    headers = []
    with layout.copying(stream, request.ready):
        pages = _pages(layout, request, positions)
        for start in range(0, len(reserved), step):
            n = min(step, len(reserved) - start)
            layout.save(pages[start : start + n], staging, torch.arange(n))
            headers += disk.write(reserved[start : start + n], metas[start : start + n], [staging[i] for i in range(n)])
    return metas, headers, time.perf_counter() - started


def host_to_disk(disk, reserved, metas, slab, rows) -> tuple[list, float]:
    started = time.perf_counter()
    headers = disk.write(reserved, metas, [slab[row] for row in rows])
    return headers, time.perf_counter() - started


def disk_to_staging(disk, entries, slab, header_slab, rows) -> tuple[list[tuple[int, str]], float]:
    """Disk slots into staging rows, verified; ``(index, reason)`` of the blocks that failed."""
    started = time.perf_counter()
    failed = disk.read(entries, [slab[row] for row in rows], [header_slab[row] for row in rows])
    return failed, time.perf_counter() - started


def staging_to_host(staging, staging_rows, slab, rows) -> float:
    """Staged blocks a load used into host rows (``manager.kept_reads``), one copy per run of rows consecutive on
    both sides (no temporary the size of the batch); the seconds it took."""
    started = time.perf_counter()
    n, i = len(rows), 0
    while i < n:
        j = i + 1
        while j < n and staging_rows[j] == staging_rows[j - 1] + 1 and rows[j] == rows[j - 1] + 1:
            j += 1
        slab[rows[i] : rows[i] + j - i].copy_(staging[staging_rows[i] : staging_rows[i] + j - i])
        i = j
    return time.perf_counter() - started


@dataclasses.dataclass(frozen=True)
class LoadBatch:
    """What one forward's loads copy, per source slab: rows there, device pages here."""

    # (slab, rows, pages, runs): runs as PagedKvLayout.load_layer takes them, found once per batch
    sources: tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[tuple]], ...]
    blocks: dict  # source ("host", "staging") -> blocks loaded from it
    nbytes: int


def load_batch(layout: PagedKvLayout, parts: Sequence[tuple[torch.Tensor, Sequence[int], torch.Tensor, str]]) -> LoadBatch:
    """Merge ``(slab, rows, device pages, source)`` parts into one batch, one entry per slab."""
    by_slab: dict[int, tuple[torch.Tensor, list, list]] = {}
    blocks = {HOST.name: 0, "staging": 0}
    for slab, rows, pages, tier in parts:
        if not len(rows):
            continue
        entry = by_slab.setdefault(id(slab), (slab, [], []))
        entry[1].append(rows)
        entry[2].append(pages)
        blocks[tier] += len(rows)
    sources = []
    for slab, parts_rows, pages in by_slab.values():  # each part's rows are one buffer (a pin's array('i'))
        rows = index(parts_rows[0]) if len(parts_rows) == 1 else torch.cat([index(r) for r in parts_rows])
        pages = torch.cat(pages)
        if layout.is_cuda:  # the pages are on the device: no run without a sync; the rows go there once, here
            runs = (run_start(rows), None)
            rows = rows if runs[0] is not None else to_device(rows, layout.device)
        else:
            runs = (run_start(rows), run_start(pages))
        sources.append((slab, rows, pages, runs))
    total = sum(blocks.values())
    return LoadBatch(tuple(sources), blocks, total * layout.page_bytes)


def load_layer(layout: PagedKvLayout, batch: LoadBatch, layer: int) -> None:
    """One layer of every block of ``batch`` into its device pages (CPU: landed; CUDA: enqueued on the current
    stream, inside ``layout.copying``)."""
    for slab, rows, pages, runs in batch.sources:
        layout.load_layer(layer, slab, rows, pages, runs=runs)
