"""G4 write-through under resets, re-keys and faults: a local manager (real host rows, a real disk tier, the real
G4 thread) over a real Mooncake Store (``mooncake_master`` and a standalone lender on 127.0.0.1).

A write reads its host row only while the row is pinned for it, and is dropped if a reset or a re-key happened
after it was queued: what G4 holds under a block's name is that block's bytes, under the identity that computed
them. The queue is bounded. Blocks G4 lost to a master restart are written again when they are reused; offers
made while G4 is down, and failed writes, are retried a bounded number of times.

The G4 thread is held in place by a job of the test's (:func:`hold`), so "a write is queued" is a state, not a
race; no assertion is about time.
"""

from __future__ import annotations

import hashlib
import threading
import time
from concurrent.futures import wait

import pytest
import torch

from harness.mooncake import MooncakeCluster
from sglang_kvbm.core.pages import one_page
from sglang_kvbm.core.ports import StoreRequest
from sglang_kvbm.manager.block_manager import LocalBlockManager
from sglang_kvbm.tiers.disk.setup import probe
from sglang_kvbm.tiers.disk.store import DiskStore
from sglang_kvbm.tiers.disk.tier import DiskTier
from sglang_kvbm.tiers.mooncake.store import MooncakeSettings, MooncakeStore
from sglang_kvbm.tiers.mooncake.tier import MooncakeTier
from sglang_kvbm.transfer import copies
from sglang_kvbm.transfer.host_memory import aligned_empty
from sglang_kvbm.transfer.kv_layout import PagedKvLayout

PAGE, PAGES = 4, 16
IDENTITY, REKEYED = bytes(range(16)), bytes(range(16, 32))



def bid(name: str) -> str:
    """A block id as SGLang makes them (a hex sha256 digest), named for the test."""
    return hashlib.sha256(name.encode()).hexdigest()


@pytest.fixture
def cluster(tmp_path):
    with MooncakeCluster(tmp_path) as c:
        yield c


@pytest.fixture
def managers():
    made = []
    yield made
    for manager in made:
        manager.close()


def g4_store(cluster, layout, fingerprint=IDENTITY, retry_s=0.5) -> MooncakeStore:
    return MooncakeStore(MooncakeSettings(cluster.master_address, cluster.metadata_url), fingerprint=fingerprint,
                   model_name="org/tiny", suffix="_0_k", page_size=PAGE, block_bytes=layout.block_bytes,
                   retry_s=retry_s)


def make(managers, cluster, tmp_path, *, host_blocks=2, disk=True, retry_s=0.5) -> LocalBlockManager:
    layout = PagedKvLayout([torch.zeros(PAGES * PAGE, 2, 8) for _ in range(2)], PAGE)
    tiers = []
    if disk:
        found = probe(tmp_path / "disk", 1 << 24, zerofill_fallback=True, disable_o_direct=False)
        store = DiskStore(probe=found, num_slots=16, block_bytes=layout.block_bytes, fingerprint=b"d" * 16,
                          page_size=PAGE)
        tiers.append(lambda m: DiskTier(store, m.host, generation=m.generation, observe=m.observe))
    g4 = g4_store(cluster, layout, retry_s=retry_s)
    tiers.append(lambda m: MooncakeTier(g4, m.host, m.generation))
    manager = LocalBlockManager(layout, host_blocks, tiers=tiers)
    managers.append(manager)
    return manager


class Reader:
    """Another worker's G4 client: what G4 holds under a block's name, verified."""

    def __init__(self, cluster, layout, fingerprint=IDENTITY):
        self.store = g4_store(cluster, layout, fingerprint)
        assert self.store.connect()
        self.rows = aligned_empty((1, layout.block_bytes))
        self.headers = aligned_empty((1, self.store.header_bytes))
        self.store.register_dram(self.rows)
        self.store.register_dram(self.headers)

    def get(self, block_id):
        """The block's bytes as G4 serves them (None: a miss)."""
        meta = self.store.read([block_id], [self.rows[0]], [self.headers[0]])[0]
        return None if meta is None else self.rows[0].clone()

    def close(self):
        self.store.close()


def store(manager, block_id: str, page: int, seed: int) -> torch.Tensor:
    """Write random KV into device ``page``, store it as block ``block_id`` into a host row, poll it registered
    (which queues its G4 write and its disk write); returns the block's bytes as its host row holds them."""
    layout = manager.layout
    layout.write_page(page, torch.randint(0, 256, (layout.page_bytes,), dtype=torch.uint8,
                                          generator=torch.Generator().manual_seed(seed)))
    meta = one_page(block_id, tuple(range(seed, seed + PAGE)))
    manager.store(StoreRequest((block_id,), torch.arange(page * PAGE, (page + 1) * PAGE), lambda positions: [meta]))
    wait(manager.offloads.futures())
    manager.poll()
    assert manager.host.registered(block_id)
    return manager.host.slab[manager.host.rows([block_id])[0]].clone()


