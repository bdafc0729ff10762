"""The local backend's CUDA path: pinned host slab, side-stream copies ordered by events.

Runs only where CUDA is; skipped elsewhere. It needs torch and this package, not
SGLang (the GPU machines this project gets have no SGLang): the "device pool" is
a set of CUDA tensors laid out like SGLang's MHA pool (token rows x heads x dim).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

from sglang_kvbm.backends.local.manager import LocalBlockManager  # noqa: E402
from sglang_kvbm.core.connector import KvbmConnector  # noqa: E402
from sglang_kvbm.core.identity import chain_hashes  # noqa: E402
from sglang_kvbm.core.ports import BlockMeta, PageStore  # noqa: E402
from sglang_kvbm.kv_layout import PagedKvLayout  # noqa: E402

PAGE = 16


class Sink:
    def __init__(self):
        self.calls = []

    def stored(self, tier, blocks):
        self.calls.append(("stored", tier, len(blocks)))

    def removed(self, tier, blocks):
        self.calls.append(("removed", tier, len(blocks)))


def cuda_pool(pages=256, layers=4, heads=8, dim=128, dtype=torch.bfloat16):
    return [torch.randn(pages * PAGE, heads, dim, device="cuda").to(dtype) for _ in range(2 * layers)]


def stores(tokens, pages):
    ids = chain_hashes(tokens, PAGE)
    return [PageStore(BlockMeta(i, ()), p) for i, p in zip(ids, pages)], ids


def test_pinned_slab_is_page_locked_and_aligned():
    layout = PagedKvLayout(cuda_pool(pages=8), PAGE)
    slab = layout.host_slab(16, pin=True)
    assert slab.data_ptr() % 4096 == 0
    # host_slab(pin=True) raises unless cudaHostRegister accepted the range.
    # A non-blocking copy from a registered range must be a true async copy: check bytes after sync.
    dst = torch.empty(slab.shape, dtype=torch.uint8, device="cuda")
    slab.fill_(7)
    dst.copy_(slab, non_blocking=True)
    torch.cuda.synchronize()
    assert int(dst.float().mean().item()) == 7


def test_offload_and_onboard_bytes_equal_on_cuda():
    buffers = cuda_pool()
    layout = PagedKvLayout(buffers, PAGE)
    manager = LocalBlockManager(layout, 512, pin=True)
    connector = KvbmConnector(manager, Sink())
    tokens = list(range(64 * PAGE))
    pages = list(range(10, 74))
    # Written by "the forward pass" on the current stream right before the store: the side
    # stream must wait for it (ready event), so the host copy holds these bytes, not older ones.
    for view in buffers:
        view[10 * PAGE : 74 * PAGE].mul_(-1.0)
    before = [layout.read_page(p) for p in pages]
    page_stores, ids = stores(tokens, pages)
    assert connector.store(page_stores, on_offloaded=lambda: None)
    assert connector.flush(timeout=60)
    assert connector.lookup(ids) == 64
    targets = list(range(100, 164))
    result = connector.load(ids, targets)
    assert result is not None and result.host_blocks == 64
    torch.cuda.current_stream().synchronize()
    for page, want in zip(targets, before):
        assert torch.equal(layout.read_page(page), want)
    connector.close()


def test_scattered_pages_and_rows_on_cuda():
    buffers = cuda_pool(pages=128)
    layout = PagedKvLayout(buffers, PAGE)
    manager = LocalBlockManager(layout, 256, pin=True)
    connector = KvbmConnector(manager, Sink())
    pages = [3, 90, 17, 18, 19, 64, 2, 120]
    before = [layout.read_page(p) for p in pages]
    page_stores, ids = stores(list(range(8 * PAGE)), pages)
    connector.store(page_stores, on_offloaded=lambda: None)
    connector.flush(timeout=60)
    targets = [100, 5, 6, 7, 50, 51, 127, 1]
    assert connector.load(ids, targets) is not None
    torch.cuda.current_stream().synchronize()
    for page, want in zip(targets, before):
        assert torch.equal(layout.read_page(page), want)
    connector.close()
