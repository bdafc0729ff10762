"""What Dynamo's router believes each worker holds equals what each worker holds.

Two real CPU SGLang workers run this library with every tier under pressure
(device pool, host tier and disk tier all far smaller than the workload), and
publish their events to Dynamo's real indexer (``python -m dynamo.indexer``,
registered with each worker's replay endpoint). After a randomized multi-turn
workload, for a set of probe prompts, the indexer's per-worker, per-tier
matched tokens (``POST /query``) must equal each worker's own answer (its
``POST /tiers`` endpoint, the truth API). Then again after a cache reset on one
worker, and after disk faults on the other.
"""

from __future__ import annotations

import json
import os
import random
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from harness.indexer import DynamoIndexer
from sglang_kvbm.integration.sglang.event_stream import replay
from sglang_kvbm.ops.demo.model import prompt_ids
from sglang_kvbm.ops.demo.server import SglangServer, free_port

pytestmark = pytest.mark.server

PAGE = 4
SYSTEMS = [prompt_ids(900 + i, 160) for i in range(3)]


class Worker:
    def __init__(self, wid, model_dir, tmp_path):
        self.id = wid
        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.replay = f"tcp://127.0.0.1:{free_port()}"
        self.http = free_port()
        self.disk_dir = tmp_path / f"disk{wid}"
        self.log = tmp_path / f"worker{wid}.log"
        events = {"publisher": "zmq", "endpoint": self.endpoint, "bind": True, "replay_endpoint": self.replay}
        self.server = SglangServer(
            model_dir,
            page_size=PAGE,
            max_total_tokens=1024,
            extra_args=["--radix-cache-backend", "kvbm", "--kv-events-config", json.dumps(events)],
            env={
                "DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": "150",
                "DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS": "400",
                "DYN_KVBM_DISK_CACHE_DIR": str(self.disk_dir),
                "DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER": "true",
                "DYN_KVBM_METRICS": "true",
                "DYN_KVBM_METRICS_PORT": str(self.http),
                "SGLANG_KVBM_ROUTER_BLOCK_SIZE": str(PAGE),
            },
            log_path=self.log,
        )

    def truth(self, tokens, cache_salt=None):
        body = {"token_ids": tokens}
        if cache_salt:
            body["cache_salt"] = cache_salt
        response = requests.post(f"http://127.0.0.1:{self.http}/tiers", json=body, timeout=30)
        response.raise_for_status()
        return response.json()

    def stats(self):
        return requests.get(f"http://127.0.0.1:{self.http}/stats", timeout=30).json()


def settle(workers):
    """Drive every worker until no copy is in flight, so every tier change has been published."""
    quiet = 0
    for _ in range(200):
        in_flight = 0
        for w in workers:
            w.server.generate(prompt_ids(77_000, 8), max_new_tokens=1)  # one step: polls, publishes
            in_flight += w.stats()["in_flight"]
        quiet = quiet + 1 if in_flight == 0 else 0
        if quiet >= 2:
            return
    raise AssertionError("copies still in flight after 200 rounds")


def all_truths(workers, probes) -> dict:
    """``{(probe index, worker id): /tiers answer}``, asked all at once: an idle scheduler (--sleep-on-idle)
    answers /tiers questions at its next step, at most a second away, every question queued by then in that step."""
    with ThreadPoolExecutor(max_workers=len(probes) * len(workers)) as pool:
        asked = {(i, w.id): pool.submit(w.truth, tokens, cache_salt=salt)
                 for i, (tokens, salt) in enumerate(probes) for w in workers}
    return {key: future.result() for key, future in asked.items()}


def agreement(indexer, workers, probes):
    """Compare until the indexer has caught up (it consumes asynchronously); return mismatches."""
    deadline = time.monotonic() + 60  # answers as soon as they agree; 60 s only for a slow machine
    while True:
        mismatches = []
        truths = all_truths(workers, probes)
        for i, (tokens, salt) in enumerate(probes):
            seen = indexer.query(tokens, cache_salt=salt)
            for w in workers:
                truth = truths[i, w.id]
                mine = seen.get(str(w.id), {})
                got = {"device": mine.get("gpu", 0), "host": mine.get("cpu", 0), "disk": mine.get("disk", 0)}
                if got != truth:
                    mismatches.append((w.id, len(tokens), salt, truth, got))
        if not mismatches or time.monotonic() > deadline:
            return mismatches
        time.sleep(0.25)  # the indexer applies events on its own threads; nothing to wait on but time


