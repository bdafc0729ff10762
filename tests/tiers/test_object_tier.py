"""The object tier (KVBM's G4: object storage through NIXL's OBJ backend): two workers on one bucket.

The bucket is served by an S3 emulator (``moto``'s server, ``tests/harness/s3.py``)
on 127.0.0.1: real S3 cannot run here; every byte still goes through NIXL's
real OBJ plugin and the AWS SDK inside it. Each worker is SGLang's default
tree, pools and allocator with the kvbm linker (``conftest.build_stack``), the
tier turned on by KVBM's own variables. What worker A stores is written from
its host tier to the bucket; worker B, which never saw the prefix, finds it
there at lookup, reads it into verified staging and loads it byte for byte.
"""

from __future__ import annotations

import time

import pytest

from conftest import needs_nixl_1_3
from harness.disk import load_exact
from harness.s3 import ACCESS_KEY, REGION, SECRET_KEY, S3Server
from sglang_kvbm.config import ConfigError, KvbmConfig
from sglang_kvbm.integration.sglang.build import Identity

pytestmark = needs_nixl_1_3  # NIXL 1.5's OBJ writes to moto never finish here (conftest.NIXL_1_5)

TOKENS = list(range(500, 532))  # 8 pages of 4
BUCKET = "kv-cache"


@pytest.fixture
def s3(tmp_path):
    with S3Server(tmp_path) as server:
        server.create_bucket(BUCKET)
        yield server


def worker(stack_factory, s3, model="tiny-a", **config):
    settings = {"object_enabled": True, "object_bucket": BUCKET, "object_endpoint": s3.endpoint,
                "object_region": REGION, "object_access_key": ACCESS_KEY, "object_secret_key": SECRET_KEY, **config}
    return stack_factory(host_blocks=32, identity=Identity(model_path=model), config=settings)


def written(stack, n: int, timeout: float = 120.0) -> None:
    """Wait until ``n`` blocks were put to the bucket (the tier's thread writes; polls register them)."""
    tier = stack.manager.tiers["object"]
    deadline = time.monotonic() + timeout
    while stack.linker.connector.stats.offloaded("host", "object") < n:
        assert time.monotonic() < deadline, ("object writes did not finish", tier.stats)
        stack.settle()
        stack.manager.poll()
        stack.linker.connector.poll()
        time.sleep(0.05)


@pytest.mark.usefixtures("loads_wait_for_their_reads")
def test_a_prefix_stored_by_one_worker_loads_on_another_from_the_bucket(stack_factory, s3):
    a, b = worker(stack_factory, s3), worker(stack_factory, s3)
    pages = len(TOKENS) // a.page_size
    data = a.insert(TOKENS, seed=3)
    a.settle()
    written(a, pages)
    assert a.linker.connector.stats.offloaded("host", "object") == pages  # KVBM's offload_blocks_h2obj
    tier = a.manager.tiers["object"]
    assert sorted(s3.keys(BUCKET)) == sorted(tier.store.key(i) for i in a.block_ids(TOKENS))
    assert b.linker.connector.peek(b.block_ids(TOKENS)) == (0, 0)  # B holds nothing of it itself
    load_exact(b, TOKENS, data)
    stats = b.linker.connector.stats
    assert stats.onboard_blocks == {"object": pages} and stats.onboard_blocks_d2d == 0
    assert stats.hit_blocks == {"object": pages} and b.linker.connector.hit_rates.rates() == {"object": 1.0}
    assert b.manager.tiers["object"].stats["lookup_hits"] == pages  # KVBM's g4_lookup_hits


