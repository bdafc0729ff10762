"""A paged KV pool seen as bytes: page ``p`` of buffer ``i`` is one contiguous row.

An engine's KV pool is a list of per-layer buffers (K and V per layer for MHA,
one latent buffer per layer for MLA) whose leading axis is token slots (or whole
pages). :class:`PagedKvLayout` views each as ``(num_pages, page_bytes_i)`` and
moves whole pages between the pool and a host slab whose row is one *block*: the
page's bytes from every buffer, back to back, padded to 4 KiB so a block can go
to disk with O_DIRECT straight from the slab.

Copies are coalesced into runs where both the page and the slot index advance
by one, so a request's freshly allocated pages move in a few large copies.
"""

from __future__ import annotations

import weakref
from typing import Iterator, Optional, Sequence

import torch

BLOCK_ALIGN = 4096
_CUDA_STAGING_BYTES = 256 << 20  # device staging per chunk when copying on CUDA


def aligned_empty(shape: tuple[int, int], *, pin: bool = False) -> torch.Tensor:
    """An uninitialised uint8 tensor whose first byte is 4 KiB-aligned, page-locked if ``pin``.

    torch aligns host allocations to 64 bytes; O_DIRECT needs 4096, and NIXL's
    POSIX backend reports an unaligned O_DIRECT transfer as done without moving
    a byte, so alignment is guaranteed here rather than hoped for.

    Pinning gigabytes takes seconds: the pages are first touched a chunk at a
    time (with progress), then page-locked with one ``cudaHostRegister``.
    """
    nbytes = shape[0] * shape[1]
    raw = torch.empty(nbytes + BLOCK_ALIGN, dtype=torch.uint8)
    offset = (-raw.data_ptr()) % BLOCK_ALIGN
    tensor = raw[offset : offset + nbytes].view(shape)
    if pin:
        _pin(tensor)
    return tensor


