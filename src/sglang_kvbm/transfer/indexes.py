"""Index tensors for batched copies: built on the host, moved to the device without a host sync, read as runs."""

from __future__ import annotations

from array import array
from typing import Optional, Sequence

import torch


def index(values: Sequence[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """An int64 index tensor; on CUDA copied from pinned memory, asynchronously on the current stream
    (``torch.tensor(..., device="cuda")`` would be a synchronous pageable copy). An ``array('i')`` (the rows a
    tier's ``pin`` returns) is read as one buffer, not element by element."""
    if isinstance(values, array) and values.typecode == "i" and len(values):
        host = torch.frombuffer(values, dtype=torch.int32).to(torch.int64)
    else:
        host = torch.tensor(values, dtype=torch.int64)
    return host if torch.device(device).type != "cuda" else to_device(host, device)


def to_device(idx: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host index on ``device``, copied from pinned memory on the current stream (no host sync)."""
    return idx if idx.is_cuda else idx.pin_memory().to(device, non_blocking=True)


def run_start(idx: torch.Tensor) -> Optional[int]:
    """The first element when ``idx`` is one ascending run (``a, a+1, ...``), else None. Host tensors only.

    Short indexes (a store's pages, a load's rows) are read as a list: a few tensor ops on a
    handful of elements cost ~25 us of a copy thread's GIL, ``tolist`` and a list compare ~2."""
    n = idx.numel()
    if n == 0:
        return None
    if n <= 512:
        values = idx.tolist()
        first = values[0]
        return first if values[-1] - first == n - 1 and values == list(range(first, first + n)) else None
    first = int(idx[0])
    return first if int(idx[-1]) - first == n - 1 and bool((idx[1:] - idx[:-1] == 1).all()) else None