def run_workload(workers, rng, turns=36):
    conversations = []
    for c in range(6):
        history = SYSTEMS[c % 3] + prompt_ids(5000 + c, 40)
        conversations.append({"history": history, "salt": "tenant-b" if c == 5 else None})
    for _ in range(turns):
        conv = rng.choice(conversations)
        worker = rng.choice(workers)
        body = {"cache_salt": conv["salt"]} if conv["salt"] else {}
        out = worker.server.generate(conv["history"] + prompt_ids(rng.randrange(10**6), 24), max_new_tokens=4, **body)
        conv["history"] = conv["history"] + prompt_ids(rng.randrange(10**6), 24) + out["output_ids"]
    return conversations


def probe_set(conversations, rng):
    probes = [(s, None) for s in SYSTEMS]
    for conv in conversations:
        h = conv["history"]
        probes += [(h, conv["salt"]), (h[: len(h) // 2], conv["salt"]), (h, "nobody")]
    probes += [(prompt_ids(rng.randrange(10**6), 100), None) for _ in range(3)]
    return probes


def test_indexer_agrees_with_every_worker(model_dir, tmp_path):
    rng = random.Random(7)
    workers = [Worker(1, model_dir, tmp_path), Worker(2, model_dir, tmp_path)]
    with DynamoIndexer(log_path=tmp_path / "indexer.log") as indexer:
        try:
            for w in workers:  # side by side: each start is mostly one process importing
                w.server.launch()
            for w in workers:
                w.server.wait_ready()
                indexer.register(w.id, w.endpoint, w.replay, PAGE)
            started = time.monotonic()
            conversations = run_workload(workers, rng)
            elapsed = time.monotonic() - started
            settle(workers)
            probes = probe_set(conversations, rng)
            mismatches = agreement(indexer, workers, probes)
            events = sum(len(b.events) for w in workers for _, b in replay(w.replay))
            print(f"\nagreement after the workload: {len(probes)} probes x {len(workers)} workers, "
                  f"{len(mismatches)} mismatches; {events} events in {elapsed:.1f}s ({events / elapsed:.0f}/s)")
            assert not mismatches, mismatches[:5]
            hits = list(all_truths(workers, probes).values())
            assert any(h["host"] > h["device"] for h in hits), hits  # probes that exercise the host tier

            # A prompt pushed out of the device pool and the host tier, but not off disk. Host rows a disk write
            # still reads are not evicted (on a busy machine the writes lag): push until it is out of host.
            pushed = prompt_ids(31337, 200)
            for w in workers:
                for p in (pushed, prompt_ids(31338, 300), prompt_ids(31339, 300), prompt_ids(31340, 300)):
                    w.server.generate(p, max_new_tokens=1)
            settle(workers)
            for seed in range(31341, 31346):
                if all(w.truth(pushed)["host"] < len(pushed) // PAGE * PAGE for w in workers):
                    break
                for w in workers:
                    w.server.generate(prompt_ids(seed, 300), max_new_tokens=1)
                settle(workers)
            for w in workers:  # by now every tier has been under pressure
                counters = w.stats()["connector"]
                assert counters["removed_blocks"].get("host") and counters["removed_blocks"].get("disk"), counters
                gpu_removed = [e for _, b in replay(w.replay) for e in b.events
                               if type(e).__name__ == "BlockRemoved" and e.medium in (None, "GPU")]
                assert gpu_removed, "the device pool never evicted"
            probes.append((pushed, None))
            mismatches = agreement(indexer, workers, probes)
            print(f"agreement with a disk-only prefix: {len(probes)} probes, {len(mismatches)} mismatches")
            assert not mismatches, mismatches[:5]
            truths = [w.truth(pushed) for w in workers]
            assert all(t["disk"] > t["host"] for t in truths), truths

            # A reset clears every tier of worker 1, for the router too.
            workers[0].server.flush_cache()
            settle(workers)
            assert not agreement(indexer, workers, probes)
            assert all(answer["disk"] == 0 for answer in all_truths(workers[:1], probes).values())

            # Disk faults on worker 2: its next disk hits fail verification and leave every tier's view.
            for path in (workers[1].disk_dir).glob("sglang-kvbm-*/seg-*.kv"):
                with open(path, "r+b") as f:
                    size = os.path.getsize(path)
                    for offset in range(4096 + 100, size, 20480):
                        f.seek(offset)
                        f.write(b"\xff")
            assert workers[1].truth(pushed)["disk"] > workers[1].truth(pushed)["host"]
            workers[1].server.generate(pushed, max_new_tokens=1)  # a disk hit: refused on verification
            for conv in conversations:
                workers[1].server.generate(conv["history"], max_new_tokens=1,
                                           **({"cache_salt": conv["salt"]} if conv["salt"] else {}))
            settle(workers)
            assert sum(workers[1].stats()["disk"]["invalidated"].values()) > 0
            mismatches = agreement(indexer, workers, probes)
            print(f"agreement after disk faults: {len(probes)} probes, {len(mismatches)} mismatches")
            assert not mismatches, mismatches[:5]
        finally:
            for w in workers:
                w.server.stop()
