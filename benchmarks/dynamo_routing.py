"""Inside Dynamo: Dynamo's KV router over two SGLang workers, stock vs this library, same machine, same run.

Each run is a real deployment from Dynamo's environment (``.venv-dynamo``, which ``make test``
builds): ``python -m dynamo.frontend --router-mode kv`` and two ``python -m dynamo.sglang``
workers (file discovery, TCP requests, ZMQ KV events, all on 127.0.0.1), with the demo's
locally generated GPT-2. Conversations with long contexts take turns through the frontend's
``/v1/completions`` (token-id prompts, streamed); their working set is several times the two
device pools together, so a conversation's prefix has left its worker's device pool by its
next turn. Runs:

* ``stock``: stock SGLang workers. The router sees device pools only; an evicted prefix is
  recomputed wherever the next turn lands.
* ``kvbm-G2``: ``--radix-cache-backend kvbm`` with a host tier holding the working set; the
  workers' ``CPU_PINNED`` events tell the router where each prefix still is.
* ``kvbm-G2+G3``: a host tier barely above the device pool, and a disk tier.

Per run: TTFT (client, to the first streamed token), hit tokens by tier (``cached_tokens`` from
``usage.prompt_tokens_details``; the host and disk parts from the worker's ``/stats`` onboard
counters, read around each request), and how often a turn lands on the worker that served the
conversation's previous turn (where its prefix is). Ratios are against the stock run.

    ../.venv/bin/python dynamo_routing.py                  # ~8 minutes on 2 CPU cores
    ../.venv/bin/python dynamo_routing.py --conversations 12 --turns 5 --device cuda
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import sys
import tempfile
import time
from pathlib import Path

import checkout  # noqa: F401  (tests/harness on sys.path)
from common import mean, out_dir, pct, save_plot, table
from harness.dynamo import DynamoFrontend, DynamoWorker
from sglang_kvbm.ops.demo.model import DEMO, make_model, prompt_ids

MODEL = "gpt2-demo"


@dataclasses.dataclass
class Run:
    name: str
    ttft: list = dataclasses.field(default_factory=list)
    turn_ttft: list = dataclasses.field(default_factory=list)  # turns after the first
    hits: dict = dataclasses.field(default_factory=lambda: {"device": 0, "host": 0, "disk": 0})
    prompt_tokens: int = 0
    later_turns: int = 0
    on_holder: int = 0  # later turns that landed where the previous turn was served
    per_worker: dict = dataclasses.field(default_factory=dict)
    outputs: list = dataclasses.field(default_factory=list)
    seconds: float = 0.0


def workload(args):
    """Turn-major: every conversation's turn t before any turn t+1, so the others pass in between."""
    return [(conv, turn, prompt_ids(10_000 + conv * 100 + turn, args.question, DEMO.vocab_size))
            for turn in range(args.turns) for conv in range(args.conversations)]


def token_id(text: str) -> int:
    """The generated model's tokenizer: token i is the word "wi", then "<unk>" and EOS."""
    special = {"<unk>": DEMO.vocab_size - 2, "<|endoftext|>": DEMO.vocab_size - 1}
    return special[text] if text in special else int(text.strip().lstrip("w"))


def onboarded(workers) -> dict:
    """Blocks loaded from host and from disk so far, per worker (kvbm workers only)."""
    counts = {}
    for w in workers:
        connector = w.stats()["connector"] if w.kvbm else {}
        counts[w.instance_id] = (connector.get("onboard_blocks_h2d", 0), connector.get("onboard_blocks_d2d", 0))
    return counts


def run(name, frontend, workers, args) -> Run:
    result = Run(name)
    for w in workers:  # each worker's first request pays one-off costs
        frontend.complete(MODEL, prompt_ids(424242, 64, DEMO.vocab_size), 1, worker=w.instance_id)
    label = {w.instance_id: f"w{i + 1}" for i, w in enumerate(workers)}
    result.per_worker = {label[w.instance_id]: 0 for w in workers}
    histories = [prompt_ids(c, args.context, DEMO.vocab_size) for c in range(args.conversations)]
    served_by: dict[int, int] = {}
    started = time.perf_counter()
    for conv, turn, question in workload(args):
        prompt = histories[conv] + question
        before = onboarded(workers)
        out = frontend.stream(MODEL, prompt, args.answer)
        after = onboarded(workers)
        host = sum(after[w][0] - before[w][0] for w in after) * args.page_size
        disk = sum(after[w][1] - before[w][1] for w in after) * args.page_size
        result.hits["host"] += host
        result.hits["disk"] += disk
        result.hits["device"] += max(0, out.cached_tokens - host - disk)
        result.prompt_tokens += len(prompt)
        result.ttft.append(out.ttft_s)
        result.per_worker[label.get(out.worker_id, "?")] = result.per_worker.get(label.get(out.worker_id, "?"), 0) + 1
        if turn > 0:
            result.turn_ttft.append(out.ttft_s)
            result.later_turns += 1
            result.on_holder += out.worker_id == served_by[conv]
        served_by[conv] = out.worker_id
        answer = [token_id(t) for t in out.tokens]
        result.outputs.append(answer)
        histories[conv] = prompt + answer
    result.seconds = time.perf_counter() - started
    return result


