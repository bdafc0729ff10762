"""End to end, multi-turn: stock SGLang (recompute) vs this library (G2, G2+G3), same machine, same run.

Conversations with long contexts take turns against a real SGLang server (the
locally generated GPT-2 of the demo: a 1500-token prefill costs about a second
on a 2-core CPU); the working set is about 4x the device KV pool. Runs:

* ``stock``: SGLang as shipped, device pool P: evicted prefixes are recomputed.
* ``stock-unbounded``: a device pool holding everything: the best any cache can do
  (its hit tokens are the 100% of the hit-token target; its device-hit TTFT is
  the reference for host and disk hits).
* ``kvbm-G2``: ``--radix-cache-backend kvbm`` with a host tier.
* ``kvbm-G2+G3``: a host tier too small for the working set, and a disk tier.
* ``hicache-G2``, ``hicache-G2+L3``: SGLang's own hierarchical cache, the peer users
  would pick instead, with a host pool holding the working set, and with a host
  pool of the device pool's size plus its ``file`` storage backend. On CPU it runs
  with four runtime patches applied only inside its server processes
  (``benchmarks/hicache_cpu/sitecustomize.py`` says which and why).

Targets: p50 TTFT <= 0.2x stock; hit tokens >= 95% of stock-unbounded's; host-hit
TTFT <= 1.05x device-hit TTFT; disk-hit TTFT <= 1.2x device-hit TTFT; host and
disk hits at or below HiCache's host and L3 hits.

    python benchmarks/e2e_multiturn.py                 # ~10 minutes on 2 CPU cores
    python benchmarks/e2e_multiturn.py --conversations 16 --turns 6 --device cuda
    # SGLang 0.5.21 (Dynamo's), the disk run only: its servers from Dynamo's environment
    python benchmarks/e2e_multiturn.py --python .venv-dynamo/bin/python --only kvbm-G2+G3 --no-hicache \
        --env PYTHONPATH=tests/servers/cpu_paged_alloc --env KVBM_TEST_CPU_PAGED_ALLOC=1
    # and with one request decoding throughout (add --decoder 256): its inter-token latency beside disk hits
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import threading
import time
from pathlib import Path

import requests

from common import mean, out_dir, pct, save_plot, scratch_dir, table, verdict
from sglang_kvbm.ops.demo.model import DEMO, make_model, prompt_ids
from sglang_kvbm.ops.demo.run import _stream_generate
from sglang_kvbm.ops.demo.server import SglangServer, free_port, stream_chunks


@dataclasses.dataclass
class Run:
    name: str
    ttft: list = dataclasses.field(default_factory=list)
    kind: list = dataclasses.field(default_factory=list)  # cold | device | host | disk, per request
    hits: dict = dataclasses.field(default_factory=lambda: {"device": 0, "host": 0, "disk": 0})
    output_tokens: int = 0
    seconds: float = 0.0
    cached: int = 0  # meta_info cached_tokens, every kind together (what SGLang 0.5.21 reports when details lack)
    stats: dict = dataclasses.field(default_factory=dict)  # this library's /stats at the end (kvbm runs)
    itl: list = dataclasses.field(default_factory=list)  # ``--decoder``: gaps between its streamed tokens, s


class Decoder:
    """``--decoder``: one request decoding for the whole run beside the conversations (a new one when it ends),
    the gaps between its streamed tokens kept: a scheduler step that stalls (a lookup waiting for a read on the
    scheduler thread) delays its next token."""

    def __init__(self, url: str, tokens: int) -> None:
        self._url, self._tokens = url, tokens
        self._stop = threading.Event()
        self.gaps: list = []
        self._thread = threading.Thread(target=self._run, name="decoder", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        body = {"input_ids": prompt_ids(777, 64, DEMO.vocab_size), "stream": True,
                "sampling_params": {"max_new_tokens": self._tokens, "temperature": 0.0, "ignore_eos": True}}
        while not self._stop.is_set():
            with requests.post(f"{self._url}/generate", json=body, stream=True, timeout=600) as response:
                response.raise_for_status()
                last = None
                for _ in stream_chunks(response):
                    now = time.perf_counter()
                    if last is not None:  # the gap to the request's first token is its TTFT, not an ITL
                        self.gaps.append(now - last)
                    last = now
                    if self._stop.is_set():
                        break

    def stop(self) -> list:
        self._stop.set()
        self._thread.join()
        return self.gaps


def workload(args):
    order = []
    for turn in range(args.turns):
        for conv in range(args.conversations):
            order.append((conv, prompt_ids(10_000 + conv * 100 + turn, args.question, DEMO.vocab_size)))
    return order


def run(name, server, args) -> Run:
    result = Run(name)
    histories = [prompt_ids(c, args.context, DEMO.vocab_size) for c in range(args.conversations)]
    _stream_generate(server.url, prompt_ids(424242, 64, DEMO.vocab_size), 1)  # warm-up
    decoder = Decoder(server.url, args.decoder) if args.decoder else None
    started = time.perf_counter()
    for conv, question in workload(args):
        prompt = histories[conv] + question
        ttft, final = _stream_generate(server.url, prompt, args.answer)
        meta = final.get("meta_info", {})
        details = meta.get("cached_tokens_details") or {}
        device, host, disk = details.get("device", 0), details.get("host", 0), details.get("storage", 0)
        result.hits["device"] += device
        result.hits["host"] += host
        result.hits["disk"] += disk
        result.cached += meta.get("cached_tokens", 0)
        cached = device + host + disk
        kind = "cold" if cached < len(prompt) // 2 else max(("device", device), ("host", host), ("disk", disk), key=lambda x: x[1])[0]
        result.kind.append(kind)
        result.ttft.append(ttft)
        answer = final.get("output_ids", [])
        result.output_tokens += len(answer)
        histories[conv] = prompt + answer
    result.seconds = time.perf_counter() - started
    if decoder is not None:
        result.itl = decoder.stop()
    return result


HICACHE = ["--enable-hierarchical-cache", "--hicache-io-backend", "direct", "--hicache-mem-layout", "layer_first",
           "--hicache-write-policy", "write_through"]


def hicache_configs(args, working_set):
    """SGLang's HiCache: host pool holding the working set; host pool = device pool plus its file L3."""
    env = {}
    if args.device == "cpu":  # HiCache does not start on CPU as shipped: patch it in its own processes only
        env = {"PYTHONPATH": str(Path(__file__).parent / "hicache_cpu"), "KVBM_BENCH_HICACHE_CPU": "1"}
    ratio = str(max(2, -(-2 * working_set // args.pool)))
    l3 = {**env, "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": scratch_dir("hicache-l3-")}
    return [
        ("hicache-G2", args.pool, HICACHE + ["--hicache-ratio", ratio], env),
        ("hicache-G2+L3", args.pool, HICACHE + ["--hicache-ratio", "1", "--hicache-storage-backend", "file"], l3),
    ]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", type=int, default=6)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--context", type=int, default=1500)
    parser.add_argument("--question", type=int, default=40)
    parser.add_argument("--answer", type=int, default=16)
    parser.add_argument("--pool", type=int, default=3072, help="device KV pool in tokens (about 1/4 of the working set)")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--no-hicache", action="store_true", help="skip SGLang's hierarchical cache runs")
    parser.add_argument("--python", help="the interpreter the servers run from (another SGLang release's environment)")
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                        help="set in every server's environment (repeatable)")
    parser.add_argument("--decoder", type=int, default=0, metavar="TOKENS",
                        help="one more request decoding this many tokens at a time for the whole run (restarted as "
                        "it ends): its inter-token latency shows scheduler steps that stall (--only's table)")
    parser.add_argument("--only", help="these runs only, comma-separated (the comparisons need stock, "
                        "stock-unbounded and kvbm-G2)")
    args = parser.parse_args(argv)

    out = out_dir()
    model = make_model(out / "model-demo", DEMO)
    working_set = args.conversations * (args.context + args.turns * (args.question + args.answer))
    print(f"# {args.conversations} conversations x {args.turns} turns, working set ~{working_set} tokens, "
          f"device pool {args.pool} tokens, page {args.page_size}, device {args.device}", flush=True)
    extra = [] if args.device == "cpu" else ["--device", args.device]
    disk_dir = scratch_dir("kvbm-bench-disk-")
    configs = [
        ("stock", args.pool, [], {}),
        ("stock-unbounded", working_set * 2, [], {}),
        ("kvbm-G2", args.pool, ["--radix-cache-backend", "kvbm"], {"DYN_KVBM_CPU_CACHE_GB": "2"}),
        ("kvbm-G2+G3", args.pool, ["--radix-cache-backend", "kvbm"], {
            "DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": str(args.pool // args.page_size + 8),
            "DYN_KVBM_DISK_CACHE_GB": "2", "DYN_KVBM_DISK_CACHE_DIR": disk_dir,
            # Every block of this workload is reused, but with a host tier this small its first reuse
            # comes after the host let it go: the frequency filter would keep almost all of it off disk.
            "DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER": "true",
        }),
    ]
    if not args.no_hicache:
        configs += hicache_configs(args, working_set)
    if args.only:
        configs = [c for c in configs if c[0] in args.only.split(",")]
    common = dict(item.split("=", 1) for item in args.env)
    runs = []
    for name, pool, flags, env in configs:
        print(f"# {name} ...", flush=True)
        port = free_port() if "kvbm" in flags else None  # this library's /stats: its own count of each tier's hits
        metrics = {"DYN_KVBM_METRICS": "true", "DYN_KVBM_METRICS_PORT": str(port)} if port else {}
        server = SglangServer(model, page_size=args.page_size, max_total_tokens=pool, extra_args=flags + extra,
                              env={**common, **env, **metrics}, log_path=out / f"e2e-{name}.log", python=args.python)
        with server:
            runs.append(run(name, server, args))
            if port:
                time.sleep(0.2)  # one publish interval
                runs[-1].stats = requests.get(f"http://127.0.0.1:{port}/stats", timeout=30).json()
    if args.only:  # one table, from what SGLang reports and this library's own counts
        rows = []
        for r in runs:
            onboard = r.stats.get("connector", {}).get("onboard_blocks", {})
            local = r.stats.get("local", {})
            rows.append([r.name, pct(r.ttft, 0.5), pct(r.ttft, 0.9), len(r.ttft) / r.seconds, r.cached,
                         onboard.get("host", 0) * args.page_size, onboard.get("disk", 0) * args.page_size,
                         local.get("load_waits", 0), local.get("read_wait_seconds", 0.0),
                         r.stats.get("lookup_waits", {}).get("deferred", 0),
                         r.stats.get("lookup_waits", {}).get("idle_wait_seconds", 0.0)]
                        + ([len(r.itl), pct(r.itl, 0.5) * 1e3, pct(r.itl, 0.99) * 1e3, max(r.itl) * 1e3]
                           if args.decoder and r.itl else []))
        print(table(["run", "p50 TTFT s", "p90 TTFT s", "req/s", "cached tokens", "from host", "from disk",
                     "load waits", "scheduler s waiting on reads", "lookups deferred (0.5.21)",
                     "idle scheduler s waiting on reads (0.5.21)"]
                    + (["decoder tokens", "ITL p50 ms", "ITL p99 ms", "ITL max ms"] if args.decoder else []), rows))
        return 0

    stock, ideal = runs[0], runs[1]
    device_hit = [t for t, k in zip(ideal.ttft, ideal.kind) if k == "device"]
    rows = []
    for r in runs:
        total_hits = sum(r.hits.values())
        rows.append([r.name, pct(r.ttft, 0.5), pct(r.ttft, 0.9), pct(r.ttft, 0.5) / pct(stock.ttft, 0.5),
                     len(r.ttft) / r.seconds, r.hits["device"], r.hits["host"], r.hits["disk"],
                     total_hits / max(1, sum(ideal.hits.values()))])
    print(table(["run", "p50 TTFT s", "p90 TTFT s", "p50 vs stock", "req/s", "device hit", "host hit", "disk hit",
                 "hits vs unbounded"], rows))
    ref = mean(device_hit)

    def hits(run_name, kind):
        return [t for r in runs if r.name == run_name for t, k in zip(r.ttft, r.kind) if k == kind]

    host_hit, disk_hit = hits("kvbm-G2", "host"), hits("kvbm-G2+G3", "disk")
    kinds = [["device (stock-unbounded)", device_hit], ["host (kvbm-G2)", host_hit], ["disk (kvbm-G2+G3)", disk_hit],
             ["host (hicache-G2)", hits("hicache-G2", "host")], ["L3 file (hicache-G2+L3)", hits("hicache-G2+L3", "disk")]]
    print()
    print(table(["hit kind", "requests", "p50 TTFT s", "mean TTFT s", "mean vs device hit"],
                [[name, len(ts), pct(ts, 0.5), mean(ts), mean(ts) / ref] for name, ts in kinds if ts]))
    g2 = next(r for r in runs if r.name == "kvbm-G2")
    print("\ntargets:")
    print(f"  p50 TTFT kvbm-G2 / stock = {pct(g2.ttft, .5) / pct(stock.ttft, .5):.2f}: {verdict(pct(g2.ttft, .5) / pct(stock.ttft, .5), 0.2)}")
    share = sum(g2.hits.values()) / max(1, sum(ideal.hits.values()))
    print(f"  hit tokens kvbm-G2 / unbounded = {share:.3f}: {verdict(share, 0.95, lower_is_better=False)}")
    print(f"  host-hit / device-hit TTFT = {mean(host_hit) / ref:.2f}: {verdict(mean(host_hit) / ref, 1.05)}")
    print(f"  disk-hit / device-hit TTFT = {mean(disk_hit) / ref:.2f}: {verdict(mean(disk_hit) / ref, 1.2)}")
    for ours, theirs, what in ((host_hit, hits("hicache-G2", "host"), "host"),
                               (disk_hit, hits("hicache-G2+L3", "disk"), "disk/L3")):
        if theirs:
            ratio = pct(ours, 0.5) / pct(theirs, 0.5)
            print(f"  {what}-hit p50 TTFT kvbm / hicache = {ratio:.2f}: {verdict(ratio, 1.0)}")

    def draw(ax):
        ax.boxplot([r.ttft for r in runs], tick_labels=[r.name for r in runs], showfliers=True)
        ax.set_ylabel("TTFT (s)")
        ax.set_title("Multi-turn TTFT per request")

    print(f"plot: {save_plot('e2e_multiturn', draw)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
