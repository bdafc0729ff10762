"""A flush (or a tier drop) while copies are in flight: nothing of the old cache reaches the new one.

The real stack (SGLang's tree, pools and allocator on CPU, the KvbmLinker, a
disk tier in files through NIXL) with the disk writer held by the test
(``GatedLanes``): its queued writes are the copies a reset can overtake.
"""

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from sglang_kvbm.core.identity import chain_hashes
from sglang_kvbm.core.pages import one_page
from sglang_kvbm.tiers.host.pool import HostBlockPool
from sglang_kvbm.transfer.host_memory import aligned_empty

# loads must land whatever the machine is doing (not this file's subject: test_disk_lanes.py tests the budget)
pytestmark = pytest.mark.usefixtures("loads_wait_for_their_reads")


PAGE = 4


def _stack(stack_factory, tmp_path, **kwargs):
    # One device -> host worker the test can wait on: a no-op submitted after a copy ends after it.
    executor = ThreadPoolExecutor(1, thread_name_prefix="kvbm-test-offload")
    stack = stack_factory(page_size=PAGE, host_blocks=4, disk_blocks=64, disk_dir=tmp_path, gated_writer=True,
                          executor=executor, **kwargs)
    return stack


def _copied_to_host(stack) -> None:
    """Every device -> host copy so far has ended, and the scheduler's poll registered it."""
    stack.cache.poll()  # hands the step's copies to their thread (once per step)
    stack.executor.submit(lambda: None).result(timeout=60)
    stack.cache.poll()


def _load(stack, tokens):
    """Evict the device copy, scramble the pool, and load ``tokens`` back: (loaded, pages or [])."""
    stack.evict_all()
    stack.scramble_pool()
    req, _, loaded, slots, _ = stack.admit(tokens + [1])
    if not loaded:
        return 0, []
    assert stack.finish(req)
    return loaded, stack.read_pages(slots)


def test_disk_write_queued_before_a_flush_never_commits_another_blocks_bytes(stack_factory, tmp_path):
    """The review's repro: single page X, disk writer held, flush, X again, old write released, host filled
    by another prefix, new write released, host emptied, X loaded from disk."""
    stack = _stack(stack_factory, tmp_path)
    stack.linker.quiesce_timeout = 0.0  # the disk is stuck past the flush's wait: the flush goes on without it
    x, other = list(range(PAGE)), list(range(500, 500 + 4 * PAGE))
    original = stack.insert(x, seed=1)
    _copied_to_host(stack)  # X in the host tier; its host -> disk write is queued, pinning its row
    stack.writer.wait_held()  # the writer took it (and waits for the test)
    assert stack.writer.submitted == 1

    stack.tree.reset()  # /flush_cache
    stack.allocator.clear()
    assert stack.host_blocks() == 0
    stack.insert(x, seed=1)  # recomputed: same KV
    _copied_to_host(stack)  # X's new row, pinned by its own queued write
    assert stack.writer.submitted == 2

    # The old generation's write ends first (the writer holds it; a marker queued ahead of the new write
    # tells when it is over): it must not unpin the new write's row.
    marker = stack.writer.submit_urgent(lambda: None)
    stack.writer.allow(2)
    marker.result(timeout=60)
    stack.cache.poll()
    stack.insert(other, seed=2)  # fills the host: evicts only what nothing pins
    _copied_to_host(stack)
    stack.writer.drain()  # the new write, and whatever the other prefix sent to disk
    stack.settle()
    ids = stack.block_ids(x)
    stack.manager.host.remove([m.block_id for m in stack.manager.host.metas()])  # host emptied: X only on disk
    assert stack.manager.tiers["disk"].store.registered(ids[0])

    loaded, pages = _load(stack, x)
    assert loaded == PAGE, "X's disk copy was refused"
    assert torch.equal(pages[0], original[0]), "X loaded another block's bytes from disk"