def deploy(name, model, args, kvbm_env, out):
    """Frontend and two workers of one run (``kvbm_env`` None: stock SGLang)."""
    discovery = Path(tempfile.mkdtemp(prefix=f"dynamo-{name}-"))
    frontend = DynamoFrontend(discovery, log_path=out / f"dynamo-{name}-frontend.log")
    extra = [] if args.device == "cpu" else ["--device", args.device]
    workers = [
        DynamoWorker(discovery, model, served_model_name=MODEL, page_size=args.page_size,
                     max_total_tokens=args.pool, kvbm=kvbm_env is not None,
                     kvbm_env={**(kvbm_env or {}), "DYN_KVBM_DISK_CACHE_DIR": str(discovery / f"disk{i}")},
                     extra_args=extra, log_path=out / f"dynamo-{name}-worker{i}.log", label=f"{name} w{i}")
        for i in (1, 2)
    ]
    return discovery, frontend, workers


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--context", type=int, default=1500)
    parser.add_argument("--question", type=int, default=40)
    parser.add_argument("--answer", type=int, default=16)
    parser.add_argument("--pool", type=int, default=3072, help="device KV pool per worker, tokens")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)

    out = out_dir()
    model = make_model(out / "model-demo", DEMO)
    working_set = args.conversations * (args.context + args.turns * (args.question + args.answer))
    print(f"# {args.conversations} conversations x {args.turns} turns, working set ~{working_set} tokens, "
          f"2 workers x {args.pool}-token device pools, page {args.page_size}, device {args.device}", flush=True)
    configs = [
        ("stock", None),
        ("kvbm-G2", {"DYN_KVBM_CPU_CACHE_GB": "2"}),
        ("kvbm-G2+G3", {
            "DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": str(args.pool // args.page_size + 8),
            "DYN_KVBM_DISK_CACHE_GB": "2",
            # Every block here is reused, but with a host tier this small its first reuse comes after
            # the host let it go: KVBM's frequency filter would keep almost all of it off disk.
            "DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER": "true",
        }),
    ]
    runs = []
    for name, kvbm_env in configs:
        print(f"# {name} ...", flush=True)
        discovery, frontend, workers = deploy(name, model, args, kvbm_env, out)
        try:
            for process in (frontend, *workers):
                process.start()
            for w in workers:
                w.wait_ready(timeout=600)
            frontend.wait_ready(MODEL, [w.instance_id for w in workers], timeout=300)
            runs.append(run(name, frontend, workers, args))
        finally:
            frontend.stop()
            for w in workers:
                w.stop()
            shutil.rmtree(discovery, ignore_errors=True)  # with the disk tiers' preallocated files

    stock = runs[0]
    rows = []
    for r in runs:
        hit = sum(r.hits.values())
        rows.append([
            r.name, len(r.ttft), pct(r.ttft, 0.5), pct(r.ttft, 0.5) / pct(stock.ttft, 0.5), mean(r.ttft),
            pct(r.turn_ttft, 0.5), r.hits["device"], r.hits["host"], r.hits["disk"], hit / max(1, r.prompt_tokens),
            f"{r.on_holder}/{r.later_turns}", " ".join(f"{k}:{v}" for k, v in sorted(r.per_worker.items())),
        ])
    print(table(["run", "requests", "p50 TTFT s", "p50 vs stock", "mean TTFT s", "p50 later turns s",
                 "device hit", "host hit", "disk hit", "hit share", "on holder", "requests per worker"], rows))
    for r in runs[1:]:
        print(f"greedy outputs of {r.name} identical to stock's: {r.outputs == stock.outputs}")

    def draw(ax):
        ax.boxplot([r.ttft for r in runs], tick_labels=[r.name for r in runs], showfliers=True)
        ax.set_ylabel("TTFT (s)")
        ax.set_title("Dynamo KV router, two workers: TTFT per request")

    print(f"plot: {save_plot('dynamo_routing', draw)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