def _pin(tensor: torch.Tensor) -> None:
    from sglang_kvbm.progress import Progress

    flat = tensor.view(-1)
    chunk = 256 << 20
    with Progress(flat.numel(), "pinning the host tier") as progress:
        for start in range(0, flat.numel(), chunk):
            part = flat[start : start + chunk]
            part.zero_()
            progress.update(part.numel())
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostRegister(tensor.data_ptr(), tensor.numel(), 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of {tensor.numel()} bytes failed with CUDA error {int(err)}")
    # Unregistered when the returned tensor goes (its owner keeps it for as long as it copies).
    weakref.finalize(tensor, cudart.cudaHostUnregister, tensor.data_ptr())


# Below this average run length, per-run copies cost more in calls than a gather does in bytes.
_GATHER_BELOW_RUN_LENGTH = 8


def _index(values: Sequence[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def runs(src: Sequence[int], dst: Sequence[int]) -> Iterator[tuple[int, int, int, int]]:
    """Yield ``(i, src_start, dst_start, length)`` for maximal runs where both advance by one."""
    n = len(src)
    i = 0
    while i < n:
        j = i + 1
        while j < n and src[j] == src[j - 1] + 1 and dst[j] == dst[j - 1] + 1:
            j += 1
        yield i, src[i], dst[i], j - i
        i = j


class PagedKvLayout:
    """Byte-level page access to a list of KV buffers that share a page index."""

    def __init__(
        self,
        buffers: Sequence[torch.Tensor],
        page_size: int,
        tokens_per_row: int = 1,
    ) -> None:
        if not buffers:
            raise ValueError("a KV layout needs at least one buffer")
        if page_size <= 0 or page_size % tokens_per_row:
            raise ValueError(f"page_size {page_size} is not a multiple of tokens_per_row {tokens_per_row}")
        rows_per_page = page_size // tokens_per_row
        self.page_size = page_size
        self.device = buffers[0].device
        num_pages = min(buf.shape[0] for buf in buffers) // rows_per_page
        byte_views: list[torch.Tensor] = []
        for idx, buf in enumerate(buffers):
            if buf.device != self.device:
                raise ValueError(f"KV buffer {idx} is on {buf.device}, buffer 0 on {self.device}")
            if not buf.is_contiguous():
                raise ValueError(f"KV buffer {idx} is not contiguous; its pages cannot be copied as rows")
            rows = buf[: num_pages * rows_per_page]
            byte_views.append(rows.reshape(-1).view(torch.uint8).view(num_pages, -1))
        self.num_pages = num_pages
        self.buffer_page_bytes = tuple(v.shape[1] for v in byte_views)
        offsets, acc = [], 0
        for nbytes in self.buffer_page_bytes:
            offsets.append(acc)
            acc += nbytes
        self.buffer_offsets = tuple(offsets)
        self.page_bytes = acc
        self.block_bytes = -(-acc // BLOCK_ALIGN) * BLOCK_ALIGN
        # Copies run on the widest word every size and offset divides: torch copies
        # strided uint8 element by element, int64 eight times faster.
        self._word = next(w for w in (8, 4, 2, 1) if all(n % w == 0 for n in (*self.buffer_page_bytes, *offsets)))
        self._wtype = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[self._word]
        self._views = [v.view(self._wtype) for v in byte_views]
        self._stream: Optional[torch.cuda.Stream] = None

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def host_slab(self, num_blocks: int, *, pin: bool) -> torch.Tensor:
        """``num_blocks`` host rows of :attr:`block_bytes`, pinned if asked, 4 KiB-aligned (O_DIRECT)."""
        return aligned_empty((num_blocks, self.block_bytes), pin=pin)

    def ready_event(self) -> Optional[torch.cuda.Event]:
        """Mark 'KV written so far' on the current stream (CUDA); None on CPU.

        Taken on the scheduler thread when a store is submitted: the copy waits
        for it, so it reads the forward pass's output and never races a load.
        """
        if not self.is_cuda:
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    # -- device -> host (runs on the offload worker) ------------------------

    def save(
        self,
        pages: Sequence[int],
        host: torch.Tensor,
        slots: Sequence[int],
        ready: Optional[torch.cuda.Event] = None,
    ) -> None:
        """Copy device ``pages`` into host rows ``slots``; returns when the bytes are there."""
        if len(pages) != len(slots):
            raise ValueError(f"{len(pages)} pages for {len(slots)} slots")
        host = host.view(self._wtype)
        if not self.is_cuda:
            spans = list(runs(pages, slots))
            if len(spans) * _GATHER_BELOW_RUN_LENGTH > len(pages):  # scattered: two vectorised copies per buffer
                src, dst = _index(pages), _index(slots)
                for view, off, nbytes in self._buffers():
                    host[:, off : off + nbytes].index_copy_(0, dst, view.index_select(0, src))
                return
            for _, p0, s0, n in spans:
                for view, off, nbytes in self._buffers():
                    host[s0 : s0 + n, off : off + nbytes].copy_(view[p0 : p0 + n])
            return
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=self.device)
        with torch.cuda.stream(self._stream):
            if ready is not None:
                self._stream.wait_event(ready)
            step = self._chunk_pages()
            for start in range(0, len(pages), step):
                chunk_slots = slots[start : start + step]
                staging = self._gather(pages[start : start + step])
                for k, s0, _, n in runs(chunk_slots, chunk_slots):
                    host[s0 : s0 + n].copy_(staging[k : k + n], non_blocking=True)
            self._stream.synchronize()

    def _gather(self, pages: Sequence[int]) -> torch.Tensor:
        """Device pages as contiguous block rows ``(n, block words)``, in a few launches."""
        spans = list(runs(pages, pages))
        if len(spans) == 1:
            p0, n = spans[0][1], spans[0][3]
            parts = [view[p0 : p0 + n] for view in self._views]
        else:
            index = torch.tensor(pages, dtype=torch.int64, device=self.device)
            parts = [view.index_select(0, index) for view in self._views]
        rows = torch.cat(parts, dim=1)
        block_words = self.block_bytes // self._word
        if rows.shape[1] == block_words:
            return rows
        staging = torch.empty((len(pages), block_words), dtype=self._wtype, device=self.device)
        staging[:, : rows.shape[1]] = rows
        return staging

    # -- host -> device (runs on the caller's thread, stream-ordered) --------

    def load(self, slots: Sequence[int], host: torch.Tensor, pages: Sequence[int]) -> None:
        """Copy host rows ``slots`` into device ``pages``, ordered on the current stream."""
        if len(pages) != len(slots):
            raise ValueError(f"{len(slots)} slots for {len(pages)} pages")
        host = host.view(self._wtype)
        if not self.is_cuda:
            spans = list(runs(slots, pages))
            if len(spans) * _GATHER_BELOW_RUN_LENGTH > len(pages):
                rows = host.index_select(0, _index(slots))
                dst = _index(pages)
                for view, off, nbytes in self._buffers():
                    view.index_copy_(0, dst, rows[:, off : off + nbytes])
                return
            for _, s0, p0, n in spans:
                for view, off, nbytes in self._buffers():
                    view[p0 : p0 + n].copy_(host[s0 : s0 + n, off : off + nbytes])
            return
        step = self._chunk_pages()
        for start in range(0, len(pages), step):
            chunk_slots = slots[start : start + step]
            chunk_pages = pages[start : start + step]
            staging = torch.empty((len(chunk_slots), self.block_bytes // self._word), dtype=self._wtype, device=self.device)
            for k, s0, _, n in runs(chunk_slots, chunk_slots):
                staging[k : k + n].copy_(host[s0 : s0 + n], non_blocking=True)
            sources = [staging[:, off : off + nbytes] for _, off, nbytes in self._buffers()]
            spans = list(runs(chunk_pages, chunk_pages))
            if len(spans) == 1:  # one fused multi-tensor copy for a contiguous run of pages
                p0, n = spans[0][1], spans[0][3]
                torch._foreach_copy_([view[p0 : p0 + n] for view in self._views], sources)
            else:
                index = torch.tensor(chunk_pages, dtype=torch.int64, device=self.device)
                for view, source in zip(self._views, sources):
                    view.index_copy_(0, index, source)

    def read_page(self, page: int) -> torch.Tensor:
        """One device page's bytes, as a block row without padding (for tests and tools)."""
        return torch.cat([view[page].cpu().view(torch.uint8) for view in self._views])

    def write_page(self, page: int, data: torch.Tensor) -> None:
        """Overwrite one device page from a row of :attr:`page_bytes` bytes (for tests and tools)."""
        for view, off, nbytes in self._buffers():
            view[page].copy_(data.view(self._wtype)[off : off + nbytes])

    def _buffers(self) -> Iterator[tuple[torch.Tensor, int, int]]:
        """``(view, offset, length)`` of each buffer, in words."""
        w = self._word
        return ((v, off // w, n // w) for v, off, n in zip(self._views, self.buffer_offsets, self.buffer_page_bytes))

    def _chunk_pages(self) -> int:
        return max(1, _CUDA_STAGING_BYTES // self.block_bytes)
