"""A forward with a host hit against the same forward with a device hit, layer by layer.

What a layer-wise load is for: while layer ``l`` computes, layer ``l+1`` is
copied, so a host hit should cost about what a device hit costs. This runs a
stand-in forward (per layer: one matmul over the layer's K and V pages, as
attention reads them) over a KV pool laid out like SGLang's MHA pool:

* ``device hit``: the KV is already in the pool (the baseline, same run);
* ``host hit``: the same forward, each layer first waiting (``wait_until``) for
  the loader thread's copy of it from the pinned host tier, as SGLang's KV pool
  makes it wait (``layer_counter``, ``tiers/layer_loader``).

It also reports what the scheduler thread spent handing the load over
(``LayerLoader.start``) and, per layer, how long the forward waited. Torch and
this package only (no SGLang): it runs on a bare GPU machine.

    python benchmarks/layer_overlap.py                   # CPU, small
    python benchmarks/layer_overlap.py --device cuda --pages 2048 --layers 32
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from common import table, verdict
from sglang_kvbm.core.identity import chain_hashes
from sglang_kvbm.core.pages import one_page
from sglang_kvbm.core.ports import StoreRequest
from sglang_kvbm.manager.block_manager import LocalBlockManager
from sglang_kvbm.manager.layer_loader import LayerLoader
from sglang_kvbm.transfer.kv_layout import PagedKvLayout
from sglang_kvbm.transfer.layer_counter import LayerCounter


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def ready_now(device: str) -> tuple:
    """What a copy waits for: everything the current stream did so far (CUDA), nothing on CPU."""
    if device != "cuda":
        return ()
    event = torch.cuda.Event()
    event.record()
    return (event,)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--pages", type=int, default=64, help="pages of the hit")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=256, help="width of the stand-in forward's matmul")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    dev, ps, n, layers = args.device, args.page_size, args.pages, args.layers
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    pool_pages = 2 * n + 1
    buffers = [torch.randn(pool_pages * ps, args.heads, args.head_dim, device=dev).to(dtype) for _ in range(2 * layers)]
    layout = PagedKvLayout(buffers, ps, layers=[(l, layers + l) for l in range(layers)])
    manager = LocalBlockManager(layout, n, pin=dev == "cuda")
    ids = tuple(chain_hashes(list(range(n * ps)), ps))
    source = torch.arange(ps, (n + 1) * ps, device=dev)  # pages 1..n hold the prefix
    manager.store(StoreRequest(ids, source, lambda positions: [one_page(ids[p]) for p in positions], ready_now(dev)))
    assert manager.wait(timeout=120)
    manager.poll()
    target_slots = torch.arange((n + 1) * ps, (2 * n + 1) * ps, device=dev)  # where the load lands
    rows = slice((n + 1) * ps, (2 * n + 1) * ps)
    weight = torch.randn(args.heads * args.head_dim, args.hidden, device=dev).to(dtype)

    def forward(wait=None) -> list[float]:
        """Per layer: wait for the layer (host hit) then attend-ish over its K and V; returns each wait."""
        waits = []
        acc = torch.zeros((), device=dev, dtype=dtype)
        for layer in range(layers):
            if wait is not None:
                started = time.perf_counter()
                wait(layer)
                waits.append(time.perf_counter() - started)
            k, v = layout.layers[layer]
            keys = buffers[k][rows].reshape(-1, args.heads * args.head_dim)
            vals = buffers[v][rows].reshape(-1, args.heads * args.head_dim)
            acc = acc + (keys @ weight).sum() + (vals @ weight).sum()
        sync(dev)
        return waits

    counter = LayerCounter(layers, cuda=dev == "cuda")
    loader = LayerLoader(manager, counter)
    device_times, host_times, start_times, waits_by_layer = [], [], [], [[] for _ in range(layers)]
    def device_hit() -> float:
        sync(dev)
        started = time.perf_counter()
        forward()
        return time.perf_counter() - started

    def host_hit() -> tuple[float, float, list[float]]:
        plan = manager.acquire(list(ids))
        ready = ready_now(dev)
        sync(dev)
        started = time.perf_counter()
        index = loader.start([(plan, target_slots)], ready)
        handed = time.perf_counter() - started
        counter.set_consumer(index)
        waits = forward(counter.wait_until)
        assert counter.finish(index)
        sync(dev)
        seconds = time.perf_counter() - started
        manager.release(plan)
        counter.forget(index)
        return seconds, handed, waits

    for round_ in range(args.repeat + 1):  # the first round warms up and is dropped; the order alternates
        if round_ % 2:
            device_s = device_hit()
            host_s, handed, waits = host_hit()
        else:
            host_s, handed, waits = host_hit()
            device_s = device_hit()
        if round_:
            device_times.append(device_s)
            host_times.append(host_s)
            start_times.append(handed)
            for layer, w in enumerate(waits):
                waits_by_layer[layer].append(w)
    loader.close()
    manager.close()
    device_ms, host_ms = statistics.median(device_times) * 1e3, statistics.median(host_times) * 1e3
    nbytes = n * layout.page_bytes
    copy_ms = copy_limit_ms(dev, nbytes // layers, layers, args.repeat)
    best_ms = max(device_ms, copy_ms)
    print(f"# {dev}: {n} pages x {ps} tokens, {layers} layers, {nbytes / 2**20:.1f} MiB of KV; medians of {args.repeat}")
    print(table(["forward", "ms", "vs device hit", "vs best possible"], [
        ["device hit (baseline)", device_ms, 1.0, device_ms / best_ms],
        ["plain copy of the KV (memcpy, per layer)", copy_ms, copy_ms / device_ms, copy_ms / best_ms],
        ["host hit, layer-wise", host_ms, host_ms / device_ms, host_ms / best_ms],
    ]))
    print("(best possible: the slower of the device hit and the plain copy, i.e. a copy that hides under the forward "
          "or a forward that hides under the copy)")
    print()
    print(table(["layer", "forward waited (ms)"], [[l, statistics.median(w) * 1e3] for l, w in enumerate(waits_by_layer)]))
    print(f"\nscheduler thread, LayerLoader.start: {statistics.median(start_times) * 1e6:.0f} us (median)")
    print(f"host hit vs device hit: {host_ms / device_ms:.3f}x" + ("" if dev == "cuda" else f", {verdict(host_ms / device_ms, 1.05)}"))
    if dev == "cuda":  # PCIe, not the forward, bounds a GPU host hit: the stand-in forward reads HBM at TB/s
        print(f"host hit vs best possible: {host_ms / best_ms:.3f}x, {verdict(host_ms / best_ms, 1.1)}")


def copy_limit_ms(dev: str, layer_bytes: int, layers: int, repeat: int) -> float:
    """A plain contiguous copy of ``layers`` x ``layer_bytes`` into the device (CUDA: from pinned memory, the DMA's
    limit), one layer's bytes at a time: the floor of any host hit's copy."""
    host = torch.ones(layer_bytes, dtype=torch.uint8, pin_memory=dev == "cuda")
    target = torch.empty(layer_bytes, dtype=torch.uint8, device=dev)
    times = []
    for _ in range(repeat + 1):
        sync(dev)
        started = time.perf_counter()
        for _ in range(layers):
            target.copy_(host, non_blocking=True)
        sync(dev)
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:]) * 1e3


if __name__ == "__main__":
    main()
