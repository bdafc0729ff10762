"""End to end with the disk tier: a real CPU server whose host tier is smaller than the working set.

Repeated prompts are served from disk with the stock server's exact output;
faults injected into the cache files on disk turn into recomputation with the
same exact output; a restart on the same directory serves from disk again.

That a server of another identity (another page size, say) loads nothing from the directory and reclaims
it is told in process, without a third server start: ``test_fingerprint.py`` (the page size and pool
dtype are in the identity) and ``test_disk_tier.py::test_restart_reuses_blocks_and_another_identity_loads_nothing``.
"""

from __future__ import annotations

import json
import os
import time

import pytest
import requests
from sglang.srt.disaggregation.kv_events import BlockStored

from conftest import e2e_prompts, run_e2e_sequence, same_output
from sglang_kvbm.integration.sglang.event_stream import replay
from sglang_kvbm.ops.demo.model import prompt_ids
from sglang_kvbm.ops.demo.server import SglangServer, free_port

pytestmark = pytest.mark.server

HEADER, BLOCK = 4096, 16384  # this model and page size: 4 buffers x 4 KiB per page, one 4 KiB header


def disk_env(directory, **extra):
    return {
        "DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": "64",  # 256 tokens: far below one prompt
        "DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS": "2048",
        "DYN_KVBM_DISK_CACHE_DIR": str(directory),
        "DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER": "true",
        **extra,
    }


class Observed:
    """Metrics endpoint and event stream of a server."""

    def __init__(self):
        self.http = free_port()
        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.replay = f"tcp://127.0.0.1:{free_port()}"

    def args(self):
        config = {"publisher": "zmq", "endpoint": self.endpoint, "bind": True, "replay_endpoint": self.replay}
        return ["--kv-events-config", json.dumps(config)]

    def env(self):
        return {"DYN_KVBM_METRICS": "true", "DYN_KVBM_METRICS_PORT": str(self.http)}

    def metrics(self):
        text = requests.get(f"http://127.0.0.1:{self.http}/metrics", timeout=30).text
        values = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                values[name] = float(value)
        return values

    def stored(self):
        """Blocks the event stream says were stored, per lower-tier medium."""
        stores = {"CPU_PINNED": 0, "DISK": 0}
        for _, batch in replay(self.replay):
            for event in batch.events:
                if isinstance(event, BlockStored) and event.medium in stores:
                    stores[event.medium] += len(event.block_hashes)
        return stores

    def idle(self, timeout=120.0) -> None:
        """No copy in flight, three scrapes in a row (0.2 s apart): every write to disk so far has landed."""
        deadline, quiet = time.monotonic() + timeout, 0
        while quiet < 3 and time.monotonic() < deadline:
            stats = requests.get(f"http://127.0.0.1:{self.http}/stats", timeout=30).json()
            quiet = quiet + 1 if stats["in_flight"] == 0 else 0
            time.sleep(0.2)

    def settled(self, timeout=120.0):
        """Metrics and stored blocks once no copy is in flight and the publisher has caught up.

        The idle scheduler keeps polling the cache, and SGLang's publisher sends
        from its own thread, so one scrape and one replay are two moments: read
        both until a scrape taken after the replay still matches the one before.
        """
        deadline = time.monotonic() + timeout
        while True:
            stats = requests.get(f"http://127.0.0.1:{self.http}/stats", timeout=30).json()
            before = self.metrics()
            stores = self.stored()
            after = self.metrics()
            offloaded = after["kvbm_offload_blocks_h2d"] + after["kvbm_offload_blocks_d2d"]
            host = after["kvbm_offload_blocks_d2h"] + after.get(KEPT_FROM_DISK, 0)  # and the disk reads kept in host
            if stats["in_flight"] == 0 and before == after and stores == {"CPU_PINNED": host, "DISK": offloaded}:
                return after, stores
            if time.monotonic() > deadline:
                return after, stores  # the caller's assertions say what disagrees
            time.sleep(0.2)


def start(model_dir, directory, log, observed=None):
    return SglangServer(
        model_dir,
        max_total_tokens=1024,
        extra_args=["--radix-cache-backend", "kvbm"] + (observed.args() if observed else []),
        env=disk_env(directory, **(observed.env() if observed else {})),
        log_path=log,
    )


def segment(directory):
    (cache,) = [p for p in directory.iterdir() if p.name.startswith("sglang-kvbm-")]
    return cache / "seg-0000.kv"


KEPT_FROM_DISK = 'kvbm_tier_offload_blocks{source="disk",tier="host"}'  # SGLANG_KVBM_KEEP_READS


def corrupt_every_block(path):
    slots = os.path.getsize(path) // (HEADER + BLOCK)
    with open(path, "r+b") as f:
        for slot in range(slots):
            f.seek(slot * (HEADER + BLOCK) + HEADER + 123)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x40]))


