"""Scheduler critical path: time spent in cache calls on the scheduler thread, per cache.

One request trace (multi-turn conversations sharing system prompts, a working
set several times the device pool) is replayed in this process through SGLang's
default ``UnifiedRadixCache`` without a linker (the baseline), the same tree
with this library's ``KvbmLinker`` (host tier on), the same tree with SGLang's
own HiCache host tier (``HiRadixCache``, the peer: ``hicache_inproc.py``) with as
many host bytes, and stock ``RadixCache`` (for reference). Each request does to
the cache what SGLang's scheduler does:

* every step: ``check_hicache_events`` (finished offloads and loads),
* ``match_prefix`` with the request, a lock on the match, ``evict`` when the pool is short,
* with a lower-tier hit: ``init_load_back`` and ``ready_to_load_host_cache`` (the layer-wise
  load starts) and, after the forward, ``finish_external_linker_loads`` (``finish_loads``: the
  load's rows are let go),
* ``insert`` of its pages (the linker's write-through offload happens inside it; HiCache's
  is submitted by ``flush_pending_backups``), unlock, ``take_events``.

Only those calls are timed. The linker's copies run on its worker threads and are
not counted; the wait for a load's layers (``load wait``: in a server the forward runs
while they load; here there is no forward) is shown apart and not counted. HiCache's copies run inside its
calls on CPU (``copies``, taken out of its total: on a GPU they are kernels on a side
stream). Between requests the linker's copies in flight finish (untimed), as they
would behind a forward; their hand-over to the copy thread (``Offloads.flush``: the
first thing a server's per-step poll does, and it wakes that thread) is timed, in
``check_hicache_events``. ``--no-gap`` leaves no such time, so nodes stay locked by
offloads and loads find no room. ``--profile`` splits each cache's time by whose code
it is (cProfile: SGLang, this library, PyTorch). Torch runs one intra-op thread
(``--threads``): on 2 cores OpenMP's spinning threads starve the scheduler thread
whenever a copy runs, which a GPU server's copies do not. ``--events`` turns KV
events on (the tree's and the tiers'), as in a worker behind Dynamo's router.

This VM's timings drift by up to ±30% within minutes, so the caches run side by
side, a request at a time each in turn (``lockstep``: a slow second hits all of
them), over ``--rounds`` rounds: each figure is its median across rounds, each
ratio the median of the rounds' own ratios (with its range). Each cache warms up
alone on the trace's first 50 requests first.

    python benchmarks/critical_path.py                      # ~2 minutes (3 rounds of 1500 requests)
    python benchmarks/critical_path.py --requests 600 --rounds 5 --events
    python benchmarks/critical_path.py --page-size 1 --requests 300 --profile
    # and each profile whole, for pstats: /tmp/cp-<cache>.prof
    KVBM_BENCH_PROFILE_DUMP=/tmp/cp python benchmarks/critical_path.py --page-size 1 --requests 300 --profile
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import os
import pstats
import random
import statistics
import sys
import time
from array import array
from collections import defaultdict

import torch
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InitLoadBackParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
from sglang.srt.mem_cache.unified_cache.components import ComponentType
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
from sglang.srt.sampling.sampling_params import SamplingParams

import hicache_inproc
from common import save_plot, table, verdict
from sglang_kvbm import KvbmConfig
from sglang_kvbm.integration.sglang.custom import build_cache, ensure_runtime_context
from sglang_kvbm.integration.sglang.page_identity import InsertContext

KINDS = ("UnifiedRadixCache", "UnifiedRadixCache+KvbmLinker", "HiRadixCache", "RadixCache")
CALLS = ["check_hicache_events", "match_prefix", "init_load_back", "ready_to_load", "finish_loads", "insert",
         "flush_backups", "evict", "lock", "unlock", "take_events"]


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


def build(kind: str, pool_tokens: int, host_blocks: int, page: int, events: bool = False):
    kvcache = MHATokenToKVPool(pool_tokens, page, torch.bfloat16, 2, 64, 2, "cpu", False)
    if page == 1:  # what SGLang builds at its default page size
        allocator = TokenToKVPoolAllocator(pool_tokens, torch.bfloat16, "cpu", kvcache, need_sort=False)
    else:
        allocator = PagedTokenToKVPoolAllocator(pool_tokens, page, torch.bfloat16, "cpu", kvcache, need_sort=False)
    params = CacheInitParams(
        disable=False,
        req_to_token_pool=ReqToTokenPool(size=8, max_context_len=8192, device="cpu", enable_memory_saver=False),
        token_to_kv_pool_allocator=allocator,
        page_size=page,
        enable_kv_cache_events=events,  # the tree's GPU events and the tiers' (what a Dynamo worker runs with)
    )
    ensure_runtime_context("cpu")
    if kind == "RadixCache":
        return RadixCache(params), allocator, None
    if kind == "UnifiedRadixCache":
        params.tree_components = (ComponentType.FULL,)
        return UnifiedRadixCache(params), allocator, None
    if kind == "HiRadixCache":  # SGLang's HiCache: the same tree with its own host tier, as many bytes as ours
        params.tree_components = (ComponentType.FULL,)
        return hicache_inproc.build(params, pool_tokens, host_blocks * page), allocator, None
    cache = build_cache(params, KvbmConfig(cpu_cache_blocks=host_blocks))
    return cache.tree, allocator, cache


def replay(cache, allocator, requests, linked: bool, page: int, prof=None, gap: bool = True) -> dict[str, float]:
    spent: dict[str, float] = defaultdict(float)
    with copy_thread_cpu() as describe_cpu:
        for _ in steps(cache, allocator, requests, linked, page, prof, gap, spent):
            pass
    return totals(spent, describe_cpu[0])


def totals(spent: dict[str, float], describe_cpu: float) -> dict[str, float]:
    spent["total"] = sum(spent.get(call, 0.0) for call in CALLS)  # the load wait is not a cache call's own time
    spent["describe_cpu"] = describe_cpu
    return spent


def lockstep(replays) -> None:
    """Run replays (``steps`` generators) a request at a time, each in turn, who goes first rotating: a slow
    second of this VM hits every cache alike, so their ratios hold where each one's figure drifts."""
    live = list(replays)
    turn = 0
    while live:
        first = turn % len(live)
        for replay_steps in live[first:] + live[:first]:
            if next(replay_steps, StopIteration) is StopIteration:
                live.remove(replay_steps)
        turn += 1


