"""End to end: stock SGLang on CPU with ``--radix-cache-backend kvbm``, against stock SGLang.

Two real servers with the locally generated model. The kvbm server's device
pool is too small for the workload, so the repeated prompt must come back from
the host tier; its greedy tokens and logprobs must equal the stock server's,
which serves the same prompt from its device cache (same KV bytes, same numbers).
"""

from __future__ import annotations

import json

import pytest
from sglang.srt.disaggregation.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

from conftest import run_e2e_sequence
from sglang_kvbm.integration.sglang.event_stream import replay
from sglang_kvbm.testing.model import prompt_ids
from sglang_kvbm.testing.server import SglangServer, free_port

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def kvbm_run(model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("kvbm") / "server.log"
    endpoint, replay_endpoint = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    events_config = {"publisher": "zmq", "endpoint": endpoint, "bind": True, "replay_endpoint": replay_endpoint}
    server = SglangServer(
        model_dir,
        max_total_tokens=1024,
        extra_args=["--radix-cache-backend", "kvbm", "--kv-events-config", json.dumps(events_config)],
        env={"DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": "2048"},
        log_path=log,
    )
    with server:
        results = run_e2e_sequence(server)
        # The last store's host copy completes after its request returned; the
        # idle scheduler publishes it. Ask the server for one more tiny request
        # so that completion has been drained before the replay.
        server.generate(prompt_ids(99, 8), max_new_tokens=1)
        batches = replay(replay_endpoint)
        yield results, batches, log.read_text()


def test_repeated_prompt_is_served_from_host(kvbm_run):
    results, _, log = kvbm_run
    final = results[-1]["meta_info"]
    assert final["cached_tokens_details"]["host"] > 0, final
    assert final["cached_tokens"] == 596
    assert "Tree cache initialized: source=registered('kvbm') impl=KvbmRadixCache" in log


def test_host_hit_output_equals_stock_device_hit(kvbm_run, stock_results):
    results, _, _ = kvbm_run
    stock_final = stock_results["A2"]
    assert stock_final["meta_info"]["cached_tokens_details"]["device"] == 596  # stock served it from device
    for ours, theirs in zip(results, [stock_results[n] for n in ("A", "B", "C", "A2")]):
        assert ours["output_ids"] == theirs["output_ids"]
        assert ours["meta_info"]["output_token_logprobs"] == theirs["meta_info"]["output_token_logprobs"]


def test_event_stream_carries_host_tier_in_order(kvbm_run):
    _, batches, _ = kvbm_run
    assert batches, "no KV events were published"
    seqs = [seq for seq, _ in batches]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    events = [event for _, batch in batches for event in batch.events]
    known: set[int] = set()
    stored = {"GPU": set(), "CPU_PINNED": set()}
    for event in events:
        if isinstance(event, BlockStored):
            assert event.parent_block_hash is None or event.parent_block_hash in known, "orphan store"
            assert event.block_size == 4 and len(event.token_ids) == 4 * len(event.block_hashes)
            known.update(event.block_hashes)
            stored[event.medium].update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            assert event.medium in ("GPU", "CPU_PINNED")
        else:
            assert isinstance(event, AllBlocksCleared)
    assert stored["CPU_PINNED"], "no host-tier stores"
    assert stored["CPU_PINNED"] <= stored["GPU"]  # a host block is a page the device stored first
    gpu_removed = {h for e in events if isinstance(e, BlockRemoved) and e.medium == "GPU" for h in e.block_hashes}
    assert gpu_removed & stored["CPU_PINNED"], "device evictions of pages the host still holds"