def check_metrics_against_work(server, observed, results):
    """KVBM's counters, scraped, equal what the responses and the event stream say was done."""
    server.generate(prompt_ids(99, 8), max_new_tokens=1)  # drain the last copies into events
    metrics, stores = observed.settled()
    host_tokens = sum((r["meta_info"].get("cached_tokens_details") or {}).get("host", 0) for r in results)
    disk_tokens = sum((r["meta_info"].get("cached_tokens_details") or {}).get("storage", 0) for r in results)
    assert metrics["kvbm_onboard_blocks_h2d"] == host_tokens // 4
    assert metrics["kvbm_onboard_blocks_d2d"] == disk_tokens // 4 > 0
    assert metrics["kvbm_matched_tokens"] == host_tokens + disk_tokens
    # host's CPU_PINNED stores: from the device, and the disk reads loads kept in host (SGLANG_KVBM_KEEP_READS)
    kept = metrics.get(KEPT_FROM_DISK, 0)
    assert metrics["kvbm_offload_blocks_d2h"] + kept == stores["CPU_PINNED"] > 0 and kept > 0
    assert metrics["kvbm_offload_blocks_h2d"] + metrics["kvbm_offload_blocks_d2d"] == stores["DISK"] > 0
    assert 0 < metrics["kvbm_disk_cache_hit_rate"] <= 1 and 0 <= metrics["kvbm_host_cache_hit_rate"] <= 1
    assert metrics['kvbm_transfer_seconds_count{path="d2h"}'] > 0
    assert metrics['kvbm_transfer_seconds_count{path="onboard_d2d"}'] > 0
    assert metrics['kvbm_tier_blocks{tier="disk"}'] > 0
    # every tier by name, the same counts (KVBM's names are views of these; a tier that served nothing has no series)
    assert metrics.get('kvbm_tier_onboard_blocks{tier="host"}', 0) == metrics["kvbm_onboard_blocks_h2d"]
    assert metrics['kvbm_tier_onboard_blocks{tier="disk"}'] == metrics["kvbm_onboard_blocks_d2d"] > 0
    assert metrics['kvbm_tier_offload_blocks{source="device",tier="host"}'] == metrics["kvbm_offload_blocks_d2h"]
    assert metrics['kvbm_tier_hit_rate{tier="disk"}'] == metrics["kvbm_disk_cache_hit_rate"]


def test_disk_hits_faults_and_restart(model_dir, stock_results, tmp_path):
    directory = tmp_path / "kvbm-disk"
    log = tmp_path / "server.log"
    prompts = e2e_prompts()

    observed = Observed()
    with start(model_dir, directory, log, observed=observed) as server:
        results = run_e2e_sequence(server)
        details = results[-1]["meta_info"]["cached_tokens_details"]
        assert details.get("storage", 0) > 0 and details["storage"] + details["host"] == 596, details
        for ours, name in zip(results, ("A", "B", "C", "A2")):
            assert same_output(ours, stock_results[name]), name
        check_metrics_against_work(server, observed, results)

        # The segment file deleted under the server: recreated, the hit is a miss, service goes on. First, while the
        # disk's read meter holds good reads only: the onboard policy reads B from disk then (a read of corrupt blocks,
        # below, can make disk look slower than prefill on a loaded machine, and a span it does not read is not
        # found missing).
        segment(directory).unlink()
        deleted = server.generate(prompts["B"], max_new_tokens=8)
        assert same_output(deleted, stock_results["B"])
        assert "recreated it empty" in log.read_text()

        # A bit flipped in every block on disk: the next disk hit is refused and recomputed.
        server.generate(prompts["A"], max_new_tokens=8)  # B out of host, on disk again (filter off)
        server.generate(prompts["C"], max_new_tokens=8)
        corrupt_every_block(segment(directory))
        flipped = server.generate(prompts["B"], max_new_tokens=8)
        assert flipped["meta_info"]["cached_tokens"] == 0
        assert same_output(flipped, stock_results["B"])
        assert "failed verification (checksum mismatch)" in log.read_text()
        again = run_e2e_sequence(server)
        for ours, name in zip(again, ("A", "B", "C", "A2")):
            assert same_output(ours, stock_results[name]), name
        # A2 found A's last corrupt blocks and recomputed them: their rewrite must land before the stop (SGLang's
        # SIGTERM ends the scheduler without waiting for the disk writes in flight, as a crash would).
        server.generate(prompt_ids(98, 8), max_new_tokens=1)
        observed.idle()

    # Restart on the same directory: the first repeat of a prompt is a disk hit.
    with start(model_dir, directory, tmp_path / "restart.log") as server:
        warm = server.generate(prompts["A"], max_new_tokens=8)
        assert warm["meta_info"]["cached_tokens_details"].get("storage", 0) > 0, warm["meta_info"]
        assert same_output(warm, stock_results["A2"])
    assert "restored" in (tmp_path / "restart.log").read_text()
