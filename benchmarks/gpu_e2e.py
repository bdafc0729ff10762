"""TTFT of an 8B-shaped model (``gpu_model.py``) with this library's tiers under SGLang's default tree, on a GPU.

For each prefix P and suffix S, the wall time (CUDA-synchronized) from admission to the first token's logits, as
the median of ``--runs`` after a warm-up, of:

* recompute: P+S tokens, nothing cached;
* device hit: P in SGLang's device pool (its tree), the forward of S only;
* host hit: P evicted to KVBM's host tier; ``KvbmCache.prefix(wait=False)`` starts the layer-wise load, the forward
  of S reads each layer through the pool once it has landed, ``land`` after it;
* disk hit: the same on a disk-only stack (no host tier), P evicted to disk, read back through the tier's staging
  (sized to hold P; its blocks are dropped before each run, so every run reads the disk);
* HiCache host hit: SGLang's own host tier on the same model and pool shape (``gpu_hicache.py`` says what it needs);
* memcpy: P's K+V bytes, host -> device, one copy per layer (CUDA: pinned), in the same run (CPU: a plain copy).

Checks (the exit status): the host hit is served from host and the disk hit from disk; host hit and device hit give
bitwise equal logits (same kernels, same bytes); the host hit's greedy token is recompute's, or the two are a near tie
(recompute's top-2 margin within twice the logits' difference, bf16 noise). Before every lower-tier run the evicted
pool is filled with NaN, so a forward that reads a layer before its copy landed cannot give equal logits. The forward
runs on its own stream, passed to ``build_cache`` as ``forward_stream``; it syncs nothing itself (the pool's
per-layer wait holds the host only until the loader has *queued* that layer's copies, as in SGLang).

    python benchmarks/gpu_e2e.py             # CUDA: --shape 8b, P 8192 32768, S 1 2048; CPU: --shape tiny
    python benchmarks/gpu_e2e.py --quick     # 2 runs, the longest suffix only
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

import torch

import gpu_hicache
from common import out_dir, scratch_dir, table, verdict
from gpu_harness import CUDA, DEV, GB, Bench, Pool, drop_page_cache, kvbm_stack, settle_and_evict
from gpu_model import SHAPES, Model

NAMES = ("recompute", "device", "host", "disk", "hicache")


def median(values) -> float:
    return statistics.median(values) if values else float("nan")


def check_logits(row: dict, logits: dict) -> None:
    """Bitwise equality with the device hit; the host hit's greedy token against recompute's."""
    want = logits["device"]
    for name in ("host", "disk", "hicache"):
        if name in logits:
            row[f"{name}_logits_equal_device"] = bool(torch.equal(logits[name], want))
    rec, host = logits["recompute"], logits["host"]
    top = rec.topk(2).values
    row["greedy"] = {"recompute": int(rec.argmax()), "host": int(host.argmax()), "margin": float(top[0] - top[1]),
                     "max_abs_diff": float((host - rec).abs().max())}
    g = row["greedy"]
    g["ok"] = g["recompute"] == g["host"] or g["margin"] <= 2 * g["max_abs_diff"]


def measure_prefix(bench: Bench, prefix: int, suffixes: list, page: int, disk_dir: str, hicache: bool) -> list:
    """Every row of one prefix length: this library's stacks, then HiCache's (each built, measured and closed)."""
    model = bench.model
    tokens_p = [(7919 * i + prefix) % model.shape.vocab for i in range(prefix)]
    rows, logits_of = measure_kvbm(bench, prefix, suffixes, page, disk_dir, tokens_p)
    gc.collect()
    if hicache:
        measure_hicache(bench, prefix, suffixes, page, tokens_p, rows, logits_of)
    for row, logits in zip(rows, logits_of):
        check_logits(row, logits)
    return rows


def measure_kvbm(bench: Bench, prefix: int, suffixes: list, page: int, disk_dir: str, tokens_p: list):
    model = bench.model
    vocab, smax, context = model.shape.vocab, max(suffixes), prefix + max(suffixes) + page
    ids_p = torch.tensor(tokens_p, device=DEV)
    kv_bytes = prefix * model.shape.kv_bytes_per_token(model.dtype)
    plain = Pool(model, prefix + smax + page, page, context)  # recompute: no cache, no layer counter
    host_pool = Pool(model, prefix + smax + 2 * page, page, context)
    host = kvbm_stack(host_pool, bench, cpu_cache_blocks=host_pool.tokens // page)
    bench.populate(host_pool, ids_p, lambda slots: host.insert(tokens_p, slots))
    host.flush(timeout=600)
    disk = disk_pool = None
    notes = {}
    try:
        disk_pool = Pool(model, prefix + smax + 2 * page, page, context)
        os.makedirs(os.path.join(disk_dir, f"p{prefix}"), exist_ok=True)
        # The read staging (SGLANG_KVBM_READ_STAGING_GB, default 1 GiB) holds all of P: one load brings it whole.
        disk = kvbm_stack(disk_pool, bench, disk_cache_blocks=prefix // page + 16, load_wait_ms=30_000,
                          disk_cache_dir=os.path.join(disk_dir, f"p{prefix}"), disable_disk_offload_filter=True,
                          read_staging_gb=max(1.0, 1.1 * kv_bytes / (1 << 30)))
        bench.populate(disk_pool, ids_p, lambda slots: disk.insert(tokens_p, slots))
        disk.flush(timeout=600)
        store = disk.linker.manager.tier("disk").store
        notes["disk_o_direct"] = bool(store.o_direct)
        notes["page_cache"] = "O_DIRECT: reads bypass the OS page cache" if store.o_direct else drop_page_cache()
        notes["staging_tokens"] = disk.linker.manager.staging.capacity * page
    except Exception as exc:  # e.g. no NIXL on this machine: the other rows still run
        notes["disk_error"] = f"{type(exc).__name__}: {exc}"
        print(f"# disk tier not measured: {notes['disk_error']}")
        if disk is not None:
            disk.close()
        disk = None

    def host_prepare():
        settle_and_evict(host)
        host_pool.scramble()

    def disk_prepare():
        settle_and_evict(disk)
        disk_pool.scramble()
        disk.linker.manager.staging.forget()  # staged blocks would serve the next run from host memory
        if not notes["disk_o_direct"] and notes["page_cache"].startswith("dropped"):
            drop_page_cache()

    memcpy = bench.memcpy(kv_bytes, model.shape.layers)
    rows, logits_of = [], []
    for suffix in suffixes:
        tokens = tokens_p + [(104729 * i + 13 * suffix + 1) % vocab for i in range(suffix)]
        ids = torch.tensor(tokens, device=DEV)
        row = {"prefix": prefix, "suffix": suffix, "kv_bytes": kv_bytes, "memcpy": memcpy, **notes}
        logits = {}
        row["recompute"], logits["recompute"], _ = bench.repeat(lambda: bench.recompute(plain, ids))
        row["device"], logits["device"], row["device_info"] = bench.repeat(
            lambda: bench.kvbm_hit(host, host_pool, ids, tokens))
        row["host"], logits["host"], row["host_info"] = bench.repeat(
            lambda: bench.kvbm_hit(host, host_pool, ids, tokens), prepare=host_prepare)
        if disk is not None:
            stats = store.stats
            before = (stats.read_bytes, stats.read_seconds)
            row["disk"], logits["disk"], row["disk_info"] = bench.repeat(
                lambda: bench.kvbm_hit(disk, disk_pool, ids, tokens), prepare=disk_prepare)
            nbytes, seconds = stats.read_bytes - before[0], stats.read_seconds - before[1]
            row["disk_read_GBps"] = nbytes / seconds / GB if seconds else float("nan")
            row["disk_read_bytes_per_run"] = nbytes // (bench.runs + 1)
        rows.append(row)
        logits_of.append(logits)
    host.close()
    if disk is not None:
        disk.close()
    return rows, logits_of


def measure_hicache(bench, prefix, suffixes, page, tokens_p, rows, logits_of) -> None:
    """HiCache's host hit on its own pool of the same shape, after ours (its publish changes SGLang's context)."""
    model = bench.model
    ids_p = torch.tensor(tokens_p, device=DEV)
    hc = None
    try:
        pool = Pool(model, prefix + max(suffixes) + 2 * page, page, prefix + max(suffixes) + page)
        hc = gpu_hicache.HiCache(pool.params, pool.tokens, pool.tokens * 5 // 4, DEV)
        bench.populate(pool, ids_p, lambda slots: hc.insert(tokens_p, slots))
        for suffix, row, logits in zip(suffixes, rows, logits_of):
            tokens = tokens_p + [(104729 * i + 13 * suffix + 1) % model.shape.vocab for i in range(suffix)]
            ids = torch.tensor(tokens, device=DEV)
            row["hicache"], logits["hicache"], row["hicache_info"] = bench.repeat(
                lambda: bench.hicache_hit(hc, pool, ids, tokens), prepare=lambda: (hc.evict_all(), pool.scramble()))
    except Exception as exc:  # says what it needs (a stubbed kernel raises naming itself)
        for row in rows:
            row["hicache_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        print(f"# HiCache not measured: {rows[0]['hicache_error']}\n# {gpu_hicache.NEEDS}")
    finally:
        try:
            hc.close() if hc is not None else gpu_hicache.plain_context(DEV)
        except Exception as exc:
            print(f"# HiCache did not close cleanly: {type(exc).__name__}: {exc}")


def report(rows: list, largest: int, flops_per_token: float) -> list:
    """Print the tables and verdicts; returns what failed."""
    failed, lines, checks = [], [], []
    for r in rows:
        m = {name: median(r.get(name, [])) for name in NAMES}
        cpy = median(r["memcpy"])
        m["memcpy"] = cpy
        r["medians_s"] = m
        r["recompute_matmul_tflops"] = flops_per_token * (r["prefix"] + r["suffix"]) / m["recompute"] / 1e12
        best = max(m["device"], cpy)
        lines.append([r["prefix"], r["suffix"], *(m[k] * 1e3 for k in (*NAMES, "memcpy")), m["host"] / best,
                      m["host"] / m["recompute"], m["disk"] / m["recompute"], m["hicache"] / m["host"]])
        where = f"P={r['prefix']} S={r['suffix']}"
        host_loaded = {i["loaded_tokens"] for i in r["host_info"]}
        if host_loaded != {r["prefix"]} or any(i["device_tokens"] for i in r["host_info"]):
            failed.append(f"{where}: host hit loaded {sorted(host_loaded)} tokens from host, not {r['prefix']}")
        if any(i["device_tokens"] != r["prefix"] for i in r["device_info"]):
            failed.append(f"{where}: device hit was not served from the device pool")
        if not r["host_logits_equal_device"]:
            failed.append(f"{where}: host hit's logits differ from the device hit's")
        if not r["greedy"]["ok"]:
            failed.append(f"{where}: host hit's greedy token {r['greedy']['host']} != recompute's "
                          f"{r['greedy']['recompute']} (margin {r['greedy']['margin']:.3g})")
        disk_loaded = sorted({i["loaded_tokens"] for i in r.get("disk_info", [])})
        expect = min(r["prefix"], r.get("staging_tokens", r["prefix"]))
        if "disk_info" in r and disk_loaded != [expect]:
            failed.append(f"{where}: disk hit loaded {disk_loaded} tokens from disk, not {expect}")
        if r.get("disk_logits_equal_device") is False and expect == r["prefix"]:
            failed.append(f"{where}: disk hit's logits differ from the device hit's")
        hc_loaded = sorted({i["loaded_tokens"] for i in r.get("hicache_info", [])})
        if "hicache_info" in r and hc_loaded != [r["prefix"]]:
            failed.append(f"{where}: HiCache hit loaded {hc_loaded} tokens from its host tier, not {r['prefix']}")
        if r.get("hicache_logits_equal_device") is False:
            failed.append(f"{where}: HiCache hit's logits differ from the device hit's (the harness read early?)")
        greedy = r["greedy"]
        hc_info = r.get("hicache_info", [])
        checks.append([
            r["prefix"], r["suffix"], "/".join(map(str, sorted(host_loaded))), "/".join(map(str, disk_loaded)) or "-",
            "/".join(map(str, hc_loaded)) or "-", r["host_logits_equal_device"], r.get("disk_logits_equal_device", "-"),
            r.get("hicache_logits_equal_device", "-"),
            "yes" if greedy["recompute"] == greedy["host"] else "near tie" if greedy["ok"] else "NO",
            r.get("disk_read_GBps", float("nan")), median([i["enqueue_s"] * 1e3 for i in hc_info]),
            max([i["runs"] for i in hc_info], default="-"),
        ])
    print(table(["P", "S", "recompute ms", "device hit ms", "host hit ms", "disk hit ms", "HiCache host ms",
                 "memcpy ms", "host/max(dev,cpy)", "host/recompute", "disk/recompute", "HiCache/host"], lines))
    print()
    print(table(["P", "S", "host hit: from host", "disk hit: from disk", "HiCache: from host", "logits host==device",
                 "disk==device", "HiCache==device", "greedy host==recompute", "disk read GB/s", "HiCache enqueue ms",
                 "HiCache runs"], checks))
    first = rows[0]
    if "disk_error" in first:
        print(f"\ndisk: not measured ({first['disk_error']})")
    else:
        staging = ", ".join(sorted({f"{r['staging_tokens']} tokens at P={r['prefix']}" for r in rows}))
        print(f"\ndisk: {first['page_cache']}; GB/s is the tier's read meter (read + verify). Its staging (host "
              f"rows a disk read lands in) holds {staging}: a longer disk hit loads that much, the rest is recomputed")
    if "hicache_error" in first:
        print(f"HiCache: not measured ({first['hicache_error']}). {gpu_hicache.NEEDS}")
    for line in lines:
        print(f"P={line[0]} S={line[1]}: host hit / max(device hit, memcpy) {line[8]:.3f}, {verdict(line[8], 1.10)}"
              + (f"; host hit / recompute {line[9]:.3f}, {verdict(line[9], 0.2)}" if line[0] == largest else ""))
    print("recompute, matmul TFLOP/s achieved (attention left out): "
          + ", ".join(f"{r['recompute_matmul_tflops']:.1f} at P+S={r['prefix'] + r['suffix']}" for r in rows))
    if not CUDA:
        print("(CPU, tiny shape: the run checks the code path; its times say nothing about a GPU)")
    return failed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="8b" if CUDA else "tiny")
    parser.add_argument("--prefix", type=int, nargs="+", help="prefix tokens (default 8192 32768; tiny 256 1024)")
    parser.add_argument("--suffix", type=int, nargs="+", help="suffix tokens (default 1 2048; tiny 1 64)")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], help="default: bfloat16 (tiny on CPU: float32)")
    parser.add_argument("--quick", action="store_true", help="2 runs, the longest suffix only")
    parser.add_argument("--no-hicache", action="store_true", help="leave SGLang's HiCache out")
    parser.add_argument("--disk-dir", help="where the disk tier's files go (default: a temporary directory)")
    parser.add_argument("--json", help="where the figures go (default: bench-out/gpu_e2e.json)")
    args = parser.parse_args(argv)
    tiny = args.shape == "tiny"
    prefixes = args.prefix or ([256, 1024] if tiny else [8192, 32768])
    suffixes = args.suffix or ([1, 64] if tiny else [1, 2048])
    if args.quick:
        args.runs, suffixes = min(args.runs, 2), [max(suffixes)]
    if any(p % args.page_size for p in prefixes):
        parser.error(f"every --prefix must be a multiple of --page-size {args.page_size}")
    dtype = getattr(torch, args.dtype) if args.dtype else torch.bfloat16 if CUDA or not tiny else torch.float32
    if not CUDA:  # the loader's and the tiers' threads share the cores with the forward: no spinning OpenMP team
        torch.set_num_threads(1)
    started = time.perf_counter()
    model = Model(SHAPES[args.shape], DEV, dtype, seed=0)
    if CUDA:
        torch.cuda.synchronize()
    s, device = model.shape, torch.cuda.get_device_name() if CUDA else "CPU"
    print(f"# {args.shape} shape on {device}: {s.params() / 1e6:,.1f} M params ({dtype}), weights made in "
          f"{time.perf_counter() - started:.1f} s; KV {s.kv_bytes_per_token(dtype):,} bytes a token; "
          f"page {args.page_size}; medians of {args.runs} after a warm-up")
    attention = model.attention_check()
    print(f"# attention: {attention}")
    bench = Bench(model, args.runs)
    disk_dir = args.disk_dir or scratch_dir("kvbm-gpu-e2e-")
    rows = []
    for prefix in prefixes:
        rows += measure_prefix(bench, prefix, suffixes, args.page_size, disk_dir, not args.no_hicache)
        if CUDA:
            torch.cuda.empty_cache()
    failed = report(rows, max(prefixes), model.shape.flops_per_token())
    figures = {"shape": args.shape, "device": device, "dtype": str(dtype), "page_size": args.page_size,
               "runs": args.runs, "attention": attention, "torch": torch.__version__, "rows": rows,
               "wall_s": time.perf_counter() - started, "failed": failed}
    path = args.json or str(out_dir() / "gpu_e2e.json")
    with open(path, "w") as f:
        json.dump(figures, f, indent=1, default=str)
    print(f"\nfigures: {path}; wall {figures['wall_s']:.0f} s")
    missing = [name for name, key in (("disk", "disk_error"), ("HiCache", "hicache_error")) if key in rows[0]]
    print("FAILED: " + "; ".join(failed) if failed else "OK: every check passed"
          + (f" (not measured: {', '.join(missing)})" if missing else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
