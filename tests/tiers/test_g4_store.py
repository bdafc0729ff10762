"""G4's object store on a real Mooncake Store: a ``mooncake_master`` and a standalone memory lender on 127.0.0.1.

Two workers are two ``MooncakeStore`` clients (Mooncake clients of their own; in one
process, which Mooncake treats like two). What one writes the other reads,
verified; another identity reads nothing; a damaged object is a miss; a master
lost mid-run turns every call into a miss within one call's timeout, then at
once, and never raises.
"""

from __future__ import annotations

import logging
import re
import time

import pytest
import torch

from harness.mooncake import MooncakeCluster
from sglang_kvbm.core.pages import one_page
from sglang_kvbm.tiers.mooncake import listeners
from sglang_kvbm.tiers.mooncake.store import MooncakeSettings, MooncakeStore, key_prefix, object_suffix
from sglang_kvbm.transfer.host_memory import aligned_empty

PAGE, BLOCK = 4, 8192
IDENTITY = bytes(range(16))


@pytest.fixture
def cluster(tmp_path):
    with MooncakeCluster(tmp_path) as c:
        yield c


class Worker:
    """One worker's G4 client with registered block rows and header rows (as the host slab and staging will be)."""

    def __init__(self, cluster, fingerprint=IDENTITY, rows=8, lend=0):
        settings = MooncakeSettings(cluster.master_address, cluster.metadata_url, segment_bytes=lend)
        self.store = MooncakeStore(settings, fingerprint=fingerprint, model_name="org/tiny", suffix="_0_k", page_size=PAGE,
                             block_bytes=BLOCK, retry_s=30.0)
        assert self.store.connect()
        self.rows = aligned_empty((rows, BLOCK))
        self.headers = aligned_empty((rows, self.store.header_bytes))
        self.store.register_dram(self.rows)
        self.store.register_dram(self.headers)

    def write(self, blocks: dict[str, int]) -> list[bool]:
        metas = []
        for i, (block_id, seed) in enumerate(blocks.items()):
            self.rows[i].copy_(torch.randint(0, 256, (BLOCK,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)))
            metas.append(one_page(block_id, tuple(range(seed, seed + PAGE)), event_hash=seed))
        return self.store.write(metas, list(self.rows[: len(metas)]), list(self.headers[: len(metas)]))

    def read(self, block_ids: list[str]):
        self.rows[: len(block_ids)].fill_(0)
        return self.store.read(block_ids, list(self.rows[: len(block_ids)]), list(self.headers[: len(block_ids)]))


