"""SGLang's own KV pools and default tree with this library's linker, driven as SGLang's scheduler drives them.

The stack is the one a user runs (``tests/conftest.py::build_stack``: SGLang's
pool and allocator, ``UnifiedRadixCache`` with ``KvbmLinker`` adopted as the
scheduler adopts it), built on CUDA where there is one and on CPU always: the
CPU case is this module's twin in the normal suite, so it does not rot between
GPU runs (``make gpu-check`` runs it on a GPU, plainly and under
``TORCH_CUDA_SANITIZER=1``). Each case does what a scheduler does to it:

* a prefill on the forward stream writes a request's pages while the scheduler
  inserts them, so the offload is handed pages the forward is still writing
  (and another request's pages are written into the same pool meanwhile);
* completions, a flush, eviction from the device (the pool is then scrambled);
* admission of the request plus a suffix: match, ``init_load_back``, the
  layer-wise load started, a forward on its own stream reading each layer
  through ``get_key_buffer(layer)`` (which waits for that layer, as SGLang's
  attention backends do) and writing the suffix's pages, then
  ``finish_external_linker_loads``;
* a reset, after which nothing is found.

The bytes the forward read, layer by layer, and the pages in the pool equal
what was written; pools MHA bf16, MLA, FP8 (e4m3 storage) and NVFP4 (FP8 scales
per 16 values); pages 1, 16 and 64; the host tier, and the disk tier alone.
"""

from __future__ import annotations

import contextlib
import time
from array import array

import pytest
import torch

pytest.importorskip("sglang.srt.mem_cache.unified_radix_cache", reason="needs SGLang (make gpu-pack carries it)")

from conftest import build_stack  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs CUDA")])]
POOLS = ["mha", "mla", "fp8_e4m3", "nvfp4"]
PAGES = [1, 16, 64]
LAYERS = 4
REQUEST_PAGES = 4  # pages of the cached prefix
HOLD = 0.02  # seconds the loader holds back each layer after the first
SLEEP_CYCLES = 20_000_000  # ~10 ms of GPU time queued ahead of a prefill's writes: the offload is handed them early


def tokens_of(seed: int, count: int) -> list[int]:
    return [seed * 100_003 + i for i in range(count)]