@contextlib.contextmanager
def copy_thread_cpu():
    """CPU seconds the copy threads spend describing stored pages (``InsertContext.describe``: metas, event
    identities, and SGLang's chain hash, which releases the GIL); not scheduler-thread time, not in ``total``."""
    spent = [0.0]
    original = InsertContext.describe

    def describe(self, *args):
        start = time.thread_time()
        try:
            return original(self, *args)
        finally:
            spent[0] += time.thread_time() - start

    InsertContext.describe = describe
    try:
        yield spent
    finally:
        InsertContext.describe = original


def steps(cache, allocator, requests, linked, page, prof, gap, spent):
    """``replay`` a request at a time (``lockstep``): each ``next`` runs one, timing its calls into ``spent``."""

    def timed(name, fn, *args):
        if prof is not None:  # the profile: the cache calls' code only
            prof.enable()
            try:
                return fn(*args)
            finally:
                prof.disable()
        start = time.perf_counter()
        result = fn(*args)
        spent[name] += time.perf_counter() - start
        return result

    hits = {"device": 0, "host": 0}
    for i, tokens in enumerate(requests):
        yield
        if linked:
            if gap:  # the forward the copies run behind in a server: the previous request's copies are done (untimed)
                manager = cache.linker.cache_linker.manager
                # but their hand-over to the copy thread, which wakes it, is the first thing a server's poll does
                timed("check_hicache_events", manager.offloads.flush)
                manager.wait(30)
            timed("check_hicache_events", cache.check_hicache_events)
        req = Req(f"r{i}", "", array("q", tokens), SamplingParams(max_new_tokens=1))
        key = RadixKey(array("q", tokens), limit=len(tokens) - 1)
        result = timed("match_prefix", cache.match_prefix, MatchPrefixParams(key=key, req=req))
        node = result.last_device_node
        prefix = cache.path_device_indices(node)[: result.device_prefix_len]
        hits["device"] += result.device_prefix_len
        lock = timed("lock", cache.inc_lock_ref, node).to_dec_params()
        loaded_slots = None
        if result.host_hit_length:
            req.last_node = node
            loaded, _ = timed("init_load_back", cache.init_load_back, InitLoadBackParams(
                best_match_node=result.best_match_node, host_hit_length=result.host_hit_length, req=req))
            if loaded:
                loaded_slots = cache.linker.private_load_indices[req.rid]
                timed("ready_to_load", cache.ready_to_load_host_cache)
                start = time.perf_counter()  # the layers land (a forward would run meanwhile): untimed
                cache.linker.cache_linker.loader.wait_idle()
                spent["finish_loads_wait"] += time.perf_counter() - start
                if timed("finish_loads", cache.finish_external_linker_loads, [req]):  # the rows are let go
                    cache.token_to_kv_pool_allocator.free(loaded_slots)
                    loaded_slots = None
                else:
                    hits["host"] += loaded
                    prefix = torch.cat([prefix, loaded_slots])
        full = len(tokens) // page * page
        need = full - len(prefix)
        if need > 0:
            if allocator.available_size() < need:
                timed("evict", cache.evict, EvictParams(num_tokens=need - allocator.available_size()))
            fresh = allocator.alloc(need)
            if fresh is None:
                timed("unlock", cache.dec_lock_ref, node, lock)
                if loaded_slots is not None:
                    allocator.free(loaded_slots)
                continue
            prefix = torch.cat([prefix.to(torch.int64), fresh.to(torch.int64)])
        inserted = timed("insert", cache.insert, InsertParams(
            key=RadixKey(array("q", tokens[: len(prefix)])), value=prefix, prev_prefix_len=result.device_prefix_len))
        # Duplicates of pages cached meanwhile: the default tree frees them itself, stock RadixCache's caller does.
        if inserted.prefix_len > result.device_prefix_len and not hasattr(cache, "tree_core"):
            allocator.free(prefix[result.device_prefix_len : inserted.prefix_len])
        timed("unlock", cache.dec_lock_ref, node, lock)
        timed("take_events", cache.take_events)
    spent["device_hit_tokens"] = hits["device"]
    spent["host_hit_tokens"] = hits["host"]


