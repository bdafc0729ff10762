"""The CUDA side of :class:`~sglang_kvbm.transfer.kv_layout.PagedKvLayout`'s copies: the GPU reads and writes the pinned
host tier itself, ordered by the stream, never by the host.

Host memory the tiers use is page-locked once (:func:`pin`, ``cudaHostRegister``)
and, under CUDA's unified addressing, the GPU reaches it at the same address:
:func:`host_alias` wraps it as a CUDA tensor, so a copy between the pool and a
host slab is an ordinary gather/scatter *kernel* whose one side is host memory
over PCIe, as SGLang's HiCache ``kernel`` I/O backend does it
(``sgl_kernel.kvcacheio``), and not a chain of DMA + host-side gather:

* **device -> host** (:func:`save`): per buffer, one ``index_select`` of the
  pages straight into the host rows' columns when the rows are one run;
  otherwise a gather into this worker's device staging, then an ``index_copy_``
  into the rows. The worker waits for its stream at the end: an offload is
  reported done only once its bytes are in host memory.
* **host -> device** (:func:`load`): per buffer of the layer, one ``index_copy_``
  into the pages straight from the host rows' columns when the rows are one run;
  otherwise a gather from host into staging, then the scatter. Nothing waits for
  the device: the caller records the layer's event after it (``layer_counter``).

A few kernels per buffer for a whole batch, whatever its page count. The GPU's
writes over PCIe are efficient in large pieces: with a Llama-8B page's 64 KiB per
buffer (page size 16) G1->G2 runs at 0.78 of a pinned memcpy on an H100, at 256 KiB
(page 64) 0.81, at 2 KiB (page 1) 0.29-0.32; assembling whole rows on the device first
(a gather per buffer per 32 MiB, then one DMA) measured no better at page 1, bound by
the launches. Loads read at 0.88 at every page size. The first
design (a pinned double buffer gathered on the host, a DMA, then a device
scatter, per 32 MiB chunk) ran G1->G2 at 0.25 and G2->G1 at 0.16 of a plain
pinned ``memcpy`` on an H100 (``benchmarks/tier_io.py --device cuda``), bound by
the host gather and by launches per chunk.

Each copy worker thread owns, from its start (:func:`start_worker`): the device
it copies on (``torch.cuda.set_device``: without it a thread of a TP rank other
than 0 opens a context on GPU 0) and a device staging buffer of
:data:`STAGING_BYTES`, allocated before serving, not mid-serving.

Imports torch only.
"""

from __future__ import annotations

import threading
import weakref

import torch

from sglang_kvbm.transfer.indexes import run_start, to_device

STAGING_BYTES = 32 << 20  # a worker's device staging: what one gather holds at most

_local = threading.local()
_pinned: dict[int, tuple[int, dict]] = {}  # base address -> (bytes, {device index: uint8 CUDA alias})
_pinned_lock = threading.Lock()


