"""Operating a server: data-parallel ranks, the metrics endpoint under load, a refused start.

* ``--dp-size 2``: each DP rank's scheduler has its own linker and serves its own
  endpoint on ``DYN_KVBM_METRICS_PORT + dp_rank``; its events go out on SGLang's
  per-rank publisher port, each batch tagged with its rank.
* ``/stats`` and ``/metrics`` answer 200 while the scheduler works (they read the
  snapshot it publishes, never its live structures), with KVBM's metric names.
* A server whose configuration is refused touches nothing in the disk cache directory.
"""

from __future__ import annotations

import json
import os
import threading

import pytest
import requests

from sglang_kvbm.integration.sglang.event_stream import replay
from sglang_kvbm.ops.demo.model import prompt_ids
from sglang_kvbm.ops.demo.server import ServerError, SglangServer, free_port

pytestmark = pytest.mark.server


def test_two_dp_ranks_each_serve_their_endpoint_and_publish_their_rank(model_dir, tmp_path):
    http = free_port(2)  # rank r serves on http + r, publishes on base + r, replays on replay + r
    base = free_port(2)
    replay_base = free_port(2)
    events = {"publisher": "zmq", "endpoint": f"tcp://*:{base}", "replay_endpoint": f"tcp://*:{replay_base}"}
    server = SglangServer(
        model_dir,
        max_total_tokens=1024,
        extra_args=["--radix-cache-backend", "kvbm", "--dp-size", "2", "--kv-events-config", json.dumps(events)],
        env={"DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": "1024", "DYN_KVBM_METRICS": "true",
             "DYN_KVBM_METRICS_PORT": str(http), "SGLANG_CPU_OMP_THREADS_BIND": "0|1"},
        log_path=tmp_path / "server.log",
    )
    failures = []
    stop = threading.Event()

    def scrape():
        while not stop.is_set():
            for port in (http, http + 1):
                for path in ("/stats", "/metrics"):
                    status = requests.get(f"http://127.0.0.1:{port}{path}", timeout=30).status_code
                    if status != 200:
                        failures.append((port, path, status))

    with server:
        scraper = threading.Thread(target=scrape, daemon=True)
        scraper.start()
        for i in range(8):  # round robin over the two ranks, several prompts each
            server.generate(prompt_ids(i % 4, 300), max_new_tokens=2)
        stop.set()
        scraper.join(timeout=60)
        stats = [requests.get(f"http://127.0.0.1:{p}/stats", timeout=30).json() for p in (http, http + 1)]
        metrics = requests.get(f"http://127.0.0.1:{http}/metrics", timeout=30).text
        ranks = {rank: replay(f"tcp://127.0.0.1:{replay_base + rank}") for rank in (0, 1)}
    assert not failures, failures[:5]
    assert all(s["connector"]["offloads"] > 0 for s in stats), [s["connector"] for s in stats]
    for rank, batches in ranks.items():
        assert batches and all(batch.attn_dp_rank == rank for _, batch in batches), rank
    assert "kvbm_transfer_bytes{path=\"d2h\"}" in metrics and "kvbm_transfer_bytes_total" not in metrics
    for name in ("kvbm_offload_blocks_d2h", "kvbm_host_cache_hit_rate", "kvbm_matched_tokens"):
        assert f"\n{name} " in metrics, name


def test_a_refused_start_leaves_the_disk_cache_untouched(model_dir, tmp_path):
    directory = tmp_path / "cache"
    kept = directory / "sglang-kvbm-0123456789abcdef"
    kept.mkdir(parents=True, mode=0o700)
    (kept / "seg-0000.kv").write_bytes(os.urandom(65536))
    (kept / "index.msgpack").write_bytes(b"x" * 100)
    before = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in kept.iterdir()}
    for env, why in (
        ({"DYN_KVBM_CPU_CACHE_GB": "four"}, "DYN_KVBM_CPU_CACHE_GB='four'"),  # refused by the launcher
        # refused by the scheduler: Dynamo's router would hash other blocks than these pages
        ({"DYN_KVBM_CPU_CACHE_GB": "1", "SGLANG_KVBM_ROUTER_BLOCK_SIZE": "16"},
         "SGLANG_KVBM_ROUTER_BLOCK_SIZE=16 but --page-size is 4"),
    ):
        log = tmp_path / "server.log"
        server = SglangServer(
            model_dir, extra_args=["--radix-cache-backend", "kvbm"], log_path=log,
            env={"DYN_KVBM_DISK_CACHE_GB": "1", "DYN_KVBM_DISK_CACHE_DIR": str(directory), **env},
        )
        with pytest.raises(ServerError):
            server.start(timeout=600)
        server.stop()
        assert why in log.read_text()
        after = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in kept.iterdir()}
        assert after == before
        assert sorted(p.name for p in directory.iterdir()) == [kept.name]
