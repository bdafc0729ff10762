"""Break-even: TTFT against prefix length for recompute, a host (G2) hit and a disk (G3) hit.

For each prefix length: the prompt cold on stock SGLang (recompute), and the same
prompt served from the host tier and from the disk tier after filler traffic
pushed it out of the device pool. The disk server runs the default onboard
policy, so a disk span is loaded only when its measured read cost is below its
measured recompute cost. SGLang's own HiCache runs beside it as the peer (host
hit, and L3 ``file`` hit), patched to run on CPU inside its own processes only
(``benchmarks/hicache_cpu``). Target: the library is never slower than recompute.

    python benchmarks/break_even.py                  # ~5 minutes on 2 CPU cores
    python benchmarks/break_even.py --lengths 256,1024,4096 --repeat 3
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from common import mean, out_dir, save_plot, scratch_dir, table, verdict
from sglang_kvbm.ops.demo.model import DEMO, make_model, prompt_ids
from sglang_kvbm.ops.demo.run import _stream_generate
from sglang_kvbm.ops.demo.server import SglangServer


def serve(server, length, repeat, pool, evict):
    """TTFT of prompts of ``length`` tokens, and their cached-token breakdowns."""
    out = []
    for r in range(repeat):
        prompt = prompt_ids(7_000_000 + length * 100 + r, length, DEMO.vocab_size)
        if evict:
            _stream_generate(server.url, prompt, 1)
            for f in range(pool // 1000 + 2):  # filler: pushes the prompt out of the device pool
                _stream_generate(server.url, prompt_ids(9_000_000 + length * 100 + r * 10 + f, 1000, DEMO.vocab_size), 1)
        ttft, final = _stream_generate(server.url, prompt, 4)
        out.append((ttft, final.get("meta_info", {}).get("cached_tokens_details") or {}))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="128,512,1024,2048")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--pool", type=int, default=2560)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--no-hicache", action="store_true")
    args = parser.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    out = out_dir()
    model = make_model(out / "model-demo", DEMO)
    disk_dir = scratch_dir("kvbm-bench-be-")
    modes = {
        "recompute": ([], {}, False),
        "G2 hit": (["--radix-cache-backend", "kvbm"], {"DYN_KVBM_CPU_CACHE_GB": "2"}, True),
        "G3 hit": (["--radix-cache-backend", "kvbm"], {  # disk only: every hit comes from disk
            "DYN_KVBM_DISK_CACHE_GB": "2", "DYN_KVBM_DISK_CACHE_DIR": disk_dir}, True),
    }
    if not args.no_hicache:
        patch = {} if args.device != "cpu" else {
            "PYTHONPATH": str(Path(__file__).parent / "hicache_cpu"), "KVBM_BENCH_HICACHE_CPU": "1"}
        hicache = ["--enable-hierarchical-cache", "--hicache-io-backend", "direct", "--hicache-mem-layout",
                   "layer_first", "--hicache-write-policy", "write_through"]
        modes["HiCache host hit"] = (hicache + ["--hicache-ratio", "4"], patch, True)
        modes["HiCache L3 hit"] = (hicache + ["--hicache-ratio", "1", "--hicache-storage-backend", "file"], {
            **patch, "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": scratch_dir("hicache-be-")}, True)
    extra = [] if args.device == "cpu" else ["--device", args.device]
    results = {}
    for mode, (flags, env, evict) in modes.items():
        print(f"# {mode} ...", flush=True)
        log = out / f"break-even-{mode.replace(' ', '-')}.log"
        with SglangServer(model, page_size=16, max_total_tokens=args.pool, extra_args=flags + extra, env=env,
                          log_path=log) as server:
            _stream_generate(server.url, prompt_ids(424242, 64, DEMO.vocab_size), 1)
            results[mode] = {n: serve(server, n, args.repeat, args.pool, evict) for n in lengths}
        if mode == "G3 hit":
            lines = re.findall(r"kvbm: disk break-even .*", log.read_text())
            print(f"# {lines[-1] if lines else 'policy: break-even not logged'}")
    rows = []
    worst = 0.0
    hit_modes = [m for m in modes if m != "recompute"]
    for n in lengths:
        base = mean([t for t, _ in results["recompute"][n]])
        row = [n, base]
        for mode in hit_modes:
            ttft = mean([t for t, _ in results[mode][n]])
            served = mean([d.get("host", 0) + d.get("storage", 0) for _, d in results[mode][n]])
            row += [ttft, ttft / base, served]
            if not mode.startswith("HiCache"):
                worst = max(worst, ttft / base)
        rows.append(row)
    headers = ["prefix tokens", "recompute s"]
    for mode in hit_modes:
        headers += [f"{mode} s", f"{mode}/recompute", f"{mode} tokens loaded"]
    print(table(headers, rows))
    print(f"\nworst ratio to recompute: {worst:.2f}: {verdict(worst, 1.0)}")

    def draw(ax):
        for mode in modes:
            ax.plot(lengths, [mean([t for t, _ in results[mode][n]]) for n in lengths], marker="o", label=mode)
        ax.set_xlabel("prefix length (tokens)")
        ax.set_ylabel("TTFT (s)")
        ax.set_title("Break-even: recompute vs host and disk hits")
        ax.legend()

    print(f"plot: {save_plot('break_even', draw)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
