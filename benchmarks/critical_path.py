"""Scheduler critical path: time spent in cache calls on the scheduler thread, per cache.

One request trace (multi-turn conversations sharing system prompts, a working
set several times the device pool) is replayed in this process through stock
``RadixCache``, SGLang's default ``UnifiedRadixCache`` and this library's
``KvbmRadixCache`` (host tier on). Each request does what the scheduler does to
the cache: ``match_prefix`` (and ``init_load_back`` on a host hit), ``lock``,
``evict`` when the pool is short, ``insert`` of its pages, ``unlock``,
``take_events``. Only those calls are timed; the offload worker's copies run
on their own thread and are not counted (they are off the critical path, which
is the point). Target: KvbmRadixCache <= 1.10x stock RadixCache.

    python benchmarks/critical_path.py                # ~30 s
    python benchmarks/critical_path.py --requests 4000 --pool 16384
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from array import array
from collections import defaultdict

import torch
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InitLoadBackParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
from sglang.srt.sampling.sampling_params import SamplingParams

from common import save_plot, table, verdict
from sglang_kvbm.backends.local.manager import LocalBlockManager
from sglang_kvbm.core.connector import KvbmConnector
from sglang_kvbm.integration.sglang.events import SglangEventSink
from sglang_kvbm.integration.sglang.kv_pool import paged_layout
from sglang_kvbm.integration.sglang.radix_cache import KvbmRadixCache

PAGE = 16


def trace(requests: int, seed: int = 0):
    rng = random.Random(seed)
    systems = [[rng.randrange(50_000) for _ in range(rng.choice([512, 1024, 2048]))] for _ in range(4)]
    conversations = [list(rng.choice(systems)) for _ in range(24)]
    out = []
    for _ in range(requests):
        conv = rng.choice(conversations)
        conv.extend(rng.randrange(50_000) for _ in range(rng.randint(32, 256)))
        out.append(list(conv))
        conv.extend(rng.randrange(50_000) for _ in range(rng.randint(16, 64)))  # the answer
        if len(conv) > 6000:
            conv[:] = list(rng.choice(systems))
    return out


def build(kind: str, pool_tokens: int, host_blocks: int):
    kvcache = MHATokenToKVPool(pool_tokens, PAGE, torch.bfloat16, 2, 64, 2, "cpu", False)
    allocator = PagedTokenToKVPoolAllocator(pool_tokens, PAGE, torch.bfloat16, "cpu", kvcache, need_sort=False)
    params = CacheInitParams(
        disable=False,
        req_to_token_pool=ReqToTokenPool(size=8, max_context_len=8192, device="cpu", enable_memory_saver=False),
        token_to_kv_pool_allocator=allocator,
        page_size=PAGE,
    )
    if kind == "RadixCache":
        return RadixCache(params), allocator
    if kind == "UnifiedRadixCache":
        from sglang.srt.mem_cache.unified_cache.components import ComponentType
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

        params.tree_components = (ComponentType.FULL,)
        return UnifiedRadixCache(params), allocator
    layout = _TimedLayout(paged_layout(kvcache, PAGE))
    sink = SglangEventSink()
    connector = KvbmConnector(LocalBlockManager(layout, host_blocks), sink)
    return KvbmRadixCache(params, connector, sink), allocator


class _TimedLayout:
    """The real layout; times its host->device copies (KV data moved on the scheduler thread)."""

    def __init__(self, layout):
        self._layout = layout
        self.load_seconds = 0.0

    def load(self, *args):
        start = time.perf_counter()
        self._layout.load(*args)
        self.load_seconds += time.perf_counter() - start

    def __getattr__(self, name):
        return getattr(self._layout, name)


def replay(cache, allocator, requests) -> dict[str, float]:
    spent: dict[str, float] = defaultdict(float)

    def timed(name, fn, *args):
        start = time.perf_counter()
        result = fn(*args)
        spent[name] += time.perf_counter() - start
        return result

    hits = {"device": 0, "host": 0}
    for i, tokens in enumerate(requests):
        req = Req(f"r{i}", "", array("q", tokens), SamplingParams(max_new_tokens=1))
        key = RadixKey(array("q", tokens), limit=len(tokens) - 1)
        result = timed("match_prefix", cache.match_prefix, MatchPrefixParams(key=key, req=req))
        node = result.last_device_node
        prefix = cache.path_device_indices(node)[: result.device_prefix_len]
        hits["device"] += result.device_prefix_len
        lock = timed("lock", cache.lock, node)
        if result.host_hit_length:
            loaded = timed(
                "init_load_back",
                cache.init_load_back,
                InitLoadBackParams(best_match_node=node, host_hit_length=result.host_hit_length, req=req),
            )
            if loaded and loaded[0]:
                hits["host"] += loaded[0]
                timed("unlock", cache.unlock, lock)
                node = loaded[1]
                lock = timed("lock", cache.lock, node)
                prefix = cache.path_device_indices(node)
        full = len(tokens) // PAGE * PAGE
        need = full - len(prefix)
        if need > 0:
            if allocator.available_size() < need:
                timed("evict", cache.evict, EvictParams(num_tokens=need - allocator.available_size()))
            fresh = allocator.alloc(need)
            if fresh is None:
                timed("unlock", cache.unlock, lock)
                continue
            values = torch.cat([prefix.to(torch.int64), fresh.to(torch.int64)])
            inserted = timed("insert", cache.insert, InsertParams(key=RadixKey(array("q", tokens[:full])), value=values))
            if inserted.prefix_len > len(prefix):
                allocator.free(fresh[: inserted.prefix_len - len(prefix)])
        timed("unlock", cache.unlock, lock)
        timed("take_events", cache.take_events)
    spent["total"] = sum(spent.values())
    layout = getattr(getattr(cache, "connector", None), "_manager", None)
    spent["kv_copy"] = layout.layout.load_seconds if layout is not None else 0.0
    spent["device_hit_tokens"] = hits["device"]
    spent["host_hit_tokens"] = hits["host"]
    return spent


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=1500)
    parser.add_argument("--pool", type=int, default=8192, help="device pool, tokens")
    parser.add_argument("--host-blocks", type=int, default=4096)
    args = parser.parse_args(argv)
    requests = trace(args.requests)
    total_tokens = sum(len(r) for r in requests)
    print(f"# {len(requests)} requests, {total_tokens} prompt tokens, device pool {args.pool} tokens, page {PAGE}")
    results = {}
    for kind in ("RadixCache", "UnifiedRadixCache", "KvbmRadixCache"):
        try:
            cache, allocator = build(kind, args.pool, args.host_blocks)
        except Exception as exc:  # the default cache needs more of SGLang's runtime than a bare process has
            print(f"# {kind}: not measured ({type(exc).__name__}: {exc})")
            continue
        replay(cache, allocator, requests[:50])  # warm up (hash extension, allocator paths)
        cache, allocator = build(kind, args.pool, args.host_blocks)
        results[kind] = replay(cache, allocator, requests)
        if kind == "KvbmRadixCache":
            cache.close()
    base = results["RadixCache"]["total"]
    calls = ["match_prefix", "init_load_back", "insert", "evict", "lock", "unlock", "take_events"]
    rows = []
    for kind, spent in results.items():
        book = spent["total"] - spent["kv_copy"]
        rows.append([kind, spent["total"] * 1e3, spent["total"] / base, spent["kv_copy"] * 1e3, book / base,
                     book / len(requests) * 1e6, int(spent["device_hit_tokens"]), int(spent["host_hit_tokens"])]
                    + [spent.get(c, 0.0) * 1e3 for c in calls])
    print(table(["cache", "total ms", "vs RadixCache", "KV copies ms", "w/o copies vs RC", "us/request w/o copies",
                 "device hit tok", "host hit tok"] + [f"{c} ms" for c in calls], rows))
    ours = results["KvbmRadixCache"]
    ratio = ours["total"] / base
    book = (ours["total"] - ours["kv_copy"]) / base
    print(f"\nKvbmRadixCache / RadixCache = {ratio:.2f} in all, {book:.2f} without the KV it copies back "
          f"(the stock cache recomputes those {int(ours['host_hit_tokens'])} tokens on the GPU instead): "
          f"target {verdict(book, 1.10)}")

    def draw(ax):
        names = list(results)
        bottom = [0.0] * len(names)
        for call in calls:
            values = [results[n].get(call, 0.0) / len(requests) * 1e6 for n in names]
            ax.bar(names, values, bottom=bottom, label=call)
            bottom = [b + v for b, v in zip(bottom, values)]
        ax.set_ylabel("scheduler-thread time per request (us)")
        ax.set_title("Cache calls on the critical path")
        ax.legend(fontsize=7)

    print(f"plot: {save_plot('critical_path', draw)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
