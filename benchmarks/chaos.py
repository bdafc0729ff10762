"""Chaos soak: real kvbm servers under a seeded schedule of faults, every answer checked against stock SGLang.

Multi-turn conversations sharing system prompts (and forking each other) run
in waves of concurrent requests against ``--radix-cache-backend kvbm`` servers
whose device pool is far smaller than the working set, so prefixes come back
from the device, the host tier, the disk tier and (``--mooncake``) G4. Between
and during waves, on a seeded schedule (``chaos_workload.FAULT_RATES``):

* ``/flush_cache`` (retried while SGLang refuses it: 400 unless idle);
* streams closed by the client before the first token and after it;
* disk damage: bytes flipped in blocks' data and in their headers, a segment
  file truncated, a segment file deleted; kill -9 then 4 bytes flipped in
  ``index.msgpack`` or in the journal's first half, and a warm restart on the
  same directory (the index is rebuilt from the blocks' headers);
* kill -9 and a warm restart; ``/update_weights_from_disk`` with the same files;
* ``--mooncake``: a real ``mooncake_master`` and lender, a second worker sharing
  G4 (~30% of requests), objects overwritten with other bytes of the same size,
  the master killed (a few requests served without it) and started again.

The reference is a stock SGLang server (no kvbm, same model, flags and device
pool) that answers every prompt first; its run is also the baseline. A
completed request whose greedy ids differ from the reference's is *wrong*; one
not answered within ``--hang-seconds`` is a *hang*; after every fault phase and
at the end each idle server's ``/stats`` must settle with nothing pinned, in
flight, orphaned or held (a *leak* otherwise). Exit status 1 on any wrong
answer, hang, leak, error or crash.

The model is ``testing.model.CHAOS``: a random GPT-2 whose greedy output moves
when a few tokens' KV do; ``--self-check`` shows the comparison can fail
(FP8 KV, bfloat16) and does not fail stock against stock.

    python benchmarks/chaos.py --self-check --requests 100    # ~3 minutes on 2 idle CPU cores
    python benchmarks/chaos.py --requests 100                 # ~3 minutes (~4 with --mooncake)
    python benchmarks/chaos.py                                # 1000 requests: ~7 minutes idle, ~13 beside a test run
    python benchmarks/chaos.py --mooncake                     # with G4: two workers, a Mooncake Store

Server logs (one per incarnation), the fault log and every finding go to
``bench-out/chaos-logs/`` and ``bench-out/chaos.json``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import chaos_selfcheck
import checkout  # noqa: F401  (tests/harness on sys.path)
from chaos_run import ChaosPass, Tally, reference_pass
from chaos_worker import WARM_UP, Worker
from chaos_workload import build
from common import mean, out_dir, pct, scratch_dir, table
from sglang_kvbm.ops.demo.model import CHAOS, make_model
from sglang_kvbm.ops.demo.server import SglangServer


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mooncake", action="store_true", help="G4: a Mooncake Store and a second worker")
    parser.add_argument("--self-check", action="store_true", help="show the comparison can fail (and not fail)")
    parser.add_argument("--concurrency", type=int, default=3, help="requests per wave, at most")
    parser.add_argument("--pool", type=int, default=1536, help="device KV pool, tokens (stock and kvbm)")
    parser.add_argument("--host-blocks", type=int, default=192, help="host tier, 16-token blocks")
    parser.add_argument("--disk-blocks", type=int, default=1024, help="disk tier, 16-token blocks")
    parser.add_argument("--hang-seconds", type=float, default=120.0, help="a request not answered by then hangs")
    parser.add_argument("--idle-seconds", type=float, default=30.0, help="how long an idle server may take to settle")
    return parser.parse_args()


def share(part: int, whole: int) -> str:
    return f"{part / whole:.1%}" if whole else "-"


def report(stock: Tally, chaos: Tally, wall: dict) -> str:
    lines = []
    rows = [
        ["requests completed", stock.completed, chaos.completed, ""],
        ["prompt tokens", stock.prompt_tokens, chaos.prompt_tokens, ""],
        ["cached tokens (share of prompt)", f"{stock.cached} ({share(stock.cached, stock.prompt_tokens)})",
         f"{chaos.cached} ({share(chaos.cached, chaos.prompt_tokens)})", f"{chaos.cached / max(1, stock.cached):.2f}x"],
    ]
    for kind in ("device", "host", "storage"):
        rows.append([f"  {kind} hits, share of cached", share(stock.hits[kind], stock.cached),
                     share(chaos.hits[kind], chaos.cached), ""])
    lower = chaos.hits["host"] + chaos.hits["storage"]
    rows += [
        ["  lower tiers (host + storage), share of cached", "-", share(lower, chaos.cached), ""],
        ["wrong (greedy ids != reference)", len(stock.wrong), len(chaos.wrong), ""],
        ["hangs", len(stock.hangs), len(chaos.hangs), ""],
        ["errors", len(stock.errors), len(chaos.errors), ""],
        ["leaks at idle (failed / idle checks)", "-", f"{len(chaos.leaks)} / {chaos.idle_checks}", ""],
        ["crashes (a server died unasked)", "-", len(chaos.crashes), ""],
        ["request latency p50 / p99 s", f"{pct(stock.latency, .5):.3f} / {pct(stock.latency, .99):.3f}",
         f"{pct(chaos.latency, .5):.3f} / {pct(chaos.latency, .99):.3f}",
         f"{mean(chaos.latency) / mean(stock.latency):.2f}x mean" if stock.latency and chaos.latency else ""],
        ["serving wall s (inside waves)", f"{stock.serve_s:.1f}", f"{chaos.serve_s:.1f}",
         f"{chaos.serve_s / max(1e-9, stock.serve_s):.2f}x"],
        ["restarts, s to healthy (mean)", "-", f"{len(chaos.restarts)} ({mean(chaos.restarts):.1f})"
         if chaos.restarts else "0", ""],
        ["pass wall s (start-ups, faults included)", f"{wall['stock']:.0f}", f"{wall['chaos']:.0f}", ""],
    ]
    lines.append(table(["", "stock (reference)", "kvbm under chaos", "kvbm / stock"], rows))
    lines.append("")
    fault_rows = [[kind, done, skipped] for kind, (done, skipped) in sorted(chaos.faults.items())]
    fault_rows.append(["total", sum(r[1] for r in fault_rows), sum(r[2] for r in fault_rows)])
    lines.append(table(["fault", "applied", "nothing to damage"], fault_rows))
    if chaos.lower:
        lines.append("")
        lines.append(table(["what the tiers saw (summed over incarnations)", "count"], sorted(chaos.lower.items())))
    return "\n".join(lines)


def main() -> int:
    args = parse()
    started = time.monotonic()
    scratch = Path(scratch_dir("kvbm-chaos-"))
    logs = out_dir() / "chaos-logs"
    shutil.rmtree(logs, ignore_errors=True)
    logs.mkdir(parents=True)
    model = make_model(scratch / "model", CHAOS)
    sched = build(args.seed, args.requests, concurrency=args.concurrency, mooncake=args.mooncake)
    print(f"schedule: seed {args.seed}, {sched.requests} requests in {len(sched.waves)} waves, "
          f"{len(sched.conversations)} conversations, {sum(map(len, sched.faults.values()))} faults; logs in {logs}",
          flush=True)

    stock = Tally("stock")
    t = time.monotonic()
    with SglangServer(model, page_size=16, max_total_tokens=args.pool, log_path=logs / "stock.log") as server:
        server.generate(WARM_UP, max_new_tokens=1)  # the first request's one-time costs
        reference = reference_pass(sched, server.url, stock, args.hang_seconds, args.concurrency)
    wall = {"stock": time.monotonic() - t}
    print(f"reference: {stock.completed} requests, {len(reference)} prompts in {wall['stock']:.0f} s", flush=True)
    if args.self_check:
        return chaos_selfcheck.run(model, sched, reference, stock, args, logs)

    chaos = Tally("kvbm")
    t = time.monotonic()
    cluster = None
    workers = []
    try:
        if args.mooncake:
            from harness.mooncake import MooncakeCluster

            cluster = MooncakeCluster(scratch, lend="512MB").__enter__()
        for name in ("A", "B") if args.mooncake else ("A",):
            workers.append(Worker(name, model, scratch, logs, pool=args.pool, host_blocks=args.host_blocks,
                                  disk_blocks=args.disk_blocks, cluster=cluster))
            workers[-1].start()
        ChaosPass(sched, workers, chaos, reference, args, cluster).run()
    finally:
        for worker in workers:
            worker.stop()
        if cluster is not None:
            cluster.stop()
    wall["chaos"] = time.monotonic() - t

    tracebacks = {p.name: p.read_text(errors="replace").count("Traceback") for p in sorted(logs.glob("[AB]-*.log"))}
    print()
    print(report(stock, chaos, wall))
    print(f"\nslowest kvbm requests (s, request, server, cached tokens): {chaos.slowest[:3]}")
    print(f"tracebacks in the kvbm servers' logs: {sum(tracebacks.values())} "
          f"({', '.join(f'{k}: {v}' for k, v in tracebacks.items() if v) or 'none'})")
    print(f"wall time: {time.monotonic() - started:.0f} s "
          f"(requests --requests {args.requests} --seed {args.seed}{' --mooncake' if args.mooncake else ''})")
    summary = {"args": vars(args), "wall_s": time.monotonic() - started, "faults": chaos.faults,
               "fault_log": chaos.fault_log, "wrong": chaos.wrong, "hangs": chaos.hangs, "errors": chaos.errors,
               "leaks": chaos.leaks, "crashes": chaos.crashes, "stock_wrong": stock.wrong, "tiers": chaos.lower,
               "hits": chaos.hits, "stock_hits": stock.hits, "tracebacks": tracebacks,
               "slowest": chaos.slowest, "stock_slowest": stock.slowest}
    path = out_dir() / "chaos.json"
    path.write_text(json.dumps(summary, indent=1))
    if chaos.failed() or stock.wrong:
        for name in ("wrong", "hangs", "errors", "leaks", "crashes"):
            for line in getattr(chaos, name)[:10]:
                print(f"{name.upper()}: {line}")
        for line in stock.wrong[:5]:
            print(f"STOCK AGAINST ITSELF: {line}")
        print(f"FAILED (details, with the fault log: {path})")
        return 1
    print(f"PASSED: 0 wrong, 0 hangs, 0 leaks (details: {path})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
