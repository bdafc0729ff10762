"""Soak: a seeded schedule of operations on a real CPU server, with every tier under pressure,
requests aborted mid-prefill and mid-decode, cache resets and disk faults.

At the end: every device page, host block and disk slot is accounted for; the
event stream's sequence numbers are contiguous; every completed request's
greedy output equals the stock server's for the same prompt.
"""

from __future__ import annotations

import json
import os
import random
import threading
import time

import pytest
import requests

from sglang_kvbm.integration.sglang.event_stream import replay
from sglang_kvbm.ops.demo.model import prompt_ids
from sglang_kvbm.ops.demo.server import SglangServer, free_port

pytestmark = pytest.mark.server

# A count, not a clock: the same operations on a fast machine and a busy one. The longer soak,
# with kill -9, warm restarts and weight updates, is benchmarks/chaos.py.
OPERATIONS = int(os.environ.get("KVBM_SOAK_OPERATIONS", "60"))
NEW = 6
KINDS = ("complete", "abort_prefill", "abort_decode", "concurrent", "reset", "disk_fault")
WEIGHTS = (45, 15, 10, 15, 7, 8)


def prompt_pool():
    systems = [prompt_ids(700 + i, 240) for i in range(3)]
    return [systems[i % 3] + prompt_ids(800 + i, 60 + 40 * (i % 4)) for i in range(12)]


def generate(url, tokens, stream=False):
    body = {"input_ids": tokens, "sampling_params": {"max_new_tokens": NEW, "temperature": 0.0, "ignore_eos": True},
            "stream": stream}
    return requests.post(f"{url}/generate", json=body, timeout=300, stream=stream)


def schedule(rng: random.Random, count: int) -> list[str]:
    """``count`` operations drawn by WEIGHTS, every kind at least twice, the first five completions
    (so the tiers fill before the first reset)."""
    ops = ["complete"] * 5 + [kind for kind in KINDS for _ in range(2)]
    ops += rng.choices(KINDS, WEIGHTS, k=max(0, count - len(ops)))
    head, tail = ops[:5], ops[5:]
    rng.shuffle(tail)
    return head + tail


def test_soak(model_dir, stock_server, tmp_path):
    prompts = prompt_pool()
    reference = [generate(stock_server.url, p).json()["output_ids"] for p in prompts]

    http, endpoint, replay_ep = free_port(), f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    disk_dir = tmp_path / "disk"
    events = {"publisher": "zmq", "endpoint": endpoint, "bind": True, "replay_endpoint": replay_ep,
              "buffer_steps": 1_000_000}
    server = SglangServer(
        model_dir,
        max_total_tokens=1024,
        extra_args=["--radix-cache-backend", "kvbm", "--kv-events-config", json.dumps(events)],
        env={
            "DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": "160",
            "DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS": "400",
            "DYN_KVBM_DISK_CACHE_DIR": str(disk_dir),
            "DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER": "true",
            "DYN_KVBM_METRICS": "true",
            "DYN_KVBM_METRICS_PORT": str(http),
        },
        log_path=tmp_path / "kvbm.log",
    )
    rng = random.Random(3)
    ops = schedule(rng, OPERATIONS)
    counts = dict.fromkeys(KINDS, 0)
    mismatches = []
    lock = threading.Lock()

    def complete(i):
        out = generate(server.url, prompts[i]).json()["output_ids"]
        with lock:
            if out != reference[i]:
                mismatches.append((i, out, reference[i]))

    with server:
        started = time.monotonic()
        stats = lambda: requests.get(f"http://127.0.0.1:{http}/stats", timeout=30).json()  # noqa: E731
        for op in ops:
            i = rng.randrange(len(prompts))
            if op == "complete":
                complete(i)
            elif op == "abort_prefill":  # closed before the first token: aborted mid-prefill (or mid-load)
                generate(server.url, prompts[i], stream=True).close()
            elif op == "abort_decode":  # closed after the first token: aborted mid-decode
                response = generate(server.url, prompts[i], stream=True)
                next(response.iter_lines(), None)
                response.close()
            elif op == "concurrent":
                threads = [threading.Thread(target=complete, args=(rng.randrange(len(prompts)),)) for _ in range(3)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
            elif op == "reset":  # SGLang refuses a flush unless idle (an aborted stream may still be ending)
                refused = 0
                while requests.post(f"{server.url}/flush_cache", timeout=60).status_code != 200:
                    refused += 1
                    assert refused < 300, "/flush_cache refused 300 times in a row on an idle server"
                    time.sleep(0.2)
            else:
                for path in disk_dir.glob("sglang-kvbm-*/seg-*.kv"):
                    size = path.stat().st_size
                    with open(path, "r+b") as f:
                        for _ in range(8):
                            f.seek(rng.randrange(size))
                            f.write(os.urandom(1))
            counts[op] += 1

        # Quiesce: drive steps until no copy is in flight and SGLang has committed every finished
        # offload (it unlocks a node at its next step, so a snapshot taken between steps can still
        # show the lock), then check the books. A real leak never settles.
        def settled(snapshot):
            d = snapshot["device"]
            return (snapshot["in_flight"] == 0 and d["protected"] == 0
                    and d["available"] + d["evictable"] == d["total"])

        for _ in range(100):
            generate(server.url, prompt_ids(123, 8)).json()
            final = stats()
            if settled(final):
                break
            time.sleep(0.2)
        batches = replay(replay_ep)

    wall = time.monotonic() - started
    device, host, disk = final["device"], final["host"], final["disk"]
    gpu_removed = sum(len(e.block_hashes) for _, b in batches for e in b.events
                      if type(e).__name__ == "BlockRemoved" and e.medium in (None, "GPU"))
    invalidated = sum(final["disk"]["invalidated"].values())
    print(f"\nsoak: {wall:.0f}s wall, {counts}, evictions: device {gpu_removed}, "
          f"host {final['connector']['removed_blocks'].get('host', 0)}, disk {final['connector']['removed_blocks'].get('disk', 0)}, "
          f"disk blocks invalidated {invalidated}, {len(batches)} event batches")
    assert not mismatches, mismatches[:3]
    assert device["available"] + device["evictable"] + device["protected"] == device["total"], device
    assert device["protected"] == 0, device
    assert host["registered"] + host["free"] == host["capacity"] and host["in_flight"] == host["orphaned"] == 0, host
    assert disk["registered"] + disk["free"] + disk["lost"] == disk["slots"] and disk["writing"] == 0, disk
    seqs = [seq for seq, _ in batches]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))) and seqs[0] == 0
    log = (tmp_path / "kvbm.log").read_text()
    assert "Traceback" not in log and "leak" not in log.lower()
    assert final["connector"]["removed_blocks"].get("host") and final["connector"]["removed_blocks"].get("disk")
