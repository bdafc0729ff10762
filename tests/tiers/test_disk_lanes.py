"""The disk threads serve what someone waits for first, and a load never waits long on the disk.

* The writer: a device -> disk copy (the tree keeps its node locked until it
  is reported, in order) runs ahead of queued background host -> disk writes.
* The reader: a load's own reads move ahead of other requests' prefetches, and
  a load waits for them at most what the read meter expects; past that the
  request recomputes (and the read, when it ends, serves a later request).

Real stack (SGLang's tree and pools on CPU, NIXL disk in files); the disk
threads are the production ``LaneExecutor`` with each job held until the test
lets it run (``GatedLanes``).
"""

import threading
from array import array
from concurrent.futures import ThreadPoolExecutor, wait

import pytest
import torch

from conftest import GatedLanes, make_req, needs_refusable_loads
from sglang_kvbm.integration.sglang.lookup_pins import LookupPins
from sglang_kvbm.transfer.lanes import LaneExecutor

PAGE = 4


def test_lanes_run_urgent_work_first_and_promote_keeps_order():
    lanes = GatedLanes("kvbm-test-lanes")
    ran = []
    first = lanes.submit(ran.append, "running")
    lanes.wait_held()  # taken by the thread: it waits for its pass
    background = [lanes.submit(ran.append, f"b{i}") for i in range(3)]
    urgent = lanes.submit_urgent(ran.append, "u")
    lanes.promote([background[2], background[1]])
    lanes.open()
    for future in [first, urgent, *background]:
        future.result(timeout=10)
    assert ran == ["running", "u", "b1", "b2", "b0"]
    lanes.shutdown()
    with pytest.raises(RuntimeError):
        lanes.submit(ran.append, "late")


def test_shutdown_cancels_what_never_ran_and_lets_the_running_job_end():
    lanes = LaneExecutor("kvbm-test-lanes")
    started, release = threading.Event(), threading.Event()
    running = lanes.submit(lambda: (started.set(), release.wait(10))[1])
    assert started.wait(10)
    queued = [lanes.submit(lambda: None), lanes.submit_urgent(lambda: None)]
    lanes.shutdown(wait=False, cancel_futures=True)
    assert all(f.cancelled() for f in queued)
    release.set()
    assert running.result(timeout=10) is True


def _disk_stack(stack_factory, tmp_path, **kwargs):
    return stack_factory(page_size=PAGE, host_blocks=4, disk_blocks=64, disk_dir=tmp_path,
                         executor=ThreadPoolExecutor(1, thread_name_prefix="kvbm-test-offload"), **kwargs)


def test_device_to_disk_copies_run_ahead_of_background_disk_writes(stack_factory, tmp_path):
    stack = _disk_stack(stack_factory, tmp_path, gated_writer=True)
    a, b = list(range(4 * PAGE)), list(range(700, 700 + 4 * PAGE))
    busy = stack.writer.submit(lambda: None)  # the writer is busy with something already
    stack.writer.wait_held()
    stack.insert(a, seed=1)
    stack.cache.poll()  # the step's device -> host copies start (once per step)
    stack.executor.submit(lambda: None).result(timeout=60)
    stack.cache.poll()  # A's host copy registered: its host -> disk write is queued (background), pinning A's rows
    assert stack.writer.submitted == 2
    stack.insert(b, seed=2)  # no host row can be had: B goes straight to disk, and the tree waits for it
    assert stack.writer.submitted == 3
    marker = stack.writer.submit_urgent(lambda: None)
    stack.writer.allow(3)  # what was running, then B's copy and the marker; A's background write stays queued
    busy.result(timeout=10)
    marker.result(timeout=10)  # a FIFO writer would have run A's write first and never reached the marker
    stack.tree.check_hicache_events()
    assert stack.tree.protected_size() == 0  # B's node is unlocked: its offload completed
    ids_a, ids_b = stack.block_ids(a), stack.block_ids(b)
    assert all(map(stack.manager.tiers["disk"].store.registered, ids_b))
    assert not any(map(stack.manager.tiers["disk"].store.registered, ids_a))  # still queued
    stack.writer.open()
    stack.settle()
    assert all(map(stack.manager.tiers["disk"].store.registered, ids_a))


