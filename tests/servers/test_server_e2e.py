"""End to end: stock SGLang on CPU with ``--radix-cache-backend kvbm``, against stock SGLang.

Two real servers with the locally generated model. The kvbm server's device
pool is too small for the workload, so the repeated prompt must come back from
the host tier; its greedy tokens must equal the stock server's, which serves the
same prompt from its device cache, and its logprobs agree to within float noise
(conftest.LOGPROB_TOLERANCE says why not to the bit).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import zmq
from sglang.srt.disaggregation.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

from conftest import run_e2e_sequence, same_output
from sglang_kvbm.integration.sglang.event_stream import replay, subscribe
from sglang_kvbm.ops.demo.model import prompt_ids
from sglang_kvbm.ops.demo.server import SglangServer, free_port

pytestmark = pytest.mark.server
HOLD = 3.0  # seconds each layer after the first of a layer-wise load is held back


@pytest.fixture(scope="module")
def kvbm_run(model_dir, tmp_path_factory):
    """One kvbm server through the end-to-end sequence, with its events (live, replayed, through the CLI)
    and its layer-wise load held back: every layer after the first is copied HOLD seconds late."""
    scratch = tmp_path_factory.mktemp("kvbm")
    log, layers = scratch / "server.log", scratch / "layers.txt"
    endpoint, replay_endpoint = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    events_config = {"publisher": "zmq", "endpoint": endpoint, "bind": True, "replay_endpoint": replay_endpoint}
    server = SglangServer(
        model_dir,
        max_total_tokens=1024,
        extra_args=["--radix-cache-backend", "kvbm", "--kv-events-config", json.dumps(events_config)],
        env={
            "DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": "2048",
            "PYTHONPATH": str(Path(__file__).parent / "layer_hold"),
            "KVBM_TEST_HOLD_LAYERS": str(HOLD),
            "KVBM_TEST_RECORD": str(layers),
        },
        log_path=log,
    )
    with server:
        # A subscriber that never reads (receive buffer of one message): it must not slow anything.
        stalled = zmq.Context.instance().socket(zmq.SUB)
        stalled.setsockopt(zmq.RCVHWM, 1)
        stalled.setsockopt(zmq.SUBSCRIBE, b"")
        stalled.connect(endpoint)
        live: list = []
        failed: list = []  # what stopped the listener early, if anything did
        stop = threading.Event()

        def listen():
            try:
                live.extend(subscribe(endpoint, stop=stop.is_set))
            except BaseException as exc:  # noqa: BLE001 - reported by test_live_stream_equals_replay
                failed.append(repr(exc))

        listener = threading.Thread(target=listen, daemon=True)
        listener.start()
        # A subscription takes effect some time after the connect (ZMQ's slow joiner; seconds on a loaded
        # machine): tiny requests of their own until the listener has seen a batch, so the sequence is all live.
        for seed in range(200, 230):
            server.generate(prompt_ids(seed, 8), max_new_tokens=1)
            if live or not listener.is_alive() or _wait_for(lambda: bool(live), 2.0):
                break
        results = run_e2e_sequence(server)
        # The last store's host copy completes after its request returned; the
        # idle scheduler publishes it. Ask the server for one more tiny request
        # so that completion has been drained before the replay.
        server.generate(prompt_ids(99, 8), max_new_tokens=1)
        stop.set()
        listener.join(timeout=30)
        batches = replay(replay_endpoint)  # after the listener stopped: everything it saw is in here
        stalled.close(linger=0)
        cli = subprocess.run(
            [sys.executable, "-m", "sglang_kvbm.ops.cli", "events", endpoint, "--replay", replay_endpoint, "--seconds", "1"],
            capture_output=True, text=True, timeout=120,
        )
        yield SimpleNamespace(results=results, batches=batches, log=log.read_text(), live=live, failed=failed, cli=cli,
                              layers=[line.split() for line in layers.read_text().splitlines()])


def _wait_for(condition, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_repeated_prompt_is_served_from_host(kvbm_run):
    final = kvbm_run.results[-1]["meta_info"]
    assert final["cached_tokens_details"]["host"] > 0, final
    assert final["cached_tokens"] == 596
    # The flag became SGLang's linker on its default tree, and the scheduler drove it.
    assert "Tree cache initialized: source=default impl=UnifiedRadixCache" in kvbm_run.log
    assert "'unified_cache_external_linker_config': {'linker': 'KvbmLinker'" in kvbm_run.log
    assert "'radix_cache_backend': None" in kvbm_run.log


def test_host_hit_output_equals_stock_device_hit(kvbm_run, stock_results):
    """With its later layers held back, the load still gives stock's output."""
    stock_final = stock_results["A2"]
    assert stock_final["meta_info"]["cached_tokens_details"]["device"] == 596  # stock served it from device
    for ours, theirs in zip(kvbm_run.results, [stock_results[n] for n in ("A", "B", "C", "A2")]):
        assert same_output(ours, theirs), (ours["meta_info"]["output_token_logprobs"],
                                           theirs["meta_info"]["output_token_logprobs"])


def test_event_stream_carries_host_tier_in_order(kvbm_run):
    batches = kvbm_run.batches
    assert batches, "no KV events were published"
    assert all(batch.attn_dp_rank == 0 for _, batch in batches)
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


def test_live_stream_equals_replay(kvbm_run):
    batches, live = kvbm_run.batches, kvbm_run.live
    assert not kvbm_run.failed, kvbm_run.failed
    assert live, "the live subscriber received nothing"
    replayed = dict(batches)
    for seq, batch in live:  # what the live subscriber got is exactly what replay returns for that seq
        assert seq in replayed
        assert batch.events == replayed[seq].events


def test_events_cli_prints_decoded_events_and_tier_counts(kvbm_run):
    cli = kvbm_run.cli
    assert cli.returncode == 0, cli.stderr
    assert "stored  CPU_PINNED" in cli.stdout and "stored  GPU" in cli.stdout
    final = [line for line in cli.stdout.splitlines() if line.startswith("final:")][-1]
    assert "CPU_PINNED=" in final and "GPU=" in final and "0 gaps" in final


def test_the_forward_waits_per_layer_while_later_layers_are_held_back(kvbm_run):
    """The load of the repeated prompt copies layer 0 at once and holds layer 1 back: the forward
    computes layer 0, then waits on layer 1 only, until it has landed.

    Told by the order of the recorded times, not by how long a wait took: on a busy machine the loader
    may reach layer 0 late (CI once saw 1.2 s), and that says nothing about per-layer waiting."""
    lines = kvbm_run.layers
    copies = {int(layer): float(t) for kind, layer, t, *_ in lines if kind == "copy"}
    waits: dict[int, list[tuple[float, float]]] = {}  # the forward asks once per K and once per V buffer of a layer
    for kind, layer, *times in lines:
        if kind == "wait":
            start, end = map(float, times)
            waits.setdefault(int(layer), []).append((start, end))
    assert set(copies) == {0, 1} and set(waits) == {0, 1}, lines
    assert max(end for _, end in waits[0]) < copies[1]  # the forward was past layer 0 before layer 1 had landed
    start, end = min(waits[1])
    assert start < copies[1] <= end, lines  # and then waited for layer 1 itself, until it landed
