"""The block manager's CUDA path: pinned host slab, per-worker streams, copies ordered by events.

Runs only where CUDA is; skipped elsewhere. It needs torch and this package, not
SGLang (the GPU machines this project gets have no SGLang): the "device pool" is
a set of CUDA tensors laid out like SGLang's MHA pool (token rows x heads x dim).
``make gpu-check`` runs it, once plainly and once under TORCH_CUDA_SANITIZER=1.
"""

from __future__ import annotations

import threading

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

from sglang_kvbm.core.identity import chain_hashes  # noqa: E402
from sglang_kvbm.core.pages import one_page  # noqa: E402
from sglang_kvbm.core.ports import StoreRequest  # noqa: E402
from sglang_kvbm.manager.block_manager import LocalBlockManager  # noqa: E402
from sglang_kvbm.manager.layer_loader import LayerLoader  # noqa: E402
from sglang_kvbm.transfer import cuda_copies  # noqa: E402
from sglang_kvbm.transfer.indexes import index  # noqa: E402
from sglang_kvbm.transfer.kv_layout import PagedKvLayout  # noqa: E402
from sglang_kvbm.transfer.lanes import LaneExecutor  # noqa: E402
from sglang_kvbm.transfer.layer_counter import LayerCounter  # noqa: E402

PAGE = 16


def cuda_layout(pages=256, layers=4, heads=8, dim=128, dtype=torch.bfloat16, page=PAGE):
    buffers = [torch.randn(pages * page, heads, dim, device="cuda").to(dtype) for _ in range(2 * layers)]
    return buffers, PagedKvLayout(buffers, page, layers=[(l, layers + l) for l in range(layers)])


def slots_of(pages, page=PAGE):
    return torch.cat([torch.arange(p * page, (p + 1) * page) for p in pages]).cuda()


def request(pages, ready=None, page=PAGE, slots=None):
    """A store of ``pages``, ready after ``ready`` (by default: what the current stream did so far, as SGLang's
    ``record_offload_ready`` hands the linker)."""
    ids = tuple(chain_hashes(list(range(len(pages) * page)), page))
    slots = slots_of(pages, page) if slots is None else slots
    if ready is None:
        event = torch.cuda.Event()
        event.record()
        ready = (event,)
    return StoreRequest(ids, slots, lambda positions: [one_page(ids[p]) for p in positions], ready)


def load(manager, layout, ids, targets, slots=None):
    """A load as the linker runs it: the loader thread, the counter's events, the forward waiting per layer."""
    plan = manager.acquire(ids)
    assert plan is not None
    counter = LayerCounter(layout.num_layers, cuda=True)
    loader = LayerLoader(manager, counter)
    slots = slots_of(targets, layout.page_size) if slots is None else slots
    ready = torch.cuda.Event()
    ready.record()
    index_ = loader.start([(plan, slots)], [ready])
    counter.set_consumer(index_)
    for layer in range(layout.num_layers):
        counter.wait_until(layer)
    assert counter.finish(index_)
    counter.done_event(index_).synchronize()
    loader.close()
    manager.release(plan)


