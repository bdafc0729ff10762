"""End to end with the disk tier: a real CPU server whose host tier is smaller than the working set.

Repeated prompts are served from disk with the stock server's exact output;
faults injected into the cache files on disk turn into recomputation with the
same exact output; a restart on the same directory serves from disk again, one
with another page size loads nothing.
"""

from __future__ import annotations

import os

import pytest

from conftest import e2e_prompts, run_e2e_sequence
from sglang_kvbm.testing.server import SglangServer

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


def start(model_dir, directory, log, page_size=4):
    return SglangServer(
        model_dir,
        page_size=page_size,
        max_total_tokens=1024,
        extra_args=["--radix-cache-backend", "kvbm"],
        env=disk_env(directory),
        log_path=log,
    )


def same_output(ours, theirs):
    return (
        ours["output_ids"] == theirs["output_ids"]
        and ours["meta_info"]["output_token_logprobs"] == theirs["meta_info"]["output_token_logprobs"]
    )


def segment(directory):
    (cache,) = [p for p in directory.iterdir() if p.name.startswith("sglang-kvbm-")]
    return cache / "seg-0000.kv"


def corrupt_every_block(path):
    slots = os.path.getsize(path) // (HEADER + BLOCK)
    with open(path, "r+b") as f:
        for slot in range(slots):
            f.seek(slot * (HEADER + BLOCK) + HEADER + 123)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x40]))


def test_disk_hits_faults_and_restart(model_dir, stock_results, tmp_path):
    directory = tmp_path / "kvbm-disk"
    log = tmp_path / "server.log"
    prompts = e2e_prompts()

    with start(model_dir, directory, log) as server:
        results = run_e2e_sequence(server)
        details = results[-1]["meta_info"]["cached_tokens_details"]
        assert details.get("storage", 0) > 0 and details["storage"] + details["host"] == 596, details
        for ours, name in zip(results, ("A", "B", "C", "A2")):
            assert same_output(ours, stock_results[name]), name

        # A bit flipped in every block on disk: the next disk hit is refused and recomputed.
        corrupt_every_block(segment(directory))
        flipped = server.generate(prompts["B"], max_new_tokens=8)
        assert flipped["meta_info"]["cached_tokens"] == 0
        assert same_output(flipped, stock_results["B"])
        assert "failed verification (checksum mismatch)" in log.read_text()

        # The segment file deleted under the server: recreated, the hit is a miss, service goes on.
        server.generate(prompts["A"], max_new_tokens=8)  # A back on disk (filter off)
        server.generate(prompts["C"], max_new_tokens=8)
        segment(directory).unlink()
        deleted = server.generate(prompts["B"], max_new_tokens=8)
        assert same_output(deleted, stock_results["B"])
        assert "recreated it empty" in log.read_text()
        again = run_e2e_sequence(server)
        for ours, name in zip(again, ("A", "B", "C", "A2")):
            assert same_output(ours, stock_results[name]), name

    # Restart on the same directory: the first repeat of a prompt is a disk hit.
    with start(model_dir, directory, tmp_path / "restart.log") as server:
        warm = server.generate(prompts["A"], max_new_tokens=8)
        assert warm["meta_info"]["cached_tokens_details"].get("storage", 0) > 0, warm["meta_info"]
        assert same_output(warm, stock_results["A2"])
    assert "restored" in (tmp_path / "restart.log").read_text()

    # Another page size is another identity: nothing is loaded, the old directory is reclaimed.
    with start(model_dir, directory, tmp_path / "page8.log", page_size=8) as server:
        cold = server.generate(prompts["A"], max_new_tokens=8)
        assert cold["meta_info"]["cached_tokens"] == 0
        assert same_output(cold, stock_results["A"])
    assert "reclaimed" in (tmp_path / "page8.log").read_text()