def test_flush_waits_for_copies_in_flight_then_forgets_them(stack_factory, tmp_path):
    stack = _stack(stack_factory, tmp_path, events=True)
    x = list(range(4 * PAGE))
    stack.insert(x, seed=3)
    _copied_to_host(stack)
    assert stack.writer.submitted == 1  # the host -> disk write is held
    flush = threading.Thread(target=stack.tree.reset)
    flush.start()
    flush.join(timeout=0.5)
    assert flush.is_alive(), "reset returned with a disk write in flight (SGLang's contract: quiesce first)"
    stack.writer.open()
    flush.join(timeout=60)
    assert not flush.is_alive()
    assert stack.linker.quiesce(timeout=0)  # nothing was left running
    stack.allocator.clear()
    assert stack.host_blocks() == 0 and len(stack.manager.tiers["disk"].store) == 0
    accounting = stack.manager.host.accounting()
    assert accounting["free"] == stack.manager.host.capacity and accounting["orphaned"] == 0, accounting
    assert stack.tree.protected_size() == 0


def test_drop_tiers_announces_every_removal_and_still_completes_the_trees_offloads(stack_factory, tmp_path):
    """A weight update without a flush: every tier's blocks go (with their removals); the tree keeps its
    nodes, and an offload it is waiting for when the tiers drop still completes, in order."""
    from sglang.srt.disaggregation.kv_events import BlockRemoved, BlockStored

    stack = _stack(stack_factory, tmp_path, events=True)
    kept, flying = list(range(4 * PAGE)), list(range(900, 900 + 2 * PAGE))
    stack.insert(kept, seed=4)
    _copied_to_host(stack)
    stack.writer.drain()
    stack.settle()
    stored = {}
    for event in stack.tree.take_events():
        if isinstance(event, BlockStored) and event.medium in ("CPU_PINNED", "DISK"):
            stored.setdefault(event.medium, set()).update(event.block_hashes)
    assert len(stored["CPU_PINNED"]) == 4 and len(stored["DISK"]) == 4

    stack.insert(flying, seed=5)  # its host copy ends, its disk write is held across the drop
    _copied_to_host(stack)
    before = stack.writer.submitted
    stack.tree.check_hicache_events()
    assert stack.tree.protected_size() == 0  # the host copy completed its offload
    drop = threading.Thread(target=stack.linker.drop_tiers)
    drop.start()
    drop.join(timeout=0.5)
    assert drop.is_alive()  # quiescing: the held write is still in flight
    stack.writer.open()
    drop.join(timeout=60)
    assert stack.writer.submitted == before
    assert stack.host_blocks() == 0 and len(stack.manager.tiers["disk"].store) == 0
    removed = {}
    for event in stack.tree.take_events():
        if isinstance(event, BlockRemoved):
            removed.setdefault(event.medium, set()).update(event.block_hashes)
    assert removed["CPU_PINNED"] >= stored["CPU_PINNED"] and removed["DISK"] >= stored["DISK"]
    assert len(removed["CPU_PINNED"]) == 6 and len(removed["DISK"]) == 6  # the held write was in the old tiers too

    stack.evict_all()  # the tree's nodes are unlocked and evictable; nothing comes back from the tiers
    assert stack.tree.protected_size() == 0
    assert stack.linker.connector.peek(stack.block_ids(kept)) == (0, 0)
    stack.insert(kept, seed=4)  # stored again after the drop, as usual
    _copied_to_host(stack)
    stack.settle()
    assert stack.linker.connector.peek(stack.block_ids(kept)) == (4, 4)


def test_a_host_row_pinned_by_two_holders_is_reused_only_after_both_let_go():
    """A disk write and a G4 write pin one row; the tiers are forgotten; the first to end must not free the row."""
    x, y, z, w = chain_hashes(list(range(4)), 1)
    pool = HostBlockPool(aligned_empty((2, 4096)))
    rows, _ = pool.reserve([x])
    pool.commit([one_page(x, (1, 2))], rows)
    held = pool.pin([x])  # the disk write
    assert pool.pin([x]) == held  # the G4 write
    pool.forget()
    pool.release_orphans(held)  # the disk write ends
    assert pool.accounting()["orphaned"] == 1
    got, _ = pool.reserve([y, z])
    assert held[0] not in got and len(got) == 1  # the G4 write still reads its row
    pool.release_orphans(held)  # the G4 write ends
    assert pool.accounting()["orphaned"] == 0 and pool.reserve([w])[0] == list(held)
