"""Stress: a device page is never freed or reused while a copy reads it, a host row never while one
writes it, and completions of a reset cache are ignored.

Copies are held back behind gates opened at random points, so stores pile up
while the scenario evicts, reallocates, loads and resets around them. KV bytes
are a pure function of the block id (as a model's KV is of its tokens): any
copy that read a reused page, or a row written twice, shows as bytes that
differ from that function.
"""

from __future__ import annotations

import hashlib
import random
import threading
from array import array
from concurrent.futures import ThreadPoolExecutor

import torch
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InitLoadBackParams, InsertParams
from sglang.srt.mem_cache.common import match_kv_cache
from sglang.srt.mem_cache.radix_cache import RadixKey

from conftest import build_stack, make_req
from sglang_kvbm.core.identity import chain_hashes


class SteppedExecutor(ThreadPoolExecutor):
    """One worker; each job waits for the gate that was current when it was submitted."""

    def __init__(self):
        super().__init__(max_workers=1)
        self.gate = threading.Event()

    def submit(self, fn, *args, **kwargs):
        gate = self.gate

        def gated():
            if not gate.wait(timeout=120):
                raise TimeoutError("gate never opened")
            return fn(*args, **kwargs)

        return super().submit(gated)

    def release(self):
        self.gate.set()
        self.gate = threading.Event()


def kv_of(block_id: str, nbytes: int) -> torch.Tensor:
    seed = int.from_bytes(hashlib.sha256(block_id.encode()).digest()[:8], "little")
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def test_copies_never_race_page_reuse_or_reset():
    rng = random.Random(11)
    executor = SteppedExecutor()
    stack = build_stack(size=256, host_blocks=48, executor=executor)
    cache, allocator, layout = stack.cache, stack.allocator, stack.layout
    prompts = [[rng.randrange(5000) for _ in range(rng.choice([16, 32, 48]))] for _ in range(16)]
    checked_loads = resets = 0
    try:
        for step in range(400):
            op = rng.random()
            tokens = rng.choice(prompts)
            if op < 0.45:
                req = make_req(tokens + [1], rid=f"s{step}")
                match_kv_cache(req, cache)
                lock = cache.lock(req.last_node)
                prefix = cache.path_device_indices(req.last_node)[: req.prefix_len]
                if req.host_hit_length:
                    loaded = cache.init_load_back(
                        InitLoadBackParams(best_match_node=req.best_match_node, host_hit_length=req.host_hit_length, req=req)
                    )
                    if loaded is not None and loaded[0]:
                        node = loaded[1]
                        cache.unlock(lock)
                        lock = cache.lock(node)
                        prefix = cache.path_device_indices(node)
                        for block_id, page in zip(node.hash_value, (node.value[::4] // 4).tolist()):
                            assert torch.equal(layout.read_page(page), kv_of(block_id, layout.page_bytes))
                            checked_loads += 1
                need = len(tokens) - len(prefix)
                if need:
                    if allocator.available_size() < need:
                        cache.evict(EvictParams(num_tokens=need))
                    fresh = allocator.alloc(need)
                    if fresh is not None:
                        values = torch.cat([prefix.to(torch.int64), fresh.to(torch.int64)])
                        # The forward pass writes the KV of the new pages (a function of their ids).
                        ids = chain_hashes(tokens, 4)
                        for block_id, page in zip(ids[len(prefix) // 4 :], (fresh[::4] // 4).tolist()):
                            layout.write_page(page, kv_of(block_id, layout.page_bytes))
                        cache.insert(InsertParams(key=RadixKey(array("q", tokens)), value=values))
                cache.unlock(lock)
            elif op < 0.75:
                cache.evict(EvictParams(num_tokens=rng.choice([16, 64, 256])))
                # Freed pages are reused at once and overwritten: a copy still reading them would see this.
                grabbed = allocator.alloc(allocator.available_size() // 8 * 4)
                if grabbed is not None:
                    for page in (grabbed[::4] // 4).tolist():
                        layout.write_page(page, torch.full((layout.page_bytes,), 0xEE, dtype=torch.uint8))
                    allocator.free(grabbed)
            elif op < 0.97:
                executor.release()
                cache.take_events()
            else:
                cache.reset()  # a flush with copies in flight: their completions must be ignored
                allocator.clear()
                resets += 1
        executor.release()
        assert cache.connector.flush(timeout=60)
        host = stack.manager.host
        for block_id, (row, _) in list(host._registered.items()):
            assert torch.equal(host.slab[row, : layout.page_bytes], kv_of(block_id, layout.page_bytes)), block_id
        assert len(host) + host.free_rows() == host.capacity
        assert cache.protected_size() == 0
        cache.evict(EvictParams(num_tokens=stack.size))
        assert allocator.available_size() == stack.size
        assert checked_loads > 50 and resets > 0
    finally:
        executor.release()
        executor.shutdown()
        cache.close()
