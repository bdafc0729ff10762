"""What ``gpu_e2e.py`` drives: SGLang's pool on the device, the model's forward on its own stream, the timed
admissions (recompute, a KvbmCache hit, a HiCache hit), the memcpy baseline, the stacks."""

from __future__ import annotations

import contextlib
import os
import time

import torch

import gpu_hicache
from gpu_model import Model

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
GB = 1e9


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


class Pool:
    """SGLang's MHA pool, paged allocator and cache parameters on the device."""

    def __init__(self, model: Model, tokens: int, page: int, context: int) -> None:
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

        from sglang_kvbm.integration.sglang.compat import cache_init_params

        s, self.page, self.tokens = model.shape, page, tokens
        self.kvcache = MHATokenToKVPool(tokens, page, model.dtype, s.kv_heads, s.head_dim, s.layers, DEV, False)
        self.allocator = PagedTokenToKVPoolAllocator(tokens, page, model.dtype, DEV, self.kvcache, need_sort=False)
        self.params = cache_init_params(
            disable=False, token_to_kv_pool_allocator=self.allocator, page_size=page,
            req_to_token_pool=ReqToTokenPool(size=4, max_context_len=context, device=DEV, enable_memory_saver=False))

    def scramble(self) -> None:
        """NaN in every slot (untimed, after an eviction): a forward that reads a slot before its load landed
        reads NaN, and its logits cannot equal the device hit's."""
        for layer in range(self.kvcache.layer_num):
            self.kvcache._get_key_buffer(layer).fill_(float("nan"))
            self.kvcache._get_value_buffer(layer).fill_(float("nan"))

    def alloc(self, count: int) -> torch.Tensor:
        slots = self.allocator.alloc(-(-count // self.page) * self.page)
        assert slots is not None, f"pool of {self.tokens} tokens: no room for {count}"
        return slots


class Bench:
    def __init__(self, model: Model, runs: int) -> None:
        self.model, self.runs = model, runs
        self.stream = torch.cuda.Stream() if CUDA else None  # SGLang's forward_stream
        self.empty = torch.empty(0, dtype=torch.int64, device=DEV)

    def forward(self, pool: Pool, ids: torch.Tensor, start: int, prefix: torch.Tensor, counter=None, consumer=-1):
        """The forward of ``ids[start:]`` after ``prefix`` (slots), on the forward stream; returns (logits, slots)."""
        count = ids.numel() - start
        slots = pool.alloc(count)
        if counter is not None:
            # TpModelWorker.set_hicache_consumer: the pool's reads wait per layer (KvbmCache.prefix(wait=False) sets
            # it too since a8bccc7; HiCache's counter needs it from here)
            counter.set_consumer(consumer)
        if self.stream is None:
            return self.model.forward(ids[start:], torch.arange(start, ids.numel()), prefix, slots[:count],
                                      pool.kvcache), slots
        self.stream.wait_stream(torch.cuda.current_stream())  # after the scheduler's work (slots, indices)
        with torch.cuda.stream(self.stream):
            positions = torch.arange(start, ids.numel(), device=DEV)
            logits = self.model.forward(ids[start:], positions, prefix, slots[:count], pool.kvcache)
        return logits, slots

    def repeat(self, once, prepare=lambda: None) -> tuple[list[float], torch.Tensor, list[dict]]:
        """``once()`` -> (seconds, logits, info), after ``prepare()`` (untimed); a warm-up, then ``runs`` runs."""
        times, infos, logits = [], [], None
        for run in range(self.runs + 1):
            prepare()
            seconds, logits, info = once()
            if run:
                times.append(seconds)
                infos.append(info)
        return times, logits, infos

    def recompute(self, pool: Pool, ids: torch.Tensor):
        sync()
        started = time.perf_counter()
        logits, slots = self.forward(pool, ids, 0, self.empty)
        sync()
        seconds = time.perf_counter() - started
        pool.allocator.free(slots)
        return seconds, logits, {}

    def kvbm_hit(self, stack, pool: Pool, ids: torch.Tensor, tokens: list[int]):
        cache, counter = stack, stack.linker.layer_done_counter  # stack: a KvbmCache
        sync()
        started = time.perf_counter()
        hit = cache.prefix(tokens, wait=False)  # the lower-tier part loads layer by layer from here on
        logits, slots = self.forward(pool, ids, len(hit.indices), hit.indices, counter,
                                     hit.pending.index if hit.pending is not None else -1)
        landed = cache.land(hit)
        counter.set_consumer(-1)
        sync()
        seconds = time.perf_counter() - started
        info = {"device_tokens": hit.device_tokens, "loaded_tokens": landed.loaded_tokens}
        cache.release(landed)
        pool.allocator.free(slots)
        return seconds, logits, info

    def hicache_hit(self, hc: gpu_hicache.HiCache, pool: Pool, ids: torch.Tensor, tokens: list[int]):
        sync()
        started = time.perf_counter()
        hit = hc.prefix(tokens, f"hicache-{time.monotonic_ns()}")
        logits, slots = self.forward(pool, ids, len(hit.indices), hit.indices, hc.counter, hit.consumer)
        hc.counter.set_consumer(-1)
        sync()
        seconds = time.perf_counter() - started
        hc.release(hit)
        pool.allocator.free(slots)
        return seconds, logits, {"device_tokens": hit.device_tokens, "loaded_tokens": hit.loaded_tokens,
                                 "enqueue_s": hit.enqueue_s, "runs": hit.runs}

    def populate(self, pool: Pool, ids: torch.Tensor, insert) -> None:
        """The prefill that cached the prefix: its pages written by the forward, then inserted."""
        _, slots = self.forward(pool, ids, 0, self.empty)
        sync()
        insert(slots)

    def memcpy(self, nbytes: int, layers: int) -> list[float]:
        """P's K+V bytes host -> device, one copy per layer (CUDA: pinned, on a side stream)."""
        host = torch.empty(layers, nbytes // layers, dtype=torch.uint8, pin_memory=CUDA)
        target = torch.empty_like(host, device=DEV)
        stream = torch.cuda.Stream() if CUDA else None
        times = []
        for run in range(self.runs + 1):
            sync()
            started = time.perf_counter()
            with torch.cuda.stream(stream) if CUDA else contextlib.nullcontext():
                for layer in range(layers):
                    target[layer].copy_(host[layer], non_blocking=CUDA)
            sync()
            if run:
                times.append(time.perf_counter() - started)
        return times


def drop_page_cache() -> str:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return "dropped before each read"
    except OSError as exc:
        return f"could not drop it ({exc.strerror or exc}): reads may come from the OS page cache"


def kvbm_stack(pool: Pool, bench: Bench, **config):
    from sglang_kvbm import KvbmConfig
    from sglang_kvbm.config import ConfigError
    from sglang_kvbm.integration.sglang import build_cache

    try:
        return build_cache(pool.params, KvbmConfig(**config), forward_stream=bench.stream)
    except ConfigError as exc:
        if "O_DIRECT" not in str(exc):
            raise
        print(f"# {exc}: buffered I/O instead")
        return build_cache(pool.params, KvbmConfig(**config, disk_disable_o_direct=True), forward_stream=bench.stream)


def settle_and_evict(cache) -> None:
    cache.flush(timeout=600)  # offloads done: their nodes unlock
    cache.evict(1 << 40)
