"""G4 as a tier: two workers' tiers on one real Mooncake Store (master + standalone lender on 127.0.0.1).

Each worker is SGLang's default tree, pools and allocator with the kvbm linker
(``conftest.build_stack``), G4 on through the configuration. What worker A
stores is written through to G4 from its host tier; worker B, which never saw
the prefix, finds it there at lookup, fetches it into verified staging and
loads it byte for byte. A server of another identity finds nothing; a
damaged object is a miss that recomputes; a lost master makes lookups misses
without stalling them.
"""

from __future__ import annotations

import time

import pytest

from harness.disk import load_exact
from harness.mooncake import MooncakeCluster
from sglang_kvbm.config import ConfigError, KvbmConfig
from sglang_kvbm.integration.sglang.build import Identity

TOKENS = list(range(500, 532))  # 8 pages of 4


@pytest.fixture
def cluster(tmp_path):
    with MooncakeCluster(tmp_path) as c:
        yield c


def worker(stack_factory, cluster, model="tiny-a", config=None, **kwargs):
    config = {"mooncake_master": cluster.master_address, "mooncake_metadata": cluster.metadata_url, **(config or {})}
    return stack_factory(host_blocks=32, identity=Identity(model_path=model), config=config, **kwargs)


def g4_written(stack, n: int, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while stack.manager.tiers["mooncake"].writes.written < n:
        assert time.monotonic() < deadline, "G4 write-through did not finish"
        stack.settle()
        stack.manager.poll()
        time.sleep(0.05)


@pytest.mark.usefixtures("loads_wait_for_their_reads")
def test_a_prefix_stored_by_one_worker_loads_on_another_from_g4(stack_factory, cluster):
    a, b = worker(stack_factory, cluster), worker(stack_factory, cluster)
    written = a.insert(TOKENS, seed=3)
    a.settle()
    g4_written(a, len(TOKENS) // a.page_size)
    assert b.linker.connector.peek(b.block_ids(TOKENS)) == (0, 0)  # B holds nothing of it itself
    load_exact(b, TOKENS, written)
    pages = len(TOKENS) // b.page_size
    assert b.manager.tiers["mooncake"].staged == pages
    stats = b.linker.connector.stats
    # Counted under its own name, never as disk (KVBM's onboard_blocks_d2d): an operator sees what the shared tier serves
    assert stats.onboard_blocks == {"mooncake": pages} and stats.onboard_blocks_d2d == 0
    assert stats.hit_blocks == {"mooncake": pages} and b.linker.connector.hit_rates.rates() == {"mooncake": 1.0}
    assert b.manager.tiers["mooncake"].stats["lookup_hits"] == pages


@pytest.mark.usefixtures("loads_wait_for_their_reads")
def test_another_identity_and_a_damaged_object_are_misses(stack_factory, cluster):
    a = worker(stack_factory, cluster)
    a.insert(TOKENS, seed=3)
    a.settle()
    g4_written(a, len(TOKENS) // a.page_size)
    other = worker(stack_factory, cluster, model="tiny-b")
    _, match, loaded, slots, _ = other.admit(TOKENS + [1], "other")
    assert loaded == 0
    b = worker(stack_factory, cluster)
    ids = b.block_ids(TOKENS)
    client = a.manager.tiers["mooncake"].store._client
    damaged = a.manager.tiers["mooncake"].store.key(ids[2])
    client.upsert(damaged, bytes(a.manager.tiers["mooncake"].store.header_bytes + a.layout.block_bytes))  # page 2 zeroed
    req, match, loaded, slots, _ = b.admit(TOKENS + [1], "damaged")
    assert loaded == 2 * b.page_size  # pages 0 and 1; page 2 failed verification, the rest recomputes
    assert b.manager.tiers["mooncake"].store.stats["rejected"] == 1
    # and it is gone from the store (a put keeps an existing key: left there it would stay a miss for everyone)
    assert b.manager.tiers["mooncake"].store.stats["removed"] == 1 and client.is_exist(damaged) == 0
    assert b.finish(req)
    b.allocator.free(slots)


def test_a_lost_master_makes_lookups_misses_without_stalling_the_scheduler(stack_factory, cluster):
    a = worker(stack_factory, cluster)
    a.insert(TOKENS, seed=3)
    a.settle()
    g4_written(a, len(TOKENS) // a.page_size)
    b = worker(stack_factory, cluster)
    cluster.kill_master()
    waits = []
    for i in range(6):
        started = time.monotonic()
        _, match, loaded, slots, _ = b.admit(TOKENS[: 4 * (i + 2)] + [1], f"r{i}")
        waits.append(time.monotonic() - started)
        assert loaded == 0
    # The first waits at most its budget (0.5 s), then G4 is down: no Mooncake call, no wait. Bounds with
    # room for a busy machine; a stall on the lost master would be Mooncake's RPC timeout, seconds per call.
    assert b.manager.tiers["mooncake"].store.down and b.manager.tiers["mooncake"].store.stats["down"] >= 1, b.manager.tiers["mooncake"].store.stats
    assert max(waits) < 5, waits
    assert sum(waits[2:]) < 2, waits
    tier = b.manager.tiers["mooncake"]
    tier.store._down_until = 0.0  # its retry time over, as on a slow machine between two requests
    assert tier.ask([]) is None  # POST /tiers with nothing left to look up still says the master is gone


@pytest.mark.usefixtures("loads_wait_for_their_reads")
def test_with_the_frequency_filter_only_reused_blocks_are_shared(stack_factory, cluster):
    """SGLANG_KVBM_MOONCAKE_OFFLOAD_FILTER: KVBM's filter, as for disk: a one-shot prompt is not written to G4."""
    a = worker(stack_factory, cluster, config={"mooncake_offload_filter": True})
    written = a.insert(TOKENS, seed=3)
    a.settle()
    a.manager.poll()
    assert a.manager.tiers["mooncake"].writes.submitted == 0  # stored once: not shared
    a.evict_all()
    a.scramble_pool()
    load_exact(a, TOKENS, written)  # a host hit: reused
    g4_written(a, len(TOKENS) // a.page_size)
    b = worker(stack_factory, cluster)
    load_exact(b, TOKENS, written)


def test_g4_needs_a_host_tier_and_its_metadata_server():
    with pytest.raises(ConfigError, match="needs a host tier"):
        KvbmConfig(mooncake_master="127.0.0.1:50051", mooncake_metadata="http://x/metadata").require_a_tier()
    with pytest.raises(ConfigError, match="SGLANG_KVBM_MOONCAKE_METADATA"):
        KvbmConfig(cpu_cache_gb=1, mooncake_master="127.0.0.1:50051").require_a_tier()
    with pytest.raises(ConfigError, match="SGLANG_KVBM_MOONCAKE_MASTER='nohost' is not host:port"):
        KvbmConfig.from_env({"SGLANG_KVBM_MOONCAKE_MASTER": "nohost"})
