"""Dynamo's real indexer, fed a hybrid worker's KV events, predicts the hit each tier then serves.

The worker is SGLang's own hybrid pools and default tree with the kvbm linker
(``harness.hybrid``, in process: see ``test_hybrid_swa`` / ``test_hybrid_mamba`` for
why no real server); its events (the tree's ``GPU`` ones and the tiers'
``CPU_PINNED``/``DISK`` ones, as one stream) go out through SGLang's own ZMQ
publisher to ``python -m dynamo.indexer``. The prediction is for the prompts the
tiers stored whole (a conversation's next turn): sidecar state exists at node
ends, which is where such a request's prefix ends.
"""

from __future__ import annotations

import time

import pytest

# SGLang's sliding-window, Mamba and draft-KV pools as a hybrid model's scheduler builds them, through 0.5.23's linker
# factory: SWA on 0.5.22 is tested on real servers only (make compat); 0.5.21 refuses them at start-up (compat).
pytest.importorskip("sglang.srt.mem_cache.unified_cache.linker_factory", reason="SGLang before 0.5.23 builds these "
                    "hybrid pools without a linker factory (compat refuses or serves them; see test_startup_refusals)")
from sglang.srt.disaggregation.kv_events import KVEventBatch, ZmqEventPublisher

from harness.hybrid import admit, build
from harness.indexer import DynamoIndexer
from sglang_kvbm.ops.demo.server import free_port

# loads must land whatever the machine is doing (not this file's subject: test_disk_lanes.py tests the budget)
pytestmark = pytest.mark.usefixtures("loads_wait_for_their_reads")


PAGE = 4
PAGES = 5


def publish(h, publisher) -> None:
    events = h.cache.take_events()
    if events:
        publisher.publish(KVEventBatch(ts=time.time(), events=events))


def predicted(indexer, tokens, publisher, timeout: float = 120.0) -> dict:
    """The indexer's per-medium matched tokens for worker 1, once it caught up with the stream.

    ZMQ drops what a publisher sends before a subscriber has joined, and a busy machine can take a
    while to connect the indexer's: each poll publishes an empty batch, whose sequence number shows
    the indexer what it missed, which it then asks the replay endpoint for.
    """
    deadline = time.monotonic() + timeout
    while True:
        seen = indexer.query(tokens).get("1", {})
        got = {tier: seen.get(tier, 0) for tier in ("gpu", "cpu", "disk")}
        if got["gpu"] == 0 and (got["cpu"] or got["disk"]) or time.monotonic() > deadline:
            return got
        publisher.publish(KVEventBatch(ts=time.time(), events=[]))
        time.sleep(0.25)  # the indexer applies events on its own threads: nothing to wait on but time


@pytest.mark.parametrize("kind,tier", [("swa", "host"), ("mamba", "host"), ("swa", "disk"), ("mamba", "disk")])
def test_indexer_predicts_the_tier_hit_a_hybrid_worker_serves(tmp_path, kind, tier):
    h = build(kind, tmp_path, page_size=PAGE, window=2 * PAGE + 1, events=True,
              host_blocks=0 if tier == "disk" else 256, disk_blocks=256 if tier == "disk" else 0)
    endpoint, replay_endpoint = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    publisher = ZmqEventPublisher(attn_dp_rank=0, endpoint=endpoint, bind=True, replay_endpoint=replay_endpoint,
                                  buffer_steps=10_000)
    try:
        with DynamoIndexer(log_path=tmp_path / "indexer.log") as indexer:
            indexer.register(1, endpoint, replay_endpoint, PAGE)
            tokens = list(range(3000, 3000 + PAGES * PAGE + 1))
            admit(h, tokens)
            h.evict_device()
            publish(h, publisher)
            seen = predicted(indexer, tokens, publisher)
            served = admit(h, tokens, compute=False)
            assert served.device_tokens == 0 and served.loaded_tokens == PAGES * PAGE
            # the indexer counts tokens matched in that medium or any above it, as the worker's POST /tiers does
            assert seen == {"gpu": 0, "cpu": PAGES * PAGE if tier == "host" else 0, "disk": PAGES * PAGE}, seen
            assert tuple(h.linker.tier_tokens(tokens).counts().values()) == (0, seen["cpu"], seen["disk"])  # POST /tiers
    finally:
        publisher.shutdown()