def hold(manager) -> threading.Event:
    """Occupy the G4 thread until the returned event is set: writes queued meanwhile wait behind it."""
    started, gate = threading.Event(), threading.Event()
    manager.tiers["mooncake"]._lane.submit_urgent(lambda: (started.set(), gate.wait(120)))
    assert started.wait(60)
    return gate


def g4_idle(manager) -> None:
    """Every G4 write queued so far done, and collected."""
    wait(manager.tiers["mooncake"].writes.futures())
    manager.poll()


def until(condition, manager, what: str, timeout: float = 90.0) -> None:
    """Poll the manager (as the scheduler does) until ``condition()``; a guard against a hang, not a timing."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        manager.poll()
        time.sleep(0.05)


def reuse(manager, block_ids) -> None:
    """A host hit on these blocks, loaded to the device and released (what offers a reused block again)."""
    plan = manager.acquire(block_ids)
    assert plan is not None and len(plan.host_ids) == len(block_ids)
    pages = torch.arange(PAGES - 1, PAGES - 1 - len(block_ids), -1)
    batch = copies.load_batch(manager.layout, manager.load_parts(plan, manager.layout.pages_of(
        torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in pages.tolist()]))))
    for layer in range(manager.layout.num_layers):
        copies.load_layer(manager.layout, batch, layer)
    manager.release(plan)


# -- wrong bytes: both fail on the code before issue 27 -------------------------------------------------


def test_a_row_released_by_the_disk_write_is_not_reused_under_a_pending_g4_write(managers, cluster, tmp_path):
    """Block X's row is pinned by its disk write and its G4 write; a reset orphans it; the disk write ends first.
    Before: the row was freed then, block Y landed in it, and the G4 write put Y's bytes under X's name."""
    manager = make(managers, cluster, tmp_path)
    reader = Reader(cluster, manager.layout)
    gate = hold(manager)
    x = store(manager, bid("x"), page=0, seed=1)
    assert manager.tiers["mooncake"].writes.futures() and manager.tiers["disk"].in_flight()  # X's G4 write and disk write are queued
    wait(manager.tiers["disk"].in_flight())  # the disk write is done; the G4 write waits
    manager.reset()  # the engine cleared its cache while X's writes were in flight
    manager.poll()  # the disk write's completion: it gives back its hold on X's row
    y = store(manager, bid("y"), page=1, seed=2)
    assert not torch.equal(x, y)
    gate.set()
    g4_idle(manager)
    served = reader.get(bid("x"))
    assert served is None or torch.equal(served, x), "G4 serves another block's bytes under block-x"
    assert manager.host.accounting()["orphaned"] == 0  # every row came back once its last holder ended
    reader.close()


@pytest.mark.parametrize("dropped", [True, False], ids=["weights-replaced", "rekey-only"])
def test_a_write_queued_before_a_rekey_never_publishes_under_the_new_identity(managers, cluster, tmp_path, dropped):
    """``weight_updates.weights_replaced``: the tiers dropped, G4 re-keyed, what it knows forgotten. A write queued
    before (the quiesce timed out) put the old weights' KV under the new identity."""
    manager = make(managers, cluster, tmp_path, disk=False)
    new_identity = Reader(cluster, manager.layout, fingerprint=REKEYED)
    gate = hold(manager)
    store(manager, bid("x"), page=0, seed=1)
    if dropped:
        manager.drop()
    manager.tiers["mooncake"].store.rekey(REKEYED)
    manager.tiers["mooncake"].writes.forget()
    gate.set()
    g4_idle(manager)
    assert new_identity.store.contains([bid("x")]) == [False], "the old weights' KV published under the new identity"
    assert manager.host.accounting()["pinned"] == 0 and manager.tiers["mooncake"].store.stats["write_stale"] == 1
    new_identity.close()


# -- the queue's bound ----------------------------------------------------------------------------------


def test_a_full_g4_queue_defers_offers_unpinned_and_counts_them(managers, cluster, tmp_path):
    """A backlog holds no more rows than the queue's bound: the rest wait unpinned and are written as room frees
    (a request's whole prefix reaches G4 even when it has more pages than the queue holds)."""
    manager = make(managers, cluster, tmp_path, host_blocks=8, disk=False)
    manager.tiers["mooncake"].writes.queue_blocks = 2
    gate = hold(manager)
    for i in range(4):
        store(manager, bid(str(i)), page=i, seed=i)
    assert manager.tiers["mooncake"].writes.queued == 2  # two blocks wait with their rows pinned; two wait unpinned
    assert manager.host.accounting()["pinned"] == 2
    assert manager.tiers["mooncake"].store.stats["write_queue_full"] == 2
    gate.set()
    until(lambda: manager.tiers["mooncake"].writes.written == 4, manager, "the deferred blocks were not written")
    g4_idle(manager)
    assert manager.tiers["mooncake"].writes.queued == 0 and manager.host.accounting()["pinned"] == 0
    assert manager.tiers["mooncake"].store.stats["write_gave_up"] == 0


