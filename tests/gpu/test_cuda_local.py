"""The local backend's CUDA path: pinned host slab, per-worker streams, copies ordered by events.

Runs only where CUDA is; skipped elsewhere. It needs torch and this package, not
SGLang (the GPU machines this project gets have no SGLang): the "device pool" is
a set of CUDA tensors laid out like SGLang's MHA pool (token rows x heads x dim).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

from sglang_kvbm.backends.local import copies  # noqa: E402
from sglang_kvbm.backends.local.manager import LocalBlockManager  # noqa: E402
from sglang_kvbm.core.identity import chain_hashes  # noqa: E402
from sglang_kvbm.core.ports import BlockMeta, StoreRequest  # noqa: E402
from sglang_kvbm.kv_layout import PagedKvLayout, index  # noqa: E402

PAGE = 16


def cuda_layout(pages=256, layers=4, heads=8, dim=128, dtype=torch.bfloat16):
    buffers = [torch.randn(pages * PAGE, heads, dim, device="cuda").to(dtype) for _ in range(2 * layers)]
    return buffers, PagedKvLayout(buffers, PAGE, layers=[(l, layers + l) for l in range(layers)])


def request(pages, ready=()):
    ids = tuple(chain_hashes(list(range(len(pages) * PAGE)), PAGE))
    slots = torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in pages]).cuda()
    return StoreRequest(ids, slots, lambda positions: [BlockMeta(ids[p]) for p in positions], ready)


def load(manager, layout, ids, targets):
    plan = manager.acquire(ids)
    assert plan is not None
    batch = copies.load_batch(layout, manager.load_parts(plan, index(targets, "cuda")))
    stream = layout.new_stream()
    for layer in range(layout.num_layers):
        copies.load_layer(layout, stream, batch, layer)
    manager.release(plan)


def test_pinned_slab_is_page_locked_aligned_and_copies_from_it_are_asynchronous():
    _, layout = cuda_layout(pages=8)
    slab = layout.host_slab(128, pin=True)  # 128 rows of 4 layers' pages
    assert slab.data_ptr() % 4096 == 0
    assert slab.is_pinned()  # cudaHostRegister took it
    big = torch.empty((256 << 20,), dtype=torch.uint8).view(slab.dtype)
    pinned = layout.host_slab(max(1, (256 << 20) // layout.block_bytes), pin=True).view(-1)
    dst = torch.empty(pinned.shape, dtype=torch.uint8, device="cuda")
    done = torch.cuda.Event()
    dst.copy_(pinned, non_blocking=True)
    done.record()
    assert not done.query()  # returned before the copy finished: a DMA from page-locked memory
    torch.cuda.synchronize()
    assert not big.is_pinned()


def test_every_copy_worker_has_its_own_stream_made_before_it_starts():
    _, layout = cuda_layout(pages=8)
    manager = LocalBlockManager(layout, 16, pin=True)
    assert isinstance(manager.offloads._offload_stream, torch.cuda.Stream)
    assert manager.offloads._offload_stream != torch.cuda.current_stream()
    manager.close()


def test_offload_and_layer_wise_onboard_bytes_equal_on_cuda():
    buffers, layout = cuda_layout()
    manager = LocalBlockManager(layout, 512, pin=True)
    pages = list(range(10, 74))
    # Written by "the forward pass" right before the store: the copy stream must wait for it
    # (the ready event), so the host copy holds these bytes, not older ones.
    for view in buffers:
        view[10 * PAGE : 74 * PAGE].mul_(-1.0)
    ready = torch.cuda.Event()
    ready.record()
    before = [layout.read_page(p) for p in pages]
    req = request(pages, (ready,))
    manager.store(req)
    assert manager.wait(timeout=60)
    assert [ok for _, ok in manager.poll().completed] == [True]
    targets = list(range(100, 164))
    load(manager, layout, list(req.block_ids), targets)
    for page, want in zip(targets, before):
        assert torch.equal(layout.read_page(page), want)
    manager.close()


def test_scattered_pages_and_rows_on_cuda():
    _, layout = cuda_layout(pages=128)
    manager = LocalBlockManager(layout, 256, pin=True)
    pages = [3, 90, 17, 18, 19, 64, 2, 120]
    before = [layout.read_page(p) for p in pages]
    req = request(pages)
    manager.store(req)
    manager.wait(timeout=60)
    manager.poll()
    targets = [100, 5, 6, 7, 50, 51, 127, 1]
    load(manager, layout, list(req.block_ids), targets)
    for page, want in zip(targets, before):
        assert torch.equal(layout.read_page(page), want)
    manager.close()
