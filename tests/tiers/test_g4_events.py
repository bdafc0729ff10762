"""The master's KV events for Dynamo's router, from a real ``mooncake_master``, decoded as Dynamo decodes them.

Dynamo 1.6.1 (``kv_router/shared_cache.rs``) reads three frames: a topic, an
8-byte big-endian sequence (a gap clears what it knew) and msgpack
``(timestamp_ms, [{event_type, object_key, tenant_id, group_id}], dp_rank)``.
``test_dynamo_g4.py`` shows Dynamo's own router scoring these.
"""

from __future__ import annotations

import time

import msgspec
import pytest
import zmq

from harness.mooncake import MooncakeCluster
from sglang_kvbm.tiers.mooncake.events import EventRelay, announced

TAG = "kvbm-0123456789abcdef_org-tiny"
PAGE_HASH = "ab" * 32


def test_this_librarys_mha_objects_are_announced_with_their_v_twin():
    assert announced(f"{TAG}_{PAGE_HASH}_1_k") == [f"{TAG}_{PAGE_HASH}_1_k", f"{TAG}_{PAGE_HASH}_1_v"]
    assert announced(f"{TAG}_{PAGE_HASH}_1_0_k") == [f"{TAG}_{PAGE_HASH}_1_0_k", f"{TAG}_{PAGE_HASH}_1_0_v"]
    assert announced(f"{TAG}_{PAGE_HASH}__k") == [f"{TAG}_{PAGE_HASH}__k"]  # MLA: one name, as SGLang's
    assert announced(f"other_{PAGE_HASH}_0_k") == [f"other_{PAGE_HASH}_0_k"]  # a stock HiCache worker's: as is


class Subscriber:
    def __init__(self, endpoint):
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.SUB)
        self.socket.setsockopt(zmq.SUBSCRIBE, b"")
        self.socket.connect(endpoint)
        self.held: set[str] = set()
        self.sequences: list[int] = []

    def drain(self, relay, until, timeout=60.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            relay.poll()
            while self.socket.poll(50):
                topic, sequence, payload = self.socket.recv_multipart()
                assert len(sequence) == 8
                self.sequences.append(int.from_bytes(sequence, "big"))
                ts_ms, events, dp_rank = msgspec.msgpack.decode(payload)
                assert abs(ts_ms / 1000 - time.time()) < 60 and dp_rank == 0
                for event in events:
                    assert event["tenant_id"] == "default"
                    (self.held.add if event["event_type"] == "stored" else self.held.discard)(event["object_key"])
            if until(self.held):
                return self.held
        raise AssertionError(f"held {sorted(self.held)}")

    def close(self):
        self.socket.close(0)
        self.context.term()


@pytest.fixture
def cluster(tmp_path):
    with MooncakeCluster(tmp_path) as c:
        yield c


def test_relay_publishes_what_the_master_holds_and_tells_late_subscribers_everything(cluster):
    from mooncake.store import MooncakeDistributedStore

    client = MooncakeDistributedStore()
    assert client.setup("127.0.0.1", cluster.metadata_url, 0, 16 << 20, "tcp", "", cluster.master_address) == 0
    relay = EventRelay(f"http://127.0.0.1:{cluster.admin_port}", "tcp://127.0.0.1:*", interval=0.1)
    first = Subscriber(relay.endpoint)
    try:
        ours, stock = f"{TAG}_{PAGE_HASH}_0_k", f"sglang_model_{PAGE_HASH}_0_k"
        for key in (ours, stock):
            assert client.put(key, b"x" * 4096) == 0
        want = {ours, ours[:-1] + "v", stock}
        assert first.drain(relay, lambda held: held == want) == want

        late = Subscriber(relay.endpoint)  # a router that connects after the fact
        assert late.drain(relay, lambda held: held == want) == want

        assert client.remove(stock) == 0
        for sub in (first, late):
            assert sub.drain(relay, lambda held: held == {ours, ours[:-1] + "v"}) == {ours, ours[:-1] + "v"}
        # one sequence for every subscriber, no gap (Dynamo forgets everything at a gap)
        assert first.sequences == list(range(first.sequences[0], first.sequences[0] + len(first.sequences)))
        late.close()
    finally:
        first.close()
        relay.close()
        client.close()


def test_relay_survives_the_master_going_away(cluster):
    relay = EventRelay(f"http://127.0.0.1:{cluster.admin_port}", "tcp://127.0.0.1:*", interval=0.1)
    try:
        assert relay.poll()
        cluster.kill_master()
        assert not relay.poll() and relay.stats["poll_errors"] == 1
    finally:
        relay.close()


def test_the_worker_registers_the_names_its_ranks_write():
    from types import SimpleNamespace

    from sglang_kvbm.integration.dynamo.mooncake import registration
    from sglang_kvbm.integration.sglang.l3_layout import layout
    from sglang_kvbm.tiers.mooncake.store import MooncakeSettings, MooncakeStore, object_suffix

    g4 = MooncakeStore(MooncakeSettings("127.0.0.1:1", "P2PHANDSHAKE"), fingerprint=bytes(range(32)), model_name="org/tiny",
                 suffix=object_suffix(0), page_size=4, block_bytes=64)
    mha = layout(g4, page_size=4, tp_size=2, pp_size=1, mla=False)
    assert mha["hicache_object_layout"]["pools"] == [{"suffixes": ["_0_k", "_1_k"], "hit_policy": "all_pages"}]
    assert layout(g4, page_size=4, tp_size=2, pp_size=1, mla=True)["hicache_object_layout"]["pools"][0]["suffixes"] == ["__k"]
    data = registration(mha, SimpleNamespace(tp_size=2, pp_size=1), eagle=False)
    # Dynamo 1.6.1 derives `{key_prefix}_{page hash}_{rank}_k` and `_v` from these (test_dynamo_g4.py: it does)
    assert data["key_prefix"] == g4.prefix == f"{g4.tag}_org-tiny" and data["extra_backend_tag"] == g4.tag
    assert (data["backend"], data["page_size"], data["tp_size"], data["is_mla_model"]) == ("mooncake", 4, 2, False)
    assert registration({"enabled": False, "reason": "Hierarchical cache is disabled"}, None, eagle=False) is None