def owner_of(path: str) -> str | None:
    """Whose code a profiled function is: this library's, SGLang's, PyTorch's; None for Python's own and C."""
    if "sglang_kvbm" in path:
        return "sglang-kvbm"
    if "/sglang/" in path:
        return "SGLang"
    if "/torch/" in path:
        return "PyTorch"
    if path.endswith("critical_path.py"):
        return "benchmark"
    return None


def profile_split(prof: cProfile.Profile) -> dict[str, float]:
    """Seconds of own time by owner. Time in C functions and Python's standard library (locks, queues,
    ``threading``) goes to the owner of the code that called them, through as many such frames as it takes."""
    stats = pstats.Stats(prof).stats
    memo: dict = {}

    def resolve(key, seen=()) -> str:
        if key in memo:
            return memo[key]
        found = owner_of(key[0])
        if found is None:
            callers = stats.get(key, (0, 0, 0, 0, {}))[4]
            best = max(callers.items(), key=lambda item: item[1][2], default=None)
            found = "Python/C" if best is None or best[0] in seen else resolve(best[0], seen + (key,))
        memo[key] = found
        return found

    split: dict[str, float] = defaultdict(float)
    for key, (_, _, own, _, callers) in stats.items():
        if owner_of(key[0]) is not None or not callers:
            split[resolve(key)] += own
            continue
        for caller, (_, _, from_caller, _) in callers.items():
            split[resolve(caller)] += from_caller
    return split


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=1500)
    parser.add_argument("--pool", type=int, default=8192, help="device pool, tokens")
    parser.add_argument("--host-blocks", type=int, default=4096,
                        help="host tier in 16-token blocks (scaled with --page-size to the same bytes)")
    parser.add_argument("--page-size", type=int, default=16, help="tokens per page (SGLang's default is 1)")
    parser.add_argument("--no-gap", action="store_true",
                        help="no time between requests for the linker's copies (no forward to run behind): nodes "
                             "stay locked by offloads in flight, loads find no room and recompute")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (1: OpenMP threads spinning on 2 cores starve the scheduler thread "
                             "whenever a copy runs; a GPU server's copies are not CPU threads)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds; the caches take turns within each")
    parser.add_argument("--events", action="store_true",
                        help="KV events on (the tree's and the tiers'), as in a worker behind Dynamo's router")
    parser.add_argument("--profile", action="store_true",
                        help="also replay each cache under cProfile: whose code the scheduler-thread time is")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    page = args.page_size
    requests = trace(args.requests)
    host_blocks = args.host_blocks * 16 // page  # the same host bytes at every page size
    print(f"# {len(requests)} requests, {sum(map(len, requests))} prompt tokens, device pool {args.pool} tokens, "
          f"page {page}, host tier {host_blocks} blocks ({host_blocks * page} tokens), KV events "
          f"{'on' if args.events else 'off'}, {args.rounds} rounds")
    per_round: dict[str, list[dict]] = defaultdict(list)
    splits = {}

    def play(kind, built, part, spent):
        """``kind``'s replay of ``part`` on ``built`` (``build``'s), as ``steps`` generators do it."""
        cache, allocator, _ = built
        if kind == "HiRadixCache":
            return hicache_inproc.steps(cache, allocator, part, page, spent)
        return steps(cache, allocator, part, kind.endswith("KvbmLinker"), page, None, not args.no_gap, spent)

    def close(kind, built) -> None:
        if built[2] is not None:
            built[2].close()
        if kind == "HiRadixCache":
            hicache_inproc.close(built[0])

    order = sorted(KINDS, key=lambda kind: kind == "HiRadixCache")  # HiCache built last: its runtime context stays
    for round_no in range(args.rounds):
        for kind in order:  # a warm-up of each cache alone
            built = build(kind, args.pool, host_blocks, page, args.events)
            lockstep([play(kind, built, requests[:50], defaultdict(float))])
            close(kind, built)
        # The run: every cache at once, a request at a time, in turn (``lockstep``).
        caches = {kind: build(kind, args.pool, host_blocks, page, args.events) for kind in order}
        spent = {kind: defaultdict(float) for kind in KINDS}
        with copy_thread_cpu() as describe_cpu:  # only the linker's copy threads describe pages
            lockstep([play(kind, caches[kind], requests, spent[kind]) for kind in KINDS])
        for kind in KINDS:
            linked = kind.endswith("KvbmLinker")
            per_round[kind].append(spent[kind] if kind == "HiRadixCache" else
                                   totals(spent[kind], describe_cpu[0] if linked else 0.0))
        for kind in reversed(order):
            close(kind, caches[kind])
        if args.profile and round_no == 0:
            for kind in KINDS:
                if kind == "HiRadixCache":
                    continue
                cache, allocator, owner = build(kind, args.pool, host_blocks, page, args.events)
                prof = cProfile.Profile()
                replay(cache, allocator, requests, kind.endswith("KvbmLinker"), page, prof)
                splits[kind] = profile_split(prof)
                if os.environ.get("KVBM_BENCH_PROFILE_DUMP"):  # the whole profile, for pstats (a developer's look)
                    prof.dump_stats(f"{os.environ['KVBM_BENCH_PROFILE_DUMP']}-{kind.replace('+', '_')}.prof")
                if owner is not None:
                    owner.close()
    # Each figure: its median across rounds; each ratio: the median of the rounds' own ratios.
    results = {kind: {key: statistics.median(r.get(key, 0.0) for r in runs) for key in runs[0]}
               for kind, runs in per_round.items()}

    def ratio(a: str, b: str) -> tuple[float, float, float]:
        values = sorted(x["total"] / y["total"] for x, y in zip(per_round[a], per_round[b]))
        return statistics.median(values), values[0], values[-1]

    base = results["UnifiedRadixCache"]["total"]
    rows = []
    for kind, spent in results.items():
        rows.append([kind, spent["total"] * 1e3, spent["total"] / base, spent["total"] / len(requests) * 1e6,
                     spent.get("finish_loads_wait", 0.0) * 1e3, spent.get("copies", 0.0) * 1e3,
                     spent.get("describe_cpu", 0.0) * 1e3,
                     int(spent["device_hit_tokens"]), int(spent["host_hit_tokens"])]
                    + [spent.get(c, 0.0) * 1e3 for c in CALLS])
    print(table(["cache", "total ms", "vs tree", "us/request", "load wait ms", "copies ms", "describe ms", "device hit tok",
                 "host hit tok"] + [f"{c} ms" for c in CALLS], rows))
    print("(total: the cache calls without the load wait, and for HiRadixCache without its copies, which run inside "
          "its calls on CPU: `copies ms`, in ready_to_load and flush_backups; describe: the linker's copy threads' CPU "
          "describing stored pages, off the scheduler thread, its chain hash without the GIL)")
    linker, peer = results["UnifiedRadixCache+KvbmLinker"], results["HiRadixCache"]
    mid, low, high = ratio("UnifiedRadixCache+KvbmLinker", "HiRadixCache")
    print(f"(figures: medians of {args.rounds} rounds; ratios: the median of each round's ratio, range low-high)")
    print(f"KvbmLinker / HiRadixCache per request = {mid:.2f} ({low:.2f}-{high:.2f}): target {verdict(mid, 1.00)}; "
          f"per host-hit token = {linker['total'] / max(linker['host_hit_tokens'], 1) / (peer['total'] / max(peer['host_hit_tokens'], 1)):.2f}")
    mid, low, high = ratio("UnifiedRadixCache+KvbmLinker", "UnifiedRadixCache")
    target = 6.0 if page == 1 else 3.0
    print(f"UnifiedRadixCache+KvbmLinker / UnifiedRadixCache = {mid:.2f} ({low:.2f}-{high:.2f}) in cache calls "
          f"(without the load wait the forward covers): target {verdict(mid, target)}")
    if splits:
        owners = ["SGLang", "sglang-kvbm", "PyTorch", "Python/C"]
        rows = []
        for kind, split in splits.items():
            profiled = sum(split[o] for o in owners)  # inside the timed cache calls only (benchmark: ~0)
            per_request = results[kind]["total"] / len(requests) * 1e6  # unprofiled us/request, split by share
            rows.append([kind, per_request] + [per_request * split.get(o, 0.0) / profiled for o in owners])
        print("\nWhose scheduler-thread time (cProfile shares of each replay, applied to the unprofiled us/request; "
              "C calls count for their caller):")
        print(table(["cache", "us/request"] + [f"{o} us" for o in owners], rows))

    def draw(ax):
        names = list(results)
        bottom = [0.0] * len(names)
        for call in CALLS:
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
