"""Two real SGLang servers share G4: a prefix computed on A is served on B from Mooncake, with stock's output.

A real ``mooncake_master`` and a standalone memory lender on 127.0.0.1
(``harness.mooncake``), CPU SGLang servers with
``--radix-cache-backend kvbm`` and ``SGLANG_KVBM_MOONCAKE_MASTER``. B stands for
a second host: it serves its own copy of the model (same bytes, another path,
other mtimes, no --served-model-name) and has its own disk directory. B never saw
the prompt: its hit can only come from what A wrote through; again after A
stopped and B's own tiers were flushed (the objects live in the lender's memory,
not A's; a restarted worker reading G4 is benchmarks/chaos.py --mooncake's).
Then the master is killed: the server goes on serving (misses, stock's
outputs), no request fails.
"""

from __future__ import annotations

import os
import shutil
import time

import pytest
import requests

from conftest import e2e_prompts, same_output
from harness.mooncake import MooncakeCluster
from sglang_kvbm.ops.demo.server import SglangServer, free_port

pytestmark = pytest.mark.server


def host_copy(model_dir, tmp_path):
    """The model as a second host holds it: the same bytes at another path, written at another time."""
    copy = tmp_path / "host-b" / "weights"
    shutil.copytree(model_dir, copy)
    for path in copy.rglob("*"):
        os.utime(path, ns=(1_600_000_000_000_000_000, 1_600_000_000_000_000_000))
    return copy


class Worker:
    def __init__(self, name, model_dir, cluster, tmp_path):
        self.http = free_port()
        disk = tmp_path / f"disk-{name}"
        disk.mkdir()
        self.server = SglangServer(
            model_dir, page_size=4, max_total_tokens=1024, extra_args=["--radix-cache-backend", "kvbm"],
            env={"DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": "512", "DYN_KVBM_METRICS": "true",
                 "DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS": "256", "DYN_KVBM_DISK_CACHE_DIR": str(disk),
                 "SGLANG_KVBM_DIGEST_CACHE": str(tmp_path / f"digests-{name}.json"),
                 "DYN_KVBM_METRICS_PORT": str(self.http), "SGLANG_KVBM_MOONCAKE_MASTER": cluster.master_address,
                 "SGLANG_KVBM_MOONCAKE_METADATA": cluster.metadata_url, "MC_TCP_BIND_ADDRESS": "127.0.0.1"},
            log_path=tmp_path / f"{name}.log",
        )

    def stats(self) -> dict:
        return requests.get(f"http://127.0.0.1:{self.http}/stats", timeout=30).json()

    def tiers(self, prompt) -> dict:
        return requests.post(f"http://127.0.0.1:{self.http}/tiers", json={"token_ids": list(prompt)}, timeout=30).json()

    def wait_for(self, what, timeout: float = 60.0) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            stats = self.stats()
            if what(stats) or time.monotonic() > deadline:
                return stats
            self.server.generate([7, 8, 9], max_new_tokens=1)  # a step: the scheduler polls the tiers
            time.sleep(0.2)


def test_a_prefix_computed_on_one_server_is_a_g4_hit_on_another(model_dir, stock_results, tmp_path):
    prompts = e2e_prompts()
    pages = len(prompts["A"]) // 4
    with MooncakeCluster(tmp_path) as cluster:
        b_model = host_copy(model_dir, tmp_path)
        a, b = Worker("a", model_dir, cluster, tmp_path), Worker("b", b_model, cluster, tmp_path)
        for worker in (a, b):  # side by side: each start is mostly one process importing
            worker.server.launch()
        try:
            a.server.wait_ready()
            b.server.wait_ready()
            assert same_output(a.server.generate(prompts["A"], max_new_tokens=8), stock_results["A"])
            written = a.wait_for(lambda s: s["mooncake"]["write_through"] >= pages)["mooncake"]
            assert written["write_through"] >= pages, written
            # B's own tiers hold nothing of it; G4 holds its pages (POST /tiers asks Mooncake)
            assert b.tiers(prompts["A"]) == {"device": 0, "host": 0, "disk": 0, "mooncake": pages * 4}
            assert_g4_hit(b, prompts["A"], pages, stock_results["A2"])
            # A stopped, B's own tiers emptied: the lender kept A's objects, B reads them again
            a.server.stop()
            b.server.flush_cache()
            assert b.tiers(prompts["A"]) == {"device": 0, "host": 0, "disk": 0, "mooncake": pages * 4}
            assert_g4_hit(b, prompts["A"], pages, stock_results["A2"], before=b.stats())
            cluster.kill_master()
            for name in ("B", "C"):  # new prompts: the G4 lookups fail, nothing else does
                assert same_output(b.server.generate(prompts[name], max_new_tokens=8), stock_results[name])
            assert b.stats()["mooncake"]["down"] >= 1
            assert b.tiers(prompts["A"])["mooncake"] is None  # G4 unreachable: /tiers says so
        finally:
            a.server.stop()
            b.server.stop()

def assert_g4_hit(worker, prompt, pages, reference, before=None) -> None:
    """``prompt`` served from G4: blocks staged from Mooncake and onboarded (since ``before``'s stats)."""
    before = before or {"mooncake": {"staged": 0}, "connector": {"onboard_blocks": {}}}
    served = worker.server.generate(prompt, max_new_tokens=8)
    stats = worker.stats()
    staged = stats["mooncake"]["staged"] - before["mooncake"]["staged"]
    onboarded = (stats["connector"]["onboard_blocks"].get("mooncake", 0)  # under its own name, not as disk
                 - before["connector"]["onboard_blocks"].get("mooncake", 0))
    assert staged >= pages - 1 and onboarded >= pages - 1, stats
    assert served["meta_info"]["cached_tokens"] >= (pages - 1) * 4
    assert same_output(served, reference)
