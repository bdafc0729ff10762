"""The CUDA side of :class:`~sglang_kvbm.kv_layout.PagedKvLayout`'s copies: ordered by the stream, never by the host.

Each copy worker thread owns, from its start (:func:`start_worker`, the
thread's initializer): the device it copies on (``torch.cuda.set_device``:
without it a thread of a TP rank other than 0 creates a context on GPU 0), a
device staging buffer and two pinned host buffers of :data:`STAGING_BYTES`,
allocated before serving, so nothing is allocated or pinned mid-serving
outside SGLang's memory budget. Every copy is enqueued on the thread's current
stream (the worker's own, see ``PagedKvLayout.copying``):

* **device -> host** (:func:`save`): the pages of every buffer are gathered on
  the device into the staging buffer as *whole padded rows* (so the copy into
  the host slab is one contiguous, asynchronous DMA per chunk of consecutive
  rows; a slice of a row would be a strided, synchronous pageable copy), then
  copied to the slab (consecutive rows) or to a pinned buffer and scattered on
  the host. The worker waits for its own stream at the end: an offload is
  reported done only once its bytes are in host memory.
* **host -> device** (:func:`load`): a layer's columns of the rows are gathered
  on the host into a pinned buffer (double-buffered: the gather of the next
  chunk overlaps the DMA of the previous one, each buffer reused only after
  the event of its last DMA), copied to the device staging, and scattered into
  the pages with one ``index_copy_`` per buffer. Nothing waits for the device:
  the caller records the layer's event after it (see ``layer_counter``).

Imports torch only.
"""

from __future__ import annotations

import threading

import torch

from sglang_kvbm.kv_layout import run_start

STAGING_BYTES = 32 << 20  # per buffer: device staging, and each of the two pinned host buffers

_local = threading.local()


class _Staging:
    def __init__(self, device: torch.device, nbytes: int) -> None:
        self.device_buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.pinned = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        self.released = [None, None]  # event after the last DMA out of each pinned buffer
        self.turn = 0

    def next_pinned(self) -> tuple[torch.Tensor, int]:
        """The pinned buffer to fill next, once its previous DMA has ended (a wait on this worker only)."""
        i, self.turn = self.turn, 1 - self.turn
        if self.released[i] is not None:
            self.released[i].synchronize()
        return self.pinned[i], i

    def dma_issued(self, i: int) -> None:
        event = torch.cuda.Event()
        event.record()
        self.released[i] = event


def start_worker(device: torch.device, row_bytes: int = 0) -> None:
    """Thread initializer of a copy worker: its device, and its staging allocated now, not mid-serving
    (:data:`STAGING_BYTES`, or one block row where a row is larger)."""
    torch.cuda.set_device(device)
    _local.staging = _Staging(device, max(STAGING_BYTES, row_bytes))


def _staging(device: torch.device, row_bytes: int) -> _Staging:
    staging = getattr(_local, "staging", None)
    if staging is None or staging.device_buf.numel() < row_bytes:  # not started as a copy worker (tests, tools)
        start_worker(device, row_bytes)
        staging = _local.staging
    return staging


def _rows_per_chunk(staging: _Staging, row_bytes: int) -> int:
    return max(1, staging.device_buf.numel() // row_bytes)


def save(views, spans, wtype, block_words: int, host: torch.Tensor, rows: torch.Tensor, pages: torch.Tensor) -> None:
    """Device ``pages`` of every buffer into host ``rows`` (whole rows); returns when the bytes are there."""
    word = torch.empty((), dtype=wtype).element_size()
    staging = _staging(pages.device, block_words * word)
    step = _rows_per_chunk(staging, block_words * word)
    device_rows = staging.device_buf[: step * block_words * word].view(wtype).view(step, block_words)
    for start in range(0, rows.numel(), step):
        chunk_rows, chunk_pages = rows[start : start + step], pages[start : start + step]
        n = chunk_rows.numel()
        gathered = device_rows[:n]
        for view, (off, width) in zip(views, spans):
            gathered[:, off : off + width] = view.index_select(0, chunk_pages)
        r0 = run_start(chunk_rows)
        if r0 is not None:
            host[r0 : r0 + n].copy_(gathered, non_blocking=True)
            continue
        pinned, i = staging.next_pinned()
        landed = pinned[: n * block_words * word].view(wtype).view(n, block_words)
        landed.copy_(gathered, non_blocking=True)
        staging.dma_issued(i)
        staging.released[i].synchronize()  # the host scatter below reads what the DMA wrote
        host.index_copy_(0, chunk_rows, landed)
    torch.cuda.current_stream().synchronize()


def load(views, spans, wtype, host: torch.Tensor, rows: torch.Tensor, pages: torch.Tensor, buffers) -> None:
    """Host ``rows`` of ``buffers`` into device ``pages``, enqueued on the current stream (no wait for it).

    Staged buffer-major (each buffer's columns of the chunk's rows contiguous),
    so every host gather writes a contiguous output and every scatter on the
    device reads one.
    """
    word = torch.empty((), dtype=wtype).element_size()
    parts = [spans[b] for b in buffers]
    words = sum(width for _, width in parts)
    staging = _staging(pages.device, words * word)
    step = _rows_per_chunk(staging, words * word)
    for start in range(0, rows.numel(), step):
        chunk_rows, chunk_pages = rows[start : start + step], pages[start : start + step]
        n = chunk_rows.numel()
        pinned, i = staging.next_pinned()
        gathered = pinned[: n * words * word].view(wtype)
        at = 0
        for off, width in parts:  # this layer's columns of the rows, gathered on the host
            torch.index_select(host[:, off : off + width], 0, chunk_rows, out=gathered[at : at + n * width].view(n, width))
            at += n * width
        staged = staging.device_buf[: n * words * word].view(wtype)
        staged.copy_(gathered, non_blocking=True)
        staging.dma_issued(i)
        at = 0
        for b, (_, width) in zip(buffers, parts):
            views[b].index_copy_(0, chunk_pages, staged[at : at + n * width].view(n, width))
            at += n * width