class RecordingReader(GatedLanes):
    """The disk reader, held per job; records the first block id of each read it runs."""

    def __init__(self) -> None:
        super().__init__("kvbm-test-disk-read")
        self.ran = []

    def _put(self, lane, fn, args, kwargs):
        def recorded(*a, **k):
            entries = a[1] if len(a) > 1 and isinstance(a[1], list) else None
            self.ran.append(entries[0].header.block_id if entries else None)
            return fn(*a, **k)

        return super()._put(lane, recorded, args, kwargs)


def _only_on_disk(stack, *prefixes):
    """Store each prefix, then leave it on disk only (not on the device, not in the host tier)."""
    written = []
    for seed, tokens in enumerate(prefixes):
        written.append(stack.insert(tokens, seed=10 + seed))
        stack.settle()
        stack.evict_all()
    ids = [b for tokens in prefixes for b in stack.block_ids(tokens)]
    stack.manager.host.remove(ids)
    assert all(map(stack.manager.tiers["disk"].store.registered, ids))
    return written


def _match_only(stack, tokens, rid):
    """A request that matched (its lookup starts the disk reads) and waits in the queue."""
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    stack.tree.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens)), req=make_req(tokens + [1], rid)))


@needs_refusable_loads  # on 0.5.21 each lookup waits for its own verified reads (lookup pins)
def test_a_load_waits_only_for_its_own_reads(stack_factory, tmp_path):
    reader = RecordingReader()
    stack = _disk_stack(stack_factory, tmp_path, reader=reader)
    queued, mine = list(range(8 * PAGE)), list(range(300, 300 + 2 * PAGE))
    _, written = _only_on_disk(stack, queued, mine)
    busy = reader.submit(lambda: None)  # the reader is busy: what follows queues
    reader.wait_held()
    stack.linker.policy.read.record(1 << 20, 1.0)  # a slow disk: the load below may wait for its read
    _match_only(stack, queued, "waiting")  # its prefetch queues first
    threading.Timer(0.3, reader.open).start()  # the disk frees up while the load below waits
    req, _, loaded, slots, _ = stack.admit(mine + [1], "mine")
    assert loaded == 2 * PAGE and stack.finish(req)
    assert all(torch.equal(g, w) for g, w in zip(stack.read_pages(slots), written))
    busy.result(timeout=10)
    ids_queued, ids_mine = stack.block_ids(queued), stack.block_ids(mine)
    assert reader.ran[1:3] == [ids_mine[0], ids_queued[0]], reader.ran  # its read went ahead of the earlier prefetch
    stack.tree.linker.release_request("waiting")


@needs_refusable_loads  # on 0.5.21 no load waits: the request waits in the queue (the tests below)
def test_a_load_gives_up_past_the_read_meters_estimate_and_the_read_serves_later(stack_factory, tmp_path):
    reader = RecordingReader()
    stack = _disk_stack(stack_factory, tmp_path, reader=reader)
    mine = list(range(300, 300 + 2 * PAGE))
    (written,) = _only_on_disk(stack, mine)
    meter = stack.linker.policy.read
    meter.keep_since(meter.recorded)  # only what follows counts (not reads timed on a busy machine before)
    meter.record(1 << 20, 1e-3)  # this disk reads 1 MiB in a millisecond
    busy = reader.submit(lambda: None)
    reader.wait_held()
    opened = threading.Timer(30.0, reader.open)  # the disk is stuck far past that estimate
    opened.start()
    req, _, loaded, _, _ = stack.admit(mine + [1], "first")
    assert loaded == 0  # recomputed, without waiting for the disk (a 30 s load timeout would have waited)
    assert opened.is_alive(), "the load waited for the stuck disk"
    stats = stack.manager.reads
    assert (stats.load_waits, stats.load_waits_expired) == (1, 1)
    opened.cancel()
    reader.open()
    busy.result(timeout=10)
    stack.settle()  # the read ended meanwhile: its blocks are staged
    stack.scramble_pool()
    req, _, loaded, slots, _ = stack.admit(mine + [1], "second")
    assert loaded == 2 * PAGE and stack.finish(req)
    assert all(torch.equal(g, w) for g, w in zip(stack.read_pages(slots), written))
    assert stats.load_waits == 1  # nothing left to wait for


# -- reads deferred (SGLang 0.5.21's flow, ``lookup_pins``): the request waits in the queue, the scheduler never ----


