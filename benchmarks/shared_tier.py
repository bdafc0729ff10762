"""A fleet of two workers whose conversations move between them: per-worker tiers against a shared G4.

Each conversation's turns alternate between two real SGLang servers (round
robin, as a router does when the worker that holds a prefix is busy), so every
turn after the first lands where its prefix was never computed. Runs, same
machine, same run:

* ``stock``: two stock servers: every moved turn recomputes its prefix.
* ``kvbm-G2``: two servers with this library's host tier each: a moved turn
  finds nothing on its worker either (only what that worker computed itself).
* ``kvbm-G2+G4``: the same plus one Mooncake Store (a real ``mooncake_master``
  and a standalone lender on 127.0.0.1): the prefix the other worker wrote
  through is fetched from G4.

The second worker stands for a second host: it serves its own copy of the model
(the same bytes at another path, with other mtimes), as hosts that downloaded it
apart do; the shared tier must still be shared (the identity is the content).

Reports p50 and mean TTFT, the share of a moved turn's prefix served from a tier
(computed: hit tokens over the tokens the other worker computed), hit tokens by kind (``cached_tokens_details``:
device, host, storage = G4 here), bytes through Mooncake, and the TTFT of G4
hits against recomputed (cold) turns of the same length. Targets on CPU: a G4
hit <= 0.5x recompute at ~1500 tokens; mean TTFT with G4 <= 0.8x per-worker tiers.

    python benchmarks/shared_tier.py                  # ~6 minutes on 2 CPU cores
    python benchmarks/shared_tier.py --conversations 6 --turns 5
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import shutil
import tempfile
from pathlib import Path

import requests

import checkout  # noqa: F401  (tests/harness on sys.path)
from common import mean, pct, table, verdict
from sglang_kvbm.ops.demo.model import DEMO, make_model, prompt_ids
from sglang_kvbm.ops.demo.run import _stream_generate
from sglang_kvbm.ops.demo.server import SglangServer, free_port


@dataclasses.dataclass
class Run:
    name: str
    ttft: list = dataclasses.field(default_factory=list)
    kind: list = dataclasses.field(default_factory=list)
    hits: dict = dataclasses.field(default_factory=lambda: {"device": 0, "host": 0, "storage": 0})
    g4_bytes: int = 0
    moved_prefix: int = 0  # tokens of moved turns' prefixes, computed on the other worker
    moved_hit: int = 0  # of those, served from a tier (or the device) instead of recomputed


def servers(models: list, pool: int, tmp: Path, name: str, env: dict, kvbm: bool) -> list:
    made = []
    for i, model in enumerate(models):
        extra = {}
        if kvbm:
            extra = {"DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": str(4 * pool // 16), "DYN_KVBM_METRICS": "true",
                     "DYN_KVBM_METRICS_PORT": str(free_port()), **env}
        made.append(SglangServer(model, page_size=16, max_total_tokens=pool,
                                 extra_args=["--radix-cache-backend", "kvbm"] if kvbm else [], env=extra,
                                 log_path=tmp / f"{name}-{i}.log"))
    return made


def run(name: str, workers: list, args) -> Run:
    result = Run(name)
    histories = [prompt_ids(c, args.context, DEMO.vocab_size) for c in range(args.conversations)]
    for w in workers:
        _stream_generate(w.url, prompt_ids(424242, 64, DEMO.vocab_size), 1)  # warm-up
    for turn in range(args.turns):
        for conv in range(args.conversations):
            worker = workers[(conv + turn) % 2]  # the conversation moves every turn
            prompt = histories[conv] + prompt_ids(10_000 + conv * 100 + turn, args.question, DEMO.vocab_size)
            ttft, final = _stream_generate(worker.url, prompt, args.answer)
            details = final.get("meta_info", {}).get("cached_tokens_details") or {}
            got = {k: details.get(k, 0) for k in ("device", "host", "storage")}
            for k, v in got.items():
                result.hits[k] += v
            if turn:
                result.moved_prefix += len(histories[conv])
                result.moved_hit += min(sum(got.values()), len(histories[conv]))
            result.kind.append("cold" if sum(got.values()) < len(prompt) // 2 else max(got, key=got.get))
            result.ttft.append(ttft)
            histories[conv] = prompt + final.get("output_ids", [])
    for w in workers:
        if name.endswith("G4"):
            stats = requests.get(f"http://127.0.0.1:{w.env['DYN_KVBM_METRICS_PORT']}/stats", timeout=30).json()
            slot = stats["block_bytes"]["host"] + 4096
            result.g4_bytes += (stats["mooncake"]["write_through"] + stats["mooncake"]["staged"]) * slot
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--context", type=int, default=1400, help="tokens of each conversation's first prompt")
    parser.add_argument("--question", type=int, default=64)
    parser.add_argument("--answer", type=int, default=8)
    parser.add_argument("--pool", type=int, default=8192, help="each worker's device KV pool, tokens")
    args = parser.parse_args()
    from harness.mooncake import MooncakeCluster

    runs = []
    with tempfile.TemporaryDirectory(prefix="shared-tier-") as tmp:
        tmp = Path(tmp)
        model = make_model(tmp / "model", DEMO)
        copy = tmp / "host-b" / "weights"
        shutil.copytree(model, copy)
        for path in copy.iterdir():
            os.utime(path, ns=(10**18, 10**18))
        for name, kvbm in (("stock", False), ("kvbm-G2", True), ("kvbm-G2+G4", True)):
            with contextlib.ExitStack() as stack:
                env = {}
                if name.endswith("G4"):
                    cluster = stack.enter_context(MooncakeCluster(tmp, lend="1GB"))
                    env = {"SGLANG_KVBM_MOONCAKE_MASTER": cluster.master_address,
                           "SGLANG_KVBM_MOONCAKE_METADATA": cluster.metadata_url}
                workers = [stack.enter_context(s) for s in servers([model, copy], args.pool, tmp, name, env, kvbm)]
                runs.append(run(name, workers, args))
                print(f"{name}: done", flush=True)
    stock, g2, g4 = runs
    rows = [[r.name, pct(r.ttft, 0.5), mean(r.ttft), mean(r.ttft) / mean(stock.ttft), r.hits["device"], r.hits["host"],
             r.hits["storage"], r.moved_hit / max(1, r.moved_prefix), r.g4_bytes / 2**20] for r in runs]
    print(table(["run", "p50 TTFT s", "mean TTFT s", "mean vs stock", "device hit tok", "host hit tok",
                 "G4 hit tok", "moved prefix hit", "via Mooncake MiB"], rows))
    share = g4.moved_hit / max(1, g4.moved_prefix)
    print(f"second host (own model copy) serves {share:.1%} of the moved prefixes from a tier: {verdict(share, 0.9, False)}")
    cold = [t for t, k in zip(stock.ttft, stock.kind) if k == "cold" and t]
    g4_hits = [t for t, k in zip(g4.ttft, g4.kind) if k == "storage"]
    if g4_hits and cold:
        ratio = pct(g4_hits, 0.5) / pct(cold[args.conversations:] or cold, 0.5)
        print(f"G4 hit p50 {pct(g4_hits, 0.5):.3f} s vs recompute p50 (stock's moved turns) "
              f"{pct(cold[args.conversations:] or cold, 0.5):.3f} s: {ratio:.2f}x: {verdict(ratio, 0.5)}")
    ratio = mean(g4.ttft) / mean(g2.ttft)
    print(f"mean TTFT G2+G4 / G2 = {ratio:.2f}: {verdict(ratio, 0.8)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
