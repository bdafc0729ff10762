"""Miss path: a workload with no reuse at all, stock SGLang vs this library, same run.

Every prompt is new, so the library can only cost time: hashing, wrapping pages,
copying them down (off the scheduler's thread), events. Servers alternate
(stock, kvbm, stock, kvbm ...) so that drift on the machine hits both alike.
Target: TTFT and throughput <= 2% worse than stock.

    python benchmarks/miss_path.py                 # ~4 minutes on 2 CPU cores
    python benchmarks/miss_path.py --rounds 3 --requests 32
"""

from __future__ import annotations

import argparse
import sys
import time

from common import mean, out_dir, pct, save_plot, scratch_dir, table, verdict
from sglang_kvbm.ops.demo.model import DEMO, make_model, prompt_ids
from sglang_kvbm.ops.demo.run import _stream_generate
from sglang_kvbm.ops.demo.server import SglangServer


def measure(server, seeds, length, answer):
    ttft = []
    _stream_generate(server.url, prompt_ids(424242, 64, DEMO.vocab_size), 1)  # warm-up
    started = time.perf_counter()
    for seed in seeds:
        t, _ = _stream_generate(server.url, prompt_ids(seed, length, DEMO.vocab_size), answer)
        ttft.append(t)
    return ttft, time.perf_counter() - started


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=12, help="per round and server")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--length", type=int, default=1000)
    parser.add_argument("--answer", type=int, default=8)
    parser.add_argument("--pool", type=int, default=4096)
    args = parser.parse_args(argv)
    out = out_dir()
    model = make_model(out / "model-demo", DEMO)
    disk_dir = scratch_dir("kvbm-bench-miss-")
    configs = {
        "stock": ([], {}),
        "kvbm-G2": (["--radix-cache-backend", "kvbm"], {"DYN_KVBM_CPU_CACHE_GB": "2"}),
        "kvbm-G2+G3": (["--radix-cache-backend", "kvbm"], {
            "DYN_KVBM_CPU_CACHE_GB": "1", "DYN_KVBM_DISK_CACHE_GB": "1", "DYN_KVBM_DISK_CACHE_DIR": disk_dir,
            "DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER": "true"}),  # worst case: every block is written to disk
    }
    results = {name: {"ttft": [], "seconds": 0.0, "requests": 0} for name in configs}
    seed = 1_000_000
    print(f"# {args.rounds} rounds x {args.requests} unique {args.length}-token prompts per server", flush=True)
    for round_ in range(args.rounds):
        for name, (flags, env) in configs.items():
            seeds = list(range(seed, seed + args.requests))
            seed += args.requests
            with SglangServer(model, page_size=16, max_total_tokens=args.pool, extra_args=flags, env=env,
                              log_path=out / f"miss-{name}.log") as server:
                ttft, seconds = measure(server, seeds, args.length, args.answer)
            results[name]["ttft"] += ttft
            results[name]["seconds"] += seconds
            results[name]["requests"] += len(seeds)
            print(f"# round {round_ + 1}: {name} mean TTFT {mean(ttft):.3f}s", flush=True)
    base = results["stock"]
    base_mean = mean(base["ttft"])
    base_rps = base["requests"] / base["seconds"]
    rows = []
    for name, r in results.items():
        rps = r["requests"] / r["seconds"]
        rows.append([name, mean(r["ttft"]), pct(r["ttft"], 0.5), pct(r["ttft"], 0.9), mean(r["ttft"]) / base_mean,
                     rps, base_rps / rps])
    print(table(["server", "mean TTFT s", "p50 s", "p90 s", "TTFT vs stock", "req/s", "time vs stock"], rows))
    for name in ("kvbm-G2", "kvbm-G2+G3"):
        ratio = mean(results[name]["ttft"]) / base_mean
        print(f"  {name}: mean TTFT {ratio:.3f}x stock: {verdict(ratio, 1.02)}")

    def draw(ax):
        ax.boxplot([r["ttft"] for r in results.values()], tick_labels=list(results))
        ax.set_ylabel("TTFT (s), no reuse")
        ax.set_title("Miss path")

    print(f"plot: {save_plot('miss_path', draw)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