class Driver:
    """One stack and its forward stream, driven as SGLang's scheduler drives them."""

    def __init__(self, device: str, pool: str, page: int, tier: str, disk_dir) -> None:
        self.device = device
        self.forward_stream = torch.cuda.Stream() if device == "cuda" else None
        tiers = {"host_blocks": 64} if tier == "host" else {"host_blocks": 0, "disk_blocks": 64,
                                                            "disk_dir": disk_dir}
        self.stack = build_stack(pool=pool, page_size=page, size=16 * REQUEST_PAGES * page, layers=LAYERS,
                                 device=device, dtype=torch.bfloat16, forward_stream=self.forward_stream, **tiers)
        self.kvcache = self.stack.kvcache

    def forward(self):
        """The forward's stream (after what the scheduler's stream queued so far, as SGLang orders it)."""
        if self.forward_stream is None:
            return contextlib.nullcontext()
        self.forward_stream.wait_stream(torch.cuda.current_stream())
        return torch.cuda.stream(self.forward_stream)

    def write(self, slots: torch.Tensor, seed: int, *, late: bool = False) -> list[torch.Tensor]:
        """A prefill writing random bytes into the pages behind ``slots`` (on the forward stream, after ``late``
        queued GPU time); returns each page's bytes, on the device."""
        gen = torch.Generator(self.device).manual_seed(seed)
        layout, written = self.stack.layout, []
        with self.forward():
            if late and self.device == "cuda":
                torch.cuda._sleep(SLEEP_CYCLES)
            for page in (slots[:: self.stack.page_size] // self.stack.page_size).tolist():
                data = torch.randint(0, 256, (layout.page_bytes,), dtype=torch.uint8, device=self.device,
                                     generator=gen)
                layout.write_page(page, data)
                written.append(data)
        return written

    def rows(self, slots: torch.Tensor, consumer: int = -1) -> list[torch.Tensor]:
        """What a forward of batch ``consumer`` (its loads' index, -1 for none) reads of ``slots``, layer by layer,
        through the pool: SGLang's worker sets the consumer, and each read waits for its layer."""
        self.kvcache.layer_transfer_counter.set_consumer(consumer)  # TpModelWorker.set_hicache_consumer
        read = []
        with self.forward():
            for layer in range(LAYERS):
                read.append(self.kvcache.get_key_buffer(layer)[slots].view(torch.uint8).clone())
        return read

    def prefill(self, tokens: list[int], seed: int, *, late: bool = True) -> tuple[list, list]:
        """A request with nothing cached: its pages written by the forward and inserted while still being written."""
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        from sglang_kvbm.integration.sglang.compat import device_prefix_len

        req, match, loaded, _, _ = self.stack.admit(tokens + [0], f"prefill-{seed}")
        assert loaded == 0 and device_prefix_len(match) == 0
        slots = self.stack.allocator.alloc(len(tokens))
        written = self.write(slots, seed, late=late)
        rows = self.rows(slots)
        # The scheduler hands the pages over now; the forward stream may still be writing them.
        key = RadixKey(array("q", tokens), None)
        result = self.stack.tree.insert(InsertParams(key=key, value=slots.to(torch.int64)))
        assert result.prefix_len == 0
        return written, rows


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


@pytest.mark.parametrize("tier", ["host", "disk"])
@pytest.mark.parametrize("page", PAGES)
@pytest.mark.parametrize("pool", POOLS)
def test_scheduler_round_trip(device, pool, page, tier, tmp_path, native_hash_loaded):
    drive = Driver(device, pool, page, tier, tmp_path)
    stack = drive.stack
    try:
        a = tokens_of(1, REQUEST_PAGES * page)
        written, rows = drive.prefill(a, seed=1)
        # Another request's prefill writes the same pool while a's offload may still be copying.
        drive.prefill(tokens_of(2, REQUEST_PAGES * page), seed=2, late=False)
        stack.settle()  # completions: every copy done, every offload handed back to the tree
        ids = stack.block_ids(a)
        peek = (REQUEST_PAGES, REQUEST_PAGES) if tier == "host" else (0, REQUEST_PAGES)  # (host, any tier)
        assert stack.linker.connector.peek(ids) == peek

        assert stack.evict_all() >= 2 * len(a)
        stack.scramble_pool()
        suffix = tokens_of(3, page + 1)
        # Every layer after the first is handed over late: a read that did not wait would see the scrambled pool.
        stack.linker.loader.before_layer = lambda index, layer: time.sleep(HOLD) if layer else None
        req, match, loaded, slots, consumer = stack.admit(a + suffix, "hit")
        assert loaded == len(a) and slots is not None
        read = drive.rows(slots, consumer)  # the forward: every layer read as soon as it is loaded
        drive.write(stack.allocator.alloc(len(suffix) // page * page), seed=3)  # and the suffix's pages written
        assert stack.finish(req), "the load failed"
        if drive.forward_stream is not None:
            drive.forward_stream.synchronize()
        for layer, (got, want) in enumerate(zip(read, rows)):
            assert torch.equal(got.cpu(), want.cpu()), f"layer {layer} read before it was loaded, or wrong bytes"
        pages = stack.read_pages(slots)
        assert all(torch.equal(got, want.cpu()) for got, want in zip(pages, written)), "bytes back differ"

        stack.tree.reset()
        stack.tree.check_hicache_events()
        assert stack.linker.connector.peek(ids) == (0, 0)
        _, match, loaded, _, _ = stack.admit(a + suffix, "after-reset")
        assert loaded == 0 and match.host_hit_length == 0
    finally:
        if drive.forward_stream is not None:
            torch.cuda.synchronize()
        stack.cache.close()