def expected(seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (BLOCK,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def test_keys_are_sglang_hicache_keys_with_the_identity_in_the_tag():
    store = MooncakeStore(MooncakeSettings("127.0.0.1:1", "P2PHANDSHAKE"), fingerprint=IDENTITY, model_name="Qwen/Qwen3-0.6B",
                    suffix=object_suffix(1), page_size=PAGE, block_bytes=BLOCK)
    assert key_prefix("kvbm-x", "Qwen/Qwen3-0.6B") == "kvbm-x_Qwen-Qwen3-0.6B"  # SGLang's `config_prefix`
    assert store.key("ab" * 32) == f"kvbm-{IDENTITY.hex()[:16]}_Qwen-Qwen3-0.6B_{'ab' * 32}_1_k"
    assert store.tag == f"kvbm-{IDENTITY.hex()[:16]}"
    # SGLang's mha_suffix / mla_suffix (MooncakeStore): MLA's latent is one object for every TP rank
    assert [object_suffix(3), object_suffix(3, mla=True), object_suffix(1, pp_rank=2, pp_size=4),
            object_suffix(1, mla=True, pp_rank=2, pp_size=4)] == ["_3_k", "__k", "_1_2_k", "_2_k"]


def test_a_block_written_by_one_worker_is_read_verified_by_another_and_outlives_its_writer(cluster):
    a, b = Worker(cluster), Worker(cluster)
    assert a.write({"p0": 1, "p1": 2}) == [True, True]
    assert b.store.contains(["p0", "p1", "p2"]) == [True, True, False]
    metas = b.read(["p0", "p1"])
    assert [m.block_id for m in metas] == ["p0", "p1"] and metas[1].token_ids == (2, 3, 4, 5)
    assert torch.equal(b.rows[0], expected(1)) and torch.equal(b.rows[1], expected(2))
    a.store.close()  # the writer leaves: the standalone lender keeps what it wrote
    assert b.store.contains(["p0"]) == [True] and b.read(["p0"])[0] is not None


def test_another_identity_reads_nothing(cluster):
    Worker(cluster).write({"p0": 1})
    other = Worker(cluster, fingerprint=bytes(16))
    assert other.store.contains(["p0"]) == [False] and other.read(["p0"]) == [None]


def test_a_damaged_object_is_a_miss_and_a_missing_one_too(cluster):
    a, b = Worker(cluster), Worker(cluster)
    a.write({"p0": 1, "p1": 2})
    b.store._client.upsert(b.store.key("p0"), b"garbage" * 100)  # overwritten by something that is not a block
    b.store._client.upsert(b.store.key("p1"), bytes(b.store.header_bytes + BLOCK))  # the right size, no header
    assert b.read(["p0", "p1", "never-written"]) == [None, None, None]
    # the short one fails its transfer (a plain miss), the headerless one fails verification (rejected)
    assert b.store.stats["rejected"] == 1 and b.store.stats["misses"] == 3


def test_a_lost_master_turns_calls_into_misses_without_raising(cluster):
    a = Worker(cluster)
    a.write({"p0": 1})
    cluster.kill_master()
    started = time.monotonic()
    assert a.store.contains(["p0"]) == [False]
    assert a.read(["p0"]) == [None] and a.write({"p1": 2}) == [False]
    first = time.monotonic() - started
    started = time.monotonic()
    for _ in range(10):  # down: answered at once, no call to Mooncake
        assert a.store.contains(["p0"]) == [False]
    assert time.monotonic() - started < 0.05
    assert not a.store.available and a.store.stats["down"] == 1
    assert first < 20, f"the first calls after the loss took {first:.1f} s"


def test_a_write_goes_under_the_identity_it_names_and_a_closed_store_stays_closed(cluster):
    """MooncakeWrites names the identity a block was queued under: a re-key meanwhile does not move its object."""
    a, old, new = Worker(cluster), Worker(cluster), Worker(cluster, fingerprint=bytes(16))
    a.store.rekey(bytes(16))
    a.rows[0].copy_(expected(1))
    meta = one_page("p0", tuple(range(1, 1 + PAGE)), event_hash=1)
    assert a.store.write([meta], [a.rows[0]], [a.headers[0]], fingerprint=IDENTITY) == [True]
    assert a.store.contains(["p0"], IDENTITY) == [True] and a.store.contains(["p0"]) == [False]
    assert new.store.contains(["p0"]) == [False]
    assert old.read(["p0"])[0] is not None and torch.equal(old.rows[0], expected(1))  # named and signed as IDENTITY
    a.store.close()
    assert not a.store.connected and a.store.contains(["p0"], IDENTITY) == [False] and not a.store.connected


def test_connect_logs_the_listeners_the_client_opened_and_where(cluster, caplog):
    """Mooncake binds a client's two transfer listeners to every address: each connect says which they are."""
    caplog.set_level(logging.INFO, logger="sglang_kvbm.tiers.mooncake.store")
    before = listeners.own_listeners()
    worker = Worker(cluster)  # kept: a client dropped closes its listeners
    lines = [r.getMessage() for r in caplog.records if "G4 client listens on" in r.getMessage()]
    assert len(lines) == 1, lines
    found = re.fullmatch(r"kvbm: G4 client listens on 0\.0\.0\.0:(\d+) \(transfer RPC\) and \[::\]:(\d+) \(TCP data\), "
                         r"on every address; Mooncake cannot bind them to one address: firewall "
                         r"MC_MIN_RPC_PORT\.\.MC_MAX_RPC_PORT \(15000-17000\)", lines[0])
    assert found, lines[0]
    rpc, data = map(int, found.groups())
    assert all(15000 <= port <= 17000 for port in (rpc, data))
    assert listeners.own_listeners() - before == {listeners.Listener("0.0.0.0", rpc), listeners.Listener("::", data)}
    worker.store.close()


def test_connect_never_fails_for_its_log_line(cluster, caplog, monkeypatch):
    def broken():
        raise OSError("no /proc here")

    monkeypatch.setattr(listeners, "own_listeners", broken)
    caplog.set_level(logging.INFO, logger="sglang_kvbm.tiers.mooncake.store")
    worker = Worker(cluster)  # asserts connect() is True
    assert worker.write({"p0": 1}) == [True]
    assert not [r for r in caplog.records if "G4 client listens on" in r.getMessage()]


def test_a_lost_master_is_noticed_by_the_heartbeat_in_seconds_and_its_return_too(cluster):
    """No call has to wait out its limit: the heartbeat (a TCP connect about once a second) marks G4 down within
    about two seconds of losing the master, and up again on its first answer, with a restarted master."""
    a = Worker(cluster)
    a.store.start_heartbeat(interval=0.2)
    try:
        assert a.write({"p0": 1}) == [True] and not a.store.down
        cluster.kill_master()
        lost = time.monotonic()
        while not a.store.down:
            assert time.monotonic() - lost < 5, "G4 not marked down 5 s after its master was lost"
            time.sleep(0.05)
        noticed = time.monotonic() - lost
        assert a.store.stats["down"] == 1 and not a.store.available  # lookups and reads skip G4 at once
        beats, counted = a.store._heartbeat.beats, time.monotonic()
        while a.store._heartbeat.beats < beats + 3:  # three more beats, the master still lost
            assert time.monotonic() - counted < 10, "the heartbeat stopped beating while the master was lost"
            time.sleep(0.05)
        assert a.store.down and a.store.stats["down"] == 1  # still down: one window (one log line), not one a beat
        cluster.start_master()  # the same address: a master restarted after a crash
        back = time.monotonic()
        while a.store.down:
            assert time.monotonic() - back < 5, "G4 not up 5 s after its master answered again"
            time.sleep(0.05)
        print(f"\nmarked down {noticed:.2f} s after the master was lost, up {time.monotonic() - back:.2f} s after it "
              "came back")
    finally:
        a.store.close()
    assert not a.store.available  # closed: the heartbeat stopped, nothing reconnects