@pytest.mark.usefixtures("loads_wait_for_their_reads")
def test_another_identity_and_a_damaged_object_are_misses(stack_factory, s3):
    a = worker(stack_factory, s3)
    a.insert(TOKENS, seed=3)
    a.settle()
    written(a, len(TOKENS) // a.page_size)
    other = worker(stack_factory, s3, model="tiny-b")
    _, _, loaded, _, _ = other.admit(TOKENS + [1], "other")
    assert loaded == 0  # its keys carry another identity: none of them is in the bucket
    b = worker(stack_factory, s3)
    ids = b.block_ids(TOKENS)
    store = a.manager.tiers["object"].store
    s3.damage(BUCKET, store.key(ids[2]), bytes(store.slot_bytes))  # page 2 zeroed
    s3.damage(BUCKET, store.key(ids[5]), b"short")  # page 5 truncated
    req, _, loaded, slots, _ = b.admit(TOKENS + [1], "damaged")
    assert loaded == 2 * b.page_size  # pages 0 and 1; page 2 failed verification, the rest recomputes
    assert b.manager.tiers["object"].stats["rejected"] == 2  # both, proven by their header and checksum
    assert b.finish(req)
    b.allocator.free(slots)


def test_a_stopped_server_is_a_miss_and_never_a_stall(stack_factory, s3):
    a = worker(stack_factory, s3)
    a.insert(TOKENS, seed=3)
    a.settle()
    written(a, len(TOKENS) // a.page_size)
    b = worker(stack_factory, s3)
    s3.stop()
    waits = []
    for i in range(6):
        started = time.monotonic()
        _, _, loaded, _, _ = b.admit(TOKENS[: 4 * (i + 2)] + [1], f"r{i}")
        waits.append(time.monotonic() - started)
        assert loaded == 0
    tier = b.manager.tiers["object"]
    # The first lookup waits at most its budget (0.5 s: a refused connection fails in milliseconds with the
    # bounded retries), then the tier is down: no request, no wait. Bounds with room for a busy machine; a
    # stall would be the AWS SDK's default retries, 25 s per call.
    assert tier.store.down and tier.stats["down"] >= 1, tier.stats
    assert max(waits) < 5, waits
    assert sum(waits[2:]) < 2, waits
    a.insert(list(range(900, 932)), seed=4)  # writes while down are not queued: nothing piles up
    a.settle()
    assert b.manager.tiers["object"].ask(b.block_ids(TOKENS)) is None  # POST /tiers: null, not a hang


def test_an_endpoint_that_stops_answering_is_marked_down_by_the_heartbeat_and_up_when_it_answers(stack_factory, s3):
    """No lookup or write needed: the tier's heartbeat (a TCP connect to the endpoint about once a second) marks it
    down within seconds of the endpoint's loss, and up on its first answer."""
    tier = worker(stack_factory, s3).manager.tiers["object"]
    assert not tier.store.down and tier.stats["up"]
    s3.stop()
    lost = time.monotonic()
    while not tier.store.down:
        assert time.monotonic() - lost < 5, "not marked down 5 s after the endpoint was lost"
        time.sleep(0.05)
    assert not tier.stats["up"] and tier.stats["down"] == 1
    s3.start()  # the same address
    back = time.monotonic()
    while tier.store.down:
        assert time.monotonic() - back < 5, "not up 5 s after the endpoint answered again"
        time.sleep(0.05)
    assert tier.stats["up"]


@pytest.mark.usefixtures("loads_wait_for_their_reads")
def test_without_write_through_a_written_block_leaves_the_host_tier(stack_factory, s3):
    """DYN_KVBM_OBJECT_WRITE_THROUGH=0, as KVBM: once in the bucket, a block's host copy goes (and is announced
    gone); the next request for it reads it back from the bucket."""
    a = worker(stack_factory, s3, object_write_through=False)
    data = a.insert(TOKENS, seed=3)
    a.settle()
    pages = len(TOKENS) // a.page_size
    written(a, pages)
    a.linker.connector.poll()
    assert a.linker.connector.stats.removed_blocks["host"] == pages and len(a.manager.host) == 0
    a.evict_all()
    a.scramble_pool()
    load_exact(a, TOKENS, data)
    assert a.linker.connector.stats.onboard_blocks == {"object": pages}


def test_the_object_tier_is_configured_by_kvbms_variables():
    env = {"DYN_KVBM_CPU_CACHE_GB": "1", "DYN_KVBM_OBJECT_ENABLED": "1", "DYN_KVBM_OBJECT_BUCKET": "kv-{worker_id}",
           "DYN_KVBM_OBJECT_ENDPOINT": "http://127.0.0.1:9000/", "DYN_KVBM_OBJECT_NUM_BLOCKS": "500",
           "DYN_KVBM_OBJECT_WRITE_THROUGH": "0"}
    config = KvbmConfig.from_env(env)
    assert (config.object_enabled, config.object_bucket, config.object_endpoint) == (True, "kv-{worker_id}",
                                                                                     "http://127.0.0.1:9000")
    assert (config.object_num_blocks, config.object_write_through) == (500, False)
    assert KvbmConfig.from_env({"DYN_KVBM_CPU_CACHE_GB": "1"}).object_enabled is False  # KVBM's default: off
    with pytest.raises(ConfigError, match="DYN_KVBM_OBJECT_BUCKET is not set"):
        KvbmConfig.from_env({**env, "DYN_KVBM_OBJECT_BUCKET": ""})
    with pytest.raises(ConfigError, match="DYN_KVBM_OBJECT_BUCKET='Kv_Cache' is not an S3 bucket name"):
        KvbmConfig.from_env({**env, "DYN_KVBM_OBJECT_BUCKET": "Kv_Cache"})
    with pytest.raises(ConfigError, match="DYN_KVBM_OBJECT_ENDPOINT='127.0.0.1:9000' is not an http"):
        KvbmConfig.from_env({**env, "DYN_KVBM_OBJECT_ENDPOINT": "127.0.0.1:9000"})
    with pytest.raises(ConfigError, match="DYN_KVBM_OBJECT_ACCESS_KEY is set but DYN_KVBM_OBJECT_SECRET_KEY"):
        KvbmConfig.from_env({**env, "DYN_KVBM_OBJECT_ACCESS_KEY": "k"})
    with pytest.raises(ConfigError, match="needs a host tier"):
        KvbmConfig.from_env({**env, "DYN_KVBM_CPU_CACHE_GB": "", "DYN_KVBM_DISK_CACHE_GB": "1"})


def test_worker_id_names_each_rank():
    from sglang_kvbm.tiers.object.kind import worker_id

    ids = {worker_id({"dp_rank": d, "pp_rank": p, "tp_rank": t, "tp_size": 2, "pp_size": 2})
           for d in range(2) for p in range(2) for t in range(2)}
    assert ids == set(range(8))
