"""SGLang's default page size (1) and a large one (64), on a real server: host and disk hits equal stock's output.

Every other server test runs at page size 4. A block is one page, so page size
1 means a block, an event, a disk slot (with its header) per token, and 64 the
other way round; both must serve exactly what stock SGLang serves. The device
pool holds one prompt; the host tier two. ``A, B, A``: the second ``A`` comes
back from host memory; ``C, D`` push ``A`` out of the host tier onto disk (every
host block is written to disk at once: filter off); the third ``A`` comes back
from disk. Each is compared with stock SGLang serving ``A`` from its device pool.
"""

from __future__ import annotations

import time

import pytest
import requests

from conftest import e2e_prompts, same_output
from sglang_kvbm.ops.demo.model import prompt_ids
from sglang_kvbm.ops.demo.server import SglangServer, free_port

pytestmark = pytest.mark.server

PROMPT = 600  # e2e_prompts' length


@pytest.mark.parametrize("page", [1, 64])
def test_host_and_disk_hits_at_page_size(page, model_dir, stock_results, tmp_path):
    prompts = {**e2e_prompts(), "D": prompt_ids(3, PROMPT)}
    http = free_port()
    cached = (PROMPT - 1) // page * page  # what SGLang may serve of a prompt from cache: len - 1, whole pages
    env = {
        "DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": str(2 * (PROMPT + 8) // page + 1),  # two prompts' pages
        "DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS": str(8 * PROMPT // page),
        "DYN_KVBM_DISK_CACHE_DIR": str(tmp_path / "disk"),
        "DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER": "true",
        "DYN_KVBM_METRICS": "true",
        "DYN_KVBM_METRICS_PORT": str(http),
    }
    server = SglangServer(model_dir, page_size=page, max_total_tokens=1024, extra_args=["--radix-cache-backend", "kvbm"],
                          env=env, log_path=tmp_path / "server.log")

    def tiers(name):
        return requests.post(f"http://127.0.0.1:{http}/tiers", json={"token_ids": prompts[name]}, timeout=30).json()

    def onboarded():
        """The connector's counters from a /stats snapshot the scheduler took after this call (between steps)."""
        asked = time.time()
        while (stats := requests.get(f"http://127.0.0.1:{http}/stats", timeout=30).json())["published_at"] <= asked:
            server.generate([5, 6, 7], max_new_tokens=1)
        return stats["connector"]

    def served(name, tier, counter):
        before = onboarded()[counter]
        out = server.generate(prompts[name], max_new_tokens=8)
        loaded = (onboarded()[counter] - before) * page
        print(f"page {page}: {name} from {tier}: {loaded} tokens loaded, cached_tokens "
              f"{out['meta_info']['cached_tokens']}")
        assert out["meta_info"]["cached_tokens"] >= cached, out["meta_info"]
        assert loaded > 0, f"nothing came from {tier}"
        return out

    with server:
        assert same_output(server.generate(prompts["A"], max_new_tokens=8), stock_results["A"])
        server.generate(prompts["B"], max_new_tokens=8)  # A leaves the device pool (it holds one prompt)
        assert tiers("A")["device"] < cached <= tiers("A")["host"], tiers("A")
        assert same_output(served("A", "host", "onboard_blocks_h2d"), stock_results["A2"])
        for name in ("C", "D"):  # A leaves the host tier (two prompts' worth); its blocks are on disk
            server.generate(prompts[name], max_new_tokens=8)
        # Host rows a disk write still reads are not evicted, and an offload that finds no row is dropped: on a
        # busy machine C and D can pass without pushing A out (seen in a full run at page 64). Then another
        # prompt pushes again, at most three (the disk tier holds eight prompts: A stays there).
        fillers = [prompt_ids(seed, PROMPT) for seed in (10, 11, 12)]
        deadline = time.monotonic() + 120
        steps = 0
        while not (now := tiers("A"))["host"] < cached <= now["disk"]:
            assert time.monotonic() < deadline, now
            steps += 1
            if steps % 10 == 0 and fillers:
                server.generate(fillers.pop(), max_new_tokens=8)
            server.generate([5, 6, 7], max_new_tokens=1)  # a step: the scheduler collects finished disk writes
            time.sleep(0.2)
        assert same_output(served("A", "disk", "onboard_blocks_d2d"), stock_results["A2"])
    # the start-up log says what a small page costs, and what to use instead
    warned = "makes every token a block" in (tmp_path / "server.log").read_text()
    assert warned == (page == 1)