# -- faults ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("noticed", ["failed-call", "recheck-interval"])
def test_blocks_lost_to_a_master_restart_are_written_again_when_reused(managers, cluster, tmp_path, noticed):
    """The store noticed the restart (its first call after one fails), or it did not (a client that lends memory
    reconnects by itself) and the blocks were seen in G4 longer than ``recheck_s`` ago (0 here)."""
    manager = make(managers, cluster, tmp_path, host_blocks=8, disk=False)
    ids = [bid(str(i)) for i in range(3)]
    written = [store(manager, b, page=i, seed=i) for i, b in enumerate(ids)]
    until(lambda: manager.tiers["mooncake"].writes.written == 3, manager, "write-through")
    cluster.kill_master()
    cluster.start_master()  # every object is gone; the lender mounts its memory again
    until(lambda: cluster.capacity() > 0, manager, "the lender's remount")
    reader = Reader(cluster, manager.layout)
    assert reader.store.contains(ids) == [False] * 3
    if noticed == "failed-call":  # e.g. a lookup's fetch: Mooncake fails the first call after a restart
        assert manager.tiers["mooncake"]._lane.submit(manager.tiers["mooncake"].store.contains, ["another"]).result() == [False]
        assert manager.tiers["mooncake"].store.stats["down"] == 1
    else:
        manager.tiers["mooncake"].writes.recheck_s = 0
    reuse(manager, ids)  # what this worker believes G4 holds is reused: checked, and written again
    until(lambda: reader.store.contains(ids) == [True] * 3, manager, "the lost blocks were not written again")
    g4_idle(manager)
    assert [torch.equal(reader.get(b), w) for b, w in zip(ids, written)] == [True] * 3
    assert manager.tiers["mooncake"].store.stats["rewritten"] == 3, manager.tiers["mooncake"].store.stats
    reader.close()


def test_offers_made_while_g4_is_down_are_written_once_it_is_back(managers, cluster, tmp_path):
    manager = make(managers, cluster, tmp_path, host_blocks=8, disk=False, retry_s=60.0)  # not by the clock here
    cluster.kill_master()
    manager.tiers["mooncake"]._lane.submit(manager.tiers["mooncake"].store.contains, ["anything"]).result()  # a failed call: G4 is marked down
    assert manager.tiers["mooncake"].store.down
    written = store(manager, bid("x"), page=0, seed=1)
    assert manager.tiers["mooncake"].writes.submitted == 0  # not attempted while down
    cluster.start_master()
    # The lender remounts its memory a moment after the master is back; a write before that fails for want of
    # space and would wait out the retry interval (60 s here): G4 comes back for this client once it can hold one.
    until(lambda: cluster.capacity() > 0, manager, "the lender's remount")
    manager.tiers["mooncake"].store._down_until = 0.0  # as if the retry interval had passed
    reader = Reader(cluster, manager.layout)
    until(lambda: reader.get(bid("x")) is not None, manager, "the offer made while down was never written")
    assert torch.equal(reader.get(bid("x")), written)
    reader.close()


def test_a_failing_write_is_retried_a_bounded_number_of_times(managers, cluster, tmp_path):
    """The master is lost mid-run (a client that never joined tries nothing: its offers wait until it joins)."""
    manager = make(managers, cluster, tmp_path, host_blocks=8, disk=False, retry_s=0.2)
    store(manager, bid("w"), page=1, seed=2)
    until(lambda: manager.tiers["mooncake"].writes.written == 1, manager, "write-through")
    cluster.kill_master()  # and never back
    store(manager, bid("x"), page=0, seed=1)
    until(lambda: manager.tiers["mooncake"].store.stats["write_gave_up"] == 1, manager, "the failed write was not given up")
    submitted = manager.tiers["mooncake"].writes.submitted
    assert submitted - 1 == manager.tiers["mooncake"].writes.max_tries == manager.tiers["mooncake"].store.stats["write_retried"] + 1
    for _ in range(5):  # given up: nothing more is tried, nothing is left pinned or queued
        manager.poll()
    assert manager.tiers["mooncake"].writes.submitted == submitted and not manager.busy()
    assert manager.host.accounting()["pinned"] == 0


def test_closing_the_manager_closes_its_g4_client(managers, cluster, tmp_path):
    manager = make(managers, cluster, tmp_path, disk=False)
    store(manager, bid("x"), page=0, seed=1)
    until(lambda: manager.tiers["mooncake"].store.connected and manager.tiers["mooncake"].writes.written == 1, manager, "write-through")
    manager.close()
    assert not manager.tiers["mooncake"].store.connected