def pin(memory, base: int) -> None:
    """Page-lock ``memory`` (the object owning a host mapping, at address ``base``: ``host_memory._host_mapping``)
    with one ``cudaHostRegister``, until it is freed (unregistered before the range is unmapped)."""
    nbytes = len(memory)
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostRegister(base, nbytes, 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed with CUDA error {int(err)}")
    with _pinned_lock:
        _pinned[base] = (nbytes, {})
    weakref.finalize(memory, _unpin, base)


def _unpin(base: int) -> None:
    with _pinned_lock:
        _pinned.pop(base, None)
    torch.cuda.cudart().cudaHostUnregister(base)


class _HostMemory:
    """Registered host memory described to torch as CUDA memory (UVA: the device uses the host's address)."""

    def __init__(self, base: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (base, False), "version": 3, "strides": None,
        }


def host_alias(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CUDA tensor of ``host``'s shape, strides and dtype over the same (pinned) bytes: kernels on ``device``
    read and write ``host`` through it."""
    ptr = host.data_ptr()
    with _pinned_lock:
        found = next(((b, n, a) for b, (n, a) in _pinned.items() if b <= ptr < b + n), None)
        if found is None:
            raise ValueError("host memory the GPU copies to or from must be pinned by cuda_copies.pin "
                             "(PagedKvLayout.host_slab(pin=True))")
        base, nbytes, aliases = found
        index_ = device.index if device.index is not None else torch.cuda.current_device()
        alias = aliases.get(index_)
        if alias is None:
            with torch.cuda.device(index_):
                alias = torch.as_tensor(_HostMemory(base, nbytes), device=f"cuda:{index_}")
            if alias.data_ptr() != base:  # torch placed it on another device and copied it: not an alias
                raise RuntimeError(f"host memory registered on another GPU than cuda:{index_}: register it with "
                                   "the pool's device current (torch.cuda.set_device) before the tiers are built")
            aliases[index_] = alias
    size = host.element_size()
    return alias.view(host.dtype).as_strided(host.shape, host.stride(), (ptr - base) // size)


class _Staging:
    def __init__(self, device: torch.device, nbytes: int) -> None:
        self.device_buf = torch.empty(nbytes, dtype=torch.uint8, device=device)


def start_worker(device: torch.device, row_bytes: int = 0) -> None:
    """Thread initializer of a copy worker: its device, and its staging allocated now, not mid-serving
    (:data:`STAGING_BYTES`, or one page of a buffer where that is larger)."""
    torch.cuda.set_device(device)
    _local.staging = _Staging(device, max(STAGING_BYTES, row_bytes))


def _staging(device: torch.device, row_bytes: int) -> torch.Tensor:
    staging = getattr(_local, "staging", None)
    if staging is None or staging.device_buf.numel() < row_bytes:  # not started as a copy worker (tests, tools)
        start_worker(device, row_bytes)
        staging = _local.staging
    return staging.device_buf


def save(views, spans, host: torch.Tensor, rows: torch.Tensor, pages: torch.Tensor) -> None:
    """Device ``pages`` of every buffer into host ``rows`` (CPU index); returns when the bytes are there."""
    device = pages.device
    target = host_alias(host, device)
    r0 = run_start(rows)
    rows_d = None if r0 is not None else to_device(rows, device)
    n = rows.numel()
    for view, (off, width) in zip(views, spans):
        columns = target[:, off : off + width]
        if r0 is not None:  # one kernel: the gather writes the host rows' columns over PCIe
            torch.index_select(view, 0, pages, out=columns[r0 : r0 + n])
        else:
            _through_staging(view, pages, columns, rows_d)
    torch.cuda.current_stream().synchronize()


def load(views, spans, host: torch.Tensor, rows: torch.Tensor, pages: torch.Tensor, buffers, r0=None) -> None:
    """Host ``rows`` of ``buffers`` into device ``pages``, enqueued on the current stream (no wait for it).

    ``rows``: a host or device index; ``r0``: its first row when it is one run
    (``run_start``, known to the caller without a device sync)."""
    device = pages.device
    source = host_alias(host, device)
    if r0 is None and not rows.is_cuda:
        r0 = run_start(rows)
    rows_d = None if r0 is not None else to_device(rows, device)
    n = pages.numel()
    for b in buffers:
        off, width = spans[b]
        columns, view = source[:, off : off + width], views[b]
        if r0 is not None:  # one kernel, reading the host rows' columns over PCIe
            view.index_copy_(0, pages, columns[r0 : r0 + n])
        else:
            _through_staging(columns, rows_d, view, pages)


def _through_staging(source, source_index, target, target_index) -> None:
    """``target[target_index] = source[source_index]`` for indexes no slice covers: gathered into this worker's
    device staging (one side may be host memory, read or written over PCIe), a staging's worth at a time."""
    width = source.shape[1]
    buf = _staging(target_index.device, width * source.element_size()).view(source.dtype)
    step = max(1, buf.numel() // width)
    n = source_index.numel()
    for start in range(0, n, step):
        stop = min(n, start + step)
        gathered = buf[: (stop - start) * width].view(stop - start, width)
        torch.index_select(source, 0, source_index[start:stop], out=gathered)
        target.index_copy_(0, target_index[start:stop], gathered)