def _deferring(stack_factory, tmp_path, tokens):
    """A stack whose prefix ``tokens`` is on disk only, its reader held busy, lookups deferring; ``(stack, keys,
    pins, reader, busy job, clock, pages written)``."""
    reader = RecordingReader()
    stack = _disk_stack(stack_factory, tmp_path, reader=reader)
    (written,) = _only_on_disk(stack, tokens)
    stack.manager.defer_reads()
    clock = [100.0]
    pins = LookupPins(stack.linker.connector, clock=lambda: clock[0])
    busy = reader.submit(lambda: None)
    reader.wait_held()
    return stack, stack.block_ids(tokens), pins, reader, busy, clock, written


def _lookup(stack, pins, rid, keys) -> int:
    return pins.pin(rid, keys, stack.linker.connector.lookup(rid, keys))


def test_a_lookup_with_reads_in_flight_reports_them_pins_nothing_and_waits_for_none(stack_factory, tmp_path):
    tokens = list(range(300, 300 + 2 * PAGE))
    stack, keys, pins, reader, busy, _, _ = _deferring(stack_factory, tmp_path, tokens)
    assert _lookup(stack, pins, "a", keys) == 2  # what the reads will serve (the disk is held: they cannot have)
    assert pins.deferred("a") and len(pins) == 0 and pins.deferrals == 1
    assert _lookup(stack, pins, "a", keys) == 2 and pins.deferred("a")  # the next round: still reading
    assert pins.waiting("a", keys) == 2 and pins.waiting("a", keys[:1]) == 0  # the same tail needs no lookup
    assert stack.manager.reads.load_waits == 0  # nothing waited on this thread
    reader.open()
    busy.result(timeout=10)
    wait(stack.manager.staging.in_flight(), timeout=10)
    assert pins.waiting("a", keys) == 0  # landed: looked up again
    assert _lookup(stack, pins, "a", keys) == 2 and not pins.deferred("a") and len(pins) == 1
    plan = pins.take("a", keys)  # verified reads, pinned in staging (SGLang 0.5.21's tree loads them: test_lookup_pins)
    assert plan.staged_blocks == 2 and plan.staged_from == ["disk", "disk"]
    assert stack.manager.reads.load_waits == 0
    stack.linker.connector.cancel(plan)


def test_a_request_waits_for_its_reads_once_and_no_longer_than_a_load_would(stack_factory, tmp_path):
    tokens = list(range(400, 400 + 2 * PAGE))
    stack, keys, pins, reader, busy, clock, _ = _deferring(stack_factory, tmp_path, tokens)
    assert _lookup(stack, pins, "a", keys) == 2 and pins.deferred("a")
    clock[0] += 3600  # past any load's wait: the disk is stuck
    assert _lookup(stack, pins, "a", keys) == 0  # it takes what is servable now: nothing in host
    assert not pins.deferred("a") and pins.waits_expired == 1
    assert _lookup(stack, pins, "a", keys) == 0 and not pins.deferred("a")  # one wait per request
    assert stack.manager.reads.load_waits == 0
    pins.forget("a")  # the request went away: a new one with its id may wait again
    assert _lookup(stack, pins, "a", keys) == 2 and pins.deferred("a")
    pins.release_all()  # the batch formed without it
    assert not pins.deferred("a")
    reader.open()
    busy.result(timeout=10)
    stack.settle()


def test_an_idle_scheduler_waits_for_the_first_read_a_deferred_request_waits_for(stack_factory, tmp_path):
    tokens = list(range(500, 500 + 2 * PAGE))
    stack, keys, pins, reader, busy, clock, _ = _deferring(stack_factory, tmp_path, tokens)
    assert not pins.wait_idle()  # nobody waits: SGLang idles as it would
    assert _lookup(stack, pins, "a", keys) == 2 and pins.deferred("a")
    clock[0] -= 60  # its wait has a minute left
    opened = threading.Timer(0.3, reader.open)
    opened.start()
    assert pins.wait_idle()  # returns once a read landed, not after the minute
    assert 0.2 < pins.idle_wait_seconds < 30
    busy.result(timeout=10)
    wait(stack.manager.staging.in_flight(), timeout=10)
    assert _lookup(stack, pins, "a", keys) == 2 and not pins.deferred("a") and len(pins) == 1
    assert not pins.wait_idle()
    pins.release_all()
