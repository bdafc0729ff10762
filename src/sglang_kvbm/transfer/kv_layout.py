"""A paged KV pool seen as bytes: page ``p`` of buffer ``i`` is one contiguous row.

An engine's KV pool is a list of per-layer buffers (K and V per layer for MHA,
one latent buffer per layer for MLA) whose leading axis is token slots (or whole
pages). :class:`PagedKvLayout` views each as ``(num_pages, page_bytes_i)`` and
moves pages between the pool and a host slab whose row is one *block*: the
page's bytes from every buffer, back to back, padded to 4 KiB so a block can go
to disk with O_DIRECT straight from the slab.

Every copy takes its pages and rows as index tensors (pages on the pool's
device, rows on the host) and moves a whole batch with a few large tensor
operations per buffer: one slice copy when both sides are contiguous runs, one
gather and one scatter otherwise; never one call per page. On CUDA (see
``cuda_copies``) the copies run on the stream a worker drew for itself
(:meth:`new_stream`, apart from SGLang's), entered with :meth:`copying`, which
orders them after the events they wait for on the GPU; index tensors are
computed inside it, on that stream.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable, Iterable, Optional, Sequence

import torch

from sglang_kvbm.transfer.host_memory import BLOCK_ALIGN, aligned_empty
from sglang_kvbm.transfer.indexes import run_start


class PagedKvLayout:
    """Byte-level page access to a list of KV buffers that share a page index.

    ``layers[l]`` lists the buffers layer ``l`` reads (K and V for MHA, the
    latent buffer for MLA), for loads that land one layer at a time.
    """

    def __init__(
        self,
        buffers: Sequence[torch.Tensor],
        page_size: int,
        tokens_per_row: int = 1,
        layers: Optional[Sequence[Sequence[int]]] = None,
    ) -> None:
        if not buffers:
            raise ValueError("a KV layout needs at least one buffer")
        if page_size <= 0 or page_size % tokens_per_row:
            raise ValueError(f"page_size {page_size} is not a multiple of tokens_per_row {tokens_per_row}")
        rows_per_page = page_size // tokens_per_row
        self.page_size = page_size
        self.device = buffers[0].device
        self.is_cuda = self.device.type == "cuda"  # asked on every store and load: an attribute, not a property
        num_pages = min(buf.shape[0] for buf in buffers) // rows_per_page
        byte_views: list[torch.Tensor] = []
        for i, buf in enumerate(buffers):
            if buf.device != self.device:
                raise ValueError(f"KV buffer {i} is on {buf.device}, buffer 0 on {self.device}")
            if not buf.is_contiguous():
                raise ValueError(f"KV buffer {i} is not contiguous; its pages cannot be copied as rows")
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
        self.layers = tuple(tuple(layer) for layer in (layers or [range(len(buffers))]))
        # Copies run on the widest word every size and offset divides: torch copies
        # strided uint8 element by element, int64 eight times faster.
        self._word = next(w for w in (8, 4, 2, 1) if all(n % w == 0 for n in (*self.buffer_page_bytes, *offsets)))
        self._wtype = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[self._word]
        self._views = [v.view(self._wtype) for v in byte_views]
        w = self._word
        self._spans = tuple((off // w, n // w) for off, n in zip(self.buffer_offsets, self.buffer_page_bytes))
        self._streams_taken: set[int] = set()  # CUDA streams a new copy stream must not alias

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def host_slab(self, num_blocks: int, *, pin: bool) -> torch.Tensor:
        """``num_blocks`` host rows of :attr:`block_bytes`, pinned if asked, 4 KiB-aligned (O_DIRECT)."""
        return aligned_empty((num_blocks, self.block_bytes), pin=pin)

    def pages_of(self, token_slots: torch.Tensor) -> torch.Tensor:
        """Page numbers of page-aligned token slots (on their device; no host sync)."""
        return torch.div(token_slots[:: self.page_size], self.page_size, rounding_mode="floor")

    def avoid_streams(self, *streams) -> None:
        """Streams no copy stream may be (the scheduler's, the forward's): ``new_stream`` draws around them."""
        self._streams_taken.update(s.cuda_stream for s in streams if s is not None)

    def share_streams(self, other: "PagedKvLayout") -> None:
        """Draw copy streams from ``other``'s taken set (a hybrid model's pools, whose workers run side by side)."""
        self._streams_taken = other._streams_taken

    def new_stream(self) -> Optional[torch.cuda.Stream]:
        """A copy stream for one worker (CUDA), none of SGLang's nor another worker's; None on CPU.

        CUDA streams come from a fixed round-robin pool, so a fresh ``Stream()``
        can be one already in use (the forward's, say): draw until it is not, as
        SGLang does (``managers/utils.allocate_distinct_stream``).
        """
        if not self.is_cuda:
            return None
        self._streams_taken.add(torch.cuda.current_stream(self.device).cuda_stream)
        for _ in range(65):
            stream = torch.cuda.Stream(device=self.device)
            if stream.cuda_stream not in self._streams_taken:
                self._streams_taken.add(stream.cuda_stream)
                return stream
        raise RuntimeError("no CUDA stream left that SGLang or another kvbm worker does not use")

    def worker_init(self) -> Optional[Callable[[], None]]:
        """A copy worker thread's initializer (CUDA: its device and staging, before it copies); None on CPU."""
        if not self.is_cuda:
            return None
        from sglang_kvbm.transfer.cuda_copies import start_worker

        return functools.partial(start_worker, self.device, self.block_bytes)

    @contextlib.contextmanager
    def copying(self, stream: Optional[torch.cuda.Stream], ready: Iterable = ()):
        """Copies inside run on ``stream`` after the ``ready`` events (on the GPU; on CPU: waited for here)."""
        if not self.is_cuda:
            for event in ready:
                event.synchronize()
            yield
            return
        with torch.cuda.stream(stream):
            for event in ready:
                torch.cuda.current_stream().wait_event(event)
            yield

    # -- device -> host -----------------------------------------------------

    def save(self, pages: torch.Tensor, host: torch.Tensor, rows: torch.Tensor) -> None:
        """Copy device ``pages`` into host ``rows`` (every buffer); returns when the bytes are there.

        On CUDA, on the current stream (enter :meth:`copying` first).
        """
        if pages.numel() != rows.numel():
            raise ValueError(f"{pages.numel()} pages for {rows.numel()} rows")
        host = host.view(self._wtype)
        if not self.is_cuda:
            self._cpu_copy(host, rows, pages, range(len(self._views)), to_host=True)
            return
        from sglang_kvbm.transfer import cuda_copies

        cuda_copies.save(self._views, self._spans, host, rows, pages)

    # -- host -> device -----------------------------------------------------

    def load_layer(
        self, layer: int, host: torch.Tensor, rows: torch.Tensor, pages: torch.Tensor,
        runs: Optional[tuple[Optional[int], Optional[int]]] = None,
    ) -> None:
        """Copy the buffers of ``layer`` from host ``rows`` into device ``pages``.

        On CPU it returns when they landed; on CUDA the copy is enqueued on the
        current stream (record an event after it). ``runs``: ``(run_start(rows),
        run_start(pages))`` when the caller loads the same rows layer after
        layer (computed here otherwise; on CUDA ``rows`` may then be a device
        index, and the pages' run is not used).
        """
        if pages.numel() != rows.numel():
            raise ValueError(f"{rows.numel()} rows for {pages.numel()} pages")
        if rows.numel() == 0:
            return
        host = host.view(self._wtype)
        if not self.is_cuda:
            self._cpu_copy(host, rows, pages, self.layers[layer], to_host=False, runs=runs)
            return
        from sglang_kvbm.transfer import cuda_copies

        cuda_copies.load(self._views, self._spans, host, rows, pages, self.layers[layer], r0=runs[0] if runs else None)

    # -- CPU: one slice copy per buffer for contiguous runs, else gather + scatter --

    def _cpu_copy(self, host, rows, pages, buffers, *, to_host: bool, runs=None) -> None:
        r0, p0 = runs if runs is not None else (run_start(rows), run_start(pages))
        n = rows.numel()
        for b in buffers:
            view = self._views[b]
            off, width = self._spans[b]
            columns = host[:, off : off + width]
            if r0 is not None and p0 is not None:
                if to_host:
                    columns[r0 : r0 + n].copy_(view[p0 : p0 + n])
                else:
                    view[p0 : p0 + n].copy_(columns[r0 : r0 + n])
            elif to_host:
                source = view[p0 : p0 + n] if p0 is not None else view.index_select(0, pages)
                if r0 is not None:
                    columns[r0 : r0 + n].copy_(source)
                else:
                    columns.index_copy_(0, rows, source)
            else:
                source = columns[r0 : r0 + n] if r0 is not None else columns.index_select(0, rows)
                if p0 is not None:
                    view[p0 : p0 + n].copy_(source)
                else:
                    view.index_copy_(0, pages, source)

    # -- tests and tools ---------------------------------------------------------

    def read_page(self, page: int) -> torch.Tensor:
        """One device page's bytes, as a block row without padding."""
        return torch.cat([view[page].cpu().view(torch.uint8) for view in self._views])

    def write_page(self, page: int, data: torch.Tensor) -> None:
        """Overwrite one device page from a row of :attr:`page_bytes` bytes."""
        data = data.view(self._wtype)
        for view, (off, width) in zip(self._views, self._spans):
            view[page].copy_(data[off : off + width])