def test_pinned_slab_is_page_locked_aligned_and_copies_from_it_are_asynchronous():
    _, layout = cuda_layout(pages=8)
    slab = layout.host_slab(128, pin=True)  # 128 rows of 4 layers' pages
    assert slab.data_ptr() % 4096 == 0
    assert slab.is_pinned()  # cudaHostRegister took it (the whole mapping the slab views)
    alias = cuda_copies.host_alias(slab, layout.device)  # the GPU writes the host rows in place
    alias[3].fill_(7)
    torch.cuda.synchronize()
    assert int(slab[3].sum()) == 7 * slab.shape[1] and int(slab[2].sum()) == 0
    pinned = layout.host_slab(max(1, (256 << 20) // layout.block_bytes), pin=True).view(-1)
    dst = torch.empty(pinned.shape, dtype=torch.uint8, device="cuda")
    done = torch.cuda.Event()
    dst.copy_(pinned, non_blocking=True)
    done.record()
    assert not done.query()  # returned before the copy finished: a DMA from page-locked memory
    torch.cuda.synchronize()


def test_copy_streams_alias_neither_sglangs_nor_each_other():
    _, layout = cuda_layout(pages=8)
    forward = torch.cuda.Stream()
    layout.avoid_streams(torch.cuda.current_stream(), forward)
    drawn = [layout.new_stream() for _ in range(24)]  # more than a server draws (PyTorch's pool: 32 per priority)
    handles = [s.cuda_stream for s in drawn]
    assert len(set(handles)) == len(handles)
    assert forward.cuda_stream not in handles and torch.cuda.current_stream().cuda_stream not in handles


def test_each_copy_worker_runs_on_the_pools_device_with_its_staging_made_at_start():
    _, layout = cuda_layout(pages=8)
    worker = LaneExecutor("kvbm-test-copy", layout.worker_init())

    def where():
        return torch.cuda.current_device(), getattr(cuda_copies._local, "staging", None) is not None

    assert worker.submit(where).result(timeout=60) == (layout.device.index or 0, True)
    worker.shutdown()


def test_an_offload_waits_on_the_gpu_for_the_forward_that_writes_its_pages():
    """The forward stream is still writing the pages (it sleeps first) when the store is submitted; the
    scheduler's stream computes the slots after it. The host copy must hold the final values."""
    buffers, layout = cuda_layout()
    forward, scheduler = torch.cuda.Stream(), torch.cuda.Stream()
    layout.avoid_streams(torch.cuda.current_stream(), forward, scheduler)
    manager = LocalBlockManager(layout, 512, pin=True)
    pages = list(range(10, 74))
    with torch.cuda.stream(forward):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time before the write
        for view in buffers:
            view[10 * PAGE : 74 * PAGE].mul_(-1.0).add_(3.0)
    kv_written = torch.cuda.Event()
    kv_written.record(forward)
    with torch.cuda.stream(scheduler):
        scheduler.wait_event(kv_written)
        slots = slots_of(pages)  # computed on the scheduler's stream
        indices_ready = torch.cuda.Event()
        indices_ready.record()
    manager.store(request(pages, (indices_ready, kv_written), slots=slots))
    assert manager.wait(timeout=60)
    assert [ok for _, ok in manager.poll().completed] == [True]
    torch.cuda.synchronize()
    want = [layout.read_page(p) for p in pages]
    rows = manager.host.rows(list(request(pages).block_ids))
    for row, page_bytes in zip(rows, want):
        assert torch.equal(manager.host.slab[row, : layout.page_bytes], page_bytes)
    manager.close()


def test_layer_wise_load_on_a_forward_stream_reads_each_layer_after_its_wait():
    """The forward runs on its own stream and reads layer l right after wait_until(l), while later layers are
    still being copied; every layer it read equals what was stored, and the scheduler thread only enqueues (start()
    returns while what the loads wait for is still running on the GPU)."""
    buffers, layout = cuda_layout(pages=1024, layers=8)
    manager = LocalBlockManager(layout, 512, pin=True)
    pages = list(range(0, 256))
    stored = [layout.read_page(p) for p in pages]
    req = request(pages)
    manager.store(req)
    assert manager.wait(timeout=60)
    manager.poll()
    plan = manager.acquire(list(req.block_ids))
    targets = list(range(512, 768))
    counter = LayerCounter(layout.num_layers, cuda=True)
    loader = LayerLoader(manager, counter)
    forward, gate = torch.cuda.Stream(), torch.cuda.Stream()
    slots = slots_of(targets)
    gate.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(gate):  # what the loads wait for ends ~0.5 s from now, on the GPU
        torch.cuda._sleep(1_000_000_000)
        ready = torch.cuda.Event()
        ready.record()
    index_ = loader.start([(plan, slots)], [ready])
    assert not ready.query(), "start() waited for the GPU: the scheduler thread must only enqueue"
    counter.set_consumer(index_)
    read = []
    with torch.cuda.stream(forward):
        for layer in range(layout.num_layers):
            counter.wait_until(layer)
            k, v = layout.layers[layer]
            read.append((buffers[k][512 * PAGE : 768 * PAGE].clone(), buffers[v][512 * PAGE : 768 * PAGE].clone()))
    assert counter.finish(index_)
    torch.cuda.synchronize()
    for layer, (k, v) in enumerate(read):
        kb, vb = layout.layers[layer]
        assert torch.equal(k, buffers[kb][512 * PAGE : 768 * PAGE]) and torch.equal(v, buffers[vb][512 * PAGE : 768 * PAGE])
    for page, want in zip(targets, stored):
        assert torch.equal(layout.read_page(page), want)
    loader.close()
    manager.release(plan)
    manager.close()


def test_misaligned_pages_move_by_pinned_asynchronous_copies_only():
    """Pages whose bytes are not a multiple of 4096 (DeepSeek MLA at page 1: 70 272 B per layer set)."""
    buffers = [torch.randn(512, 1, 576, device="cuda").to(torch.bfloat16) for _ in range(61)]  # 61 layers x 1152 B
    layout = PagedKvLayout(buffers, 1, layers=[(l,) for l in range(61)])
    assert layout.page_bytes == 70_272 and layout.block_bytes % 4096 == 0
    manager = LocalBlockManager(layout, 256, pin=True)
    pages = [3, 4, 5, 90, 17, 200]
    stored = [layout.read_page(p) for p in pages]
    req = request(pages, page=1)
    targets = [300, 301, 302, 400, 7, 8]
    slots = slots_of(targets, 1)  # made by "the scheduler" before: not part of what is checked
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        manager.store(req)
        assert manager.wait(timeout=60)
        manager.poll()
        load(manager, layout, list(req.block_ids), targets, slots)
        torch.cuda.synchronize()
    names = {e.name for e in prof.events()}
    assert not [n for n in names if "Pageable" in n], sorted(n for n in names if "Memcpy" in n)
    for page, want in zip(targets, stored):
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


def test_a_failed_load_is_reported_and_its_enqueued_copies_end_first():
    _, layout = cuda_layout(pages=64)
    manager = LocalBlockManager(layout, 64, pin=True)
    req = request(list(range(8)))
    manager.store(req)
    manager.wait(timeout=60)
    manager.poll()
    plan = manager.acquire(list(req.block_ids))
    counter = LayerCounter(layout.num_layers, cuda=True)
    def disk_gone(index_, layer):
        if layer == 2:
            raise OSError("the rows went away")

    loader = LayerLoader(manager, counter, before_layer=disk_gone)
    index_ = loader.start([(plan, slots_of(list(range(20, 28))))], [])
    counter.set_consumer(index_)
    waited = threading.Event()
    threading.Thread(target=lambda: (counter.wait_until(3), waited.set()), daemon=True).start()
    assert waited.wait(30)
    assert not counter.finish(index_)
    loader.close()
    manager.release(plan)
    manager.close()


@pytest.mark.parametrize("page", [16, 1], ids=["64 KiB a buffer", "2 KiB a buffer (rows assembled on the device)"])
@pytest.mark.parametrize("rows", [[40, 41, 42, 43, 44, 45], [9, 2, 77, 3, 120, 64]], ids=["one run", "scattered"])
def test_save_and_layer_loads_between_the_pool_and_host_rows_directly(rows, page):
    """The copies themselves (no manager): device pages into host rows, then every layer back into other pages,
    with the rows one run (a strided slice read or written over PCIe) or scattered (a gather through staging)."""
    buffers, layout = cuda_layout(pages=128, page=page)
    slab = layout.host_slab(128, pin=True)
    pages, targets = [3, 90, 17, 18, 19, 64], [100, 5, 6, 7, 50, 127]
    stored = [layout.read_page(p) for p in pages]
    layout.save(index(pages, "cuda"), slab, index(rows))
    for row, want in zip(rows, stored):
        assert torch.equal(slab[row, : layout.page_bytes], want)
    for layer in range(layout.num_layers):
        layout.load_layer(layer, slab, index(rows), index(targets, "cuda"))
    torch.cuda.synchronize()
    for page, want in zip(targets, stored):
        assert torch.equal(layout.read_page(page), want)
