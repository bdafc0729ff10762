"""Host memory for blocks: 4 KiB-aligned (O_DIRECT), page-locked on request, unregistered before it is unmapped."""

from __future__ import annotations

import ctypes
import mmap

import torch

BLOCK_ALIGN = 4096


def aligned_empty(shape: tuple[int, int], *, pin: bool = False) -> torch.Tensor:
    """An uint8 tensor whose first byte is 4 KiB-aligned, page-locked if ``pin``.

    O_DIRECT needs 4096-byte alignment (torch aligns host allocations to 64), and
    NIXL's POSIX backend reports an unaligned O_DIRECT transfer as done without
    moving a byte, so alignment is guaranteed here rather than hoped for: the
    memory is an anonymous ``mmap`` (page-aligned, zero-filled as it is touched),
    which the tensor's storage keeps, and every view of it keeps the storage.
    Page-locked memory is unregistered when that mapping goes, i.e. with the
    last view of it, not with one Python object that views it, and before the
    range is unmapped (see :func:`_host_mapping`).

    Pinning gigabytes takes seconds: the pages are first touched a chunk at a
    time (with progress), then page-locked with one ``cudaHostRegister``
    (``cuda_copies.pin``: the GPU then reads and writes them in place).
    """
    nbytes = shape[0] * shape[1]
    memory = _host_mapping(max(nbytes, BLOCK_ALIGN))
    flat = torch.frombuffer(memory, dtype=torch.uint8)
    if pin:
        from sglang_kvbm.base.progress import Progress
        from sglang_kvbm.transfer import cuda_copies

        chunk = 256 << 20
        with Progress(flat.numel(), "pinning the host tier") as progress:
            for start in range(0, flat.numel(), chunk):
                part = flat[start : start + chunk]
                part.zero_()
                progress.update(part.numel())
        cuda_copies.pin(memory, flat.data_ptr())
    return flat[:nbytes].view(shape)


def _host_mapping(nbytes: int):
    """``nbytes`` of anonymous memory (an ``mmap``), held by the object returned: a ``ctypes`` array over it.

    ``cuda_copies.pin`` unregisters the memory in a ``weakref.finalize`` on the object it is given. On the ``mmap``
    itself that finalizer would run after the munmap (CPython's mmap dealloc unmaps, then clears its weak
    references), leaving ``cudaHostUnregister`` an unmapped range. A Python subclass's weak references are cleared
    before its base is torn down: the finalizer runs first, then the array lets go of the ``mmap``, which unmaps.
    """
    memory = mmap.mmap(-1, nbytes)
    return type("HostMapping", (ctypes.c_uint8 * nbytes,), {}).from_buffer(memory)
