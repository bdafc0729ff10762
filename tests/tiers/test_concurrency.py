"""Stress: a device page is never freed or reused while a copy reads it, a host row never written
by two copies, and completions of a reset cache are ignored.

SGLang's default tree with the linker attached, driven as the scheduler drives
it (match, load back, layer-wise load around a forward, insert, evict, reset,
one ``check_hicache_events`` per step). Device -> host copies are held back
behind gates opened at random points, so offloads pile up while the scenario
evicts, reallocates and overwrites pages, loads and resets around them. The tree
keeps a node locked while its offload is pending (SGLang's job since the linker
seam); this test proves that holds with our linker. KV bytes are a pure function
of the block id (as a model's KV is of its tokens): any copy that read a reused
page, or a row written twice, shows as bytes that differ from that function.
"""

from __future__ import annotations

import hashlib
import random
import threading
from array import array
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
import torch
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InitLoadBackParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixKey

from conftest import build_stack, make_req, needs_refusable_loads
from sglang_kvbm.integration.sglang.compat import device_prefix_len, path_device_indices

# loads must land whatever the machine is doing (not this file's subject: test_disk_lanes.py tests the budget)
pytestmark = pytest.mark.usefixtures("loads_wait_for_their_reads")


PAGE = 4
STEPS = 800


def kv_of(block_id: str, nbytes: int) -> torch.Tensor:
    seed = int.from_bytes(hashlib.sha256(block_id.encode()).digest()[:8], "little")
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


class SteppedExecutor(ThreadPoolExecutor):
    """The device -> host copy worker (one thread); each copy waits for the gate current when it was submitted.

    It also watches every copy: no host row is the target of two copies whose
    results are not in yet, and a copy of the current cache generation read
    exactly the KV of its blocks from the device (nothing reused the pages).
    """

    def __init__(self):
        super().__init__(max_workers=1, thread_name_prefix="kvbm-test-offload")
        self.gate = threading.Event()
        self.stack = None
        self._lock = threading.Lock()
        self._writing: set[int] = set()  # host rows targeted by copies not finished yet
        self.copies = self.checked = self.discarded = 0
        self.errors: list[str] = []

    def submit(self, fn, layout, stream, parts, slab):
        """One step's device -> host copies (``Offloads.flush``): ``parts`` of (future, request, positions, rows)."""
        gate, offloads = self.gate, self.stack.manager.offloads
        generation = offloads._generation
        rows = [row for *_, part_rows in parts for row in part_rows]
        with self._lock:
            twice = self._writing.intersection(rows)
            assert not twice and len(set(rows)) == len(rows), f"host rows {sorted(twice)} targeted by two copies at once"
            self._writing.update(rows)

        def gated():
            # The copies report to futures of this harness first: a part's rows leave ``_writing`` before the
            # scheduler can see it done (and reuse its rows).
            inner = [(Future(), request, positions, part_rows) for _, request, positions, part_rows in parts]
            try:
                if not gate.wait(timeout=120):
                    raise TimeoutError("gate never opened")
                fn(layout, stream, inner, slab)
            finally:
                for (outer, *_), (future, _, _, part_rows) in zip(parts, inner):
                    if future.done() and not future.cancelled() and future.exception() is None:
                        if offloads._generation == generation:  # a reset since may have reused the pages
                            for meta, row in zip(future.result()[0], part_rows):
                                if not torch.equal(slab[row, : layout.page_bytes],
                                                   kv_of(meta.block_id, layout.page_bytes)):
                                    self.errors.append(f"copy of {meta.block_id[:12]} read a reused device page")
                            self.checked += 1
                        else:
                            self.discarded += 1
                        self.copies += 1
                    with self._lock:
                        self._writing.difference_update(part_rows)
                    if not outer.set_running_or_notify_cancel():
                        continue
                    if not future.done():
                        outer.set_exception(TimeoutError("gate never opened"))
                    elif future.cancelled() or future.exception() is not None:
                        outer.set_exception(future.exception() if not future.cancelled() else RuntimeError("cancelled"))
                    else:
                        outer.set_result(future.result())

        return super().submit(gated)

    def release(self, *, last: bool = False):
        """Let every copy submitted so far run; ``last``: and every later one (the end of the scenario)."""
        self.gate.set()
        if not last:
            self.gate = threading.Event()


class Scenario:
    def __init__(self, stack, executor, rng: random.Random):
        self.stack, self.executor, self.rng = stack, executor, rng
        self.tree, self.allocator, self.layout = stack.tree, stack.allocator, stack.layout
        self.live: set[str] = set()  # blocks computed since the last reset: the only ones a tier may hold
        self.checked_loads = self.disk_loads = self.resets = self.loads_during_churn = 0

    def kv(self, block_id: str) -> torch.Tensor:
        return kv_of(block_id, self.layout.page_bytes)

    def churn(self) -> None:
        """Evict, then reuse the freed pages at once and overwrite them: a copy still reading them would see it."""
        self.tree.evict(EvictParams(num_tokens=self.rng.choice([16, 64, 256])))
        grabbed = self.allocator.alloc(self.allocator.available_size() // 8 * PAGE)
        if grabbed is not None:
            for page in (grabbed[::PAGE] // PAGE).tolist():
                self.layout.write_page(page, torch.full((self.layout.page_bytes,), 0xEE, dtype=torch.uint8))
            self.allocator.free(grabbed)

    def serve(self, tokens: list[int], rid: str) -> None:
        """One request, as the scheduler runs it: match, load back, forward, insert."""
        tree, stack = self.tree, self.stack
        key = RadixKey(array("q", tokens))
        ids = stack.block_ids(tokens)
        req = make_req(tokens + [1], rid)
        match = tree.match_prefix(MatchPrefixParams(key=key, req=req))
        device, node = device_prefix_len(match), match.last_device_node
        lock = tree.lock(node)  # the request holds its device prefix
        prefix = path_device_indices(tree, node)[:device].to(torch.int64)
        if match.host_hit_length:
            req.last_node = node
            loaded, _ = tree.init_load_back(InitLoadBackParams(
                best_match_node=match.best_match_node, host_hit_length=match.host_hit_length, req=req))
            if loaded:
                slots = tree.linker.private_load_indices[rid].to(torch.int64)
                disk_blocks = req.storage_hit_length // PAGE if getattr(req, "storage_hit_length", 0) else 0
                tree.ready_to_load_host_cache()
                if self.rng.random() < 0.5:  # the layers are copied while the scheduler frees and reuses pages
                    self.churn()
                    self.loads_during_churn += 1
                assert stack.finish(req), "a load that was accepted must land"
                for block_id, page in zip(ids[device // PAGE :], (slots[::PAGE] // PAGE).tolist()):
                    assert torch.equal(self.layout.read_page(page), self.kv(block_id)), "a load served wrong bytes"
                    self.checked_loads += 1
                self.disk_loads += disk_blocks
                prefix = torch.cat([prefix, slots])
        need = len(tokens) - len(prefix)
        fresh = None
        if need:
            if self.allocator.available_size() < need:
                tree.evict(EvictParams(num_tokens=need))
            fresh = self.allocator.alloc(need)
        if fresh is not None:  # the forward writes the KV of the new pages (a function of their ids)
            for block_id, page in zip(ids[len(prefix) // PAGE :], (fresh[::PAGE] // PAGE).tolist()):
                self.layout.write_page(page, self.kv(block_id))
            prefix = torch.cat([prefix, fresh.to(torch.int64)])
        if len(prefix) > device:
            self.live.update(ids[device // PAGE : len(prefix) // PAGE])
            # Pages another insert added meanwhile are duplicates: the tree frees ours itself (as for the scheduler).
            tree.insert(InsertParams(key=key[: len(prefix)], value=prefix, prev_prefix_len=device))
        tree.unlock(lock)

    def match_only(self, tokens: list[int], rid: str) -> None:
        self.tree.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens)), req=make_req(tokens + [1], rid)))
        self.tree.linker.release_request(rid)  # the request went away before it was scheduled

    def check_tiers_hold_only_live_blocks(self) -> None:
        manager = self.stack.manager
        held = [m.block_id for m in manager.host.metas()]
        if "disk" in manager.tiers:
            held += [m.block_id for m in manager.tiers["disk"].store.registered_metas()]
        assert set(held) <= self.live, "a copy started before a reset was kept"

    def reset(self) -> None:
        self.tree.reset()  # with copies in flight: their completions must be ignored
        self.allocator.clear()
        self.live.clear()
        self.resets += 1
        assert self.stack.host_blocks() == 0


@needs_refusable_loads  # the scheduler's 0.5.22-on flow (tree.lock, refusals); 0.5.21's: test_lookup_pins.py
@pytest.mark.parametrize("seed", [11, 12])
@pytest.mark.parametrize("tiers", ["host", "host+disk"])
def test_copies_never_race_page_reuse_or_reset(tmp_path, tiers, seed):
    rng = random.Random(seed)
    executor = SteppedExecutor()
    disk = {"disk_blocks": 96, "disk_dir": tmp_path} if tiers == "host+disk" else {}
    stack = build_stack(size=256, host_blocks=48 if not disk else 24, executor=executor, events=True, **disk)
    executor.stack = stack
    # Resets do not wait for the held copies (a reset past its quiesce timeout): what they leave in flight
    # must change nothing of the new generation when it ends.
    stack.linker.quiesce_timeout = 0.0
    scenario = Scenario(stack, executor, rng)
    tree, allocator, layout, manager = stack.tree, stack.allocator, stack.layout, stack.manager
    prompts = [[rng.randrange(5000) for _ in range(rng.choice([16, 32, 48]))] for _ in range(16)]
    prompts += [prompts[k][:16] + [rng.randrange(5000) for _ in range(16)] for k in range(4)]  # shared prefixes
    try:
        for step in range(STEPS):
            tree.check_hicache_events()  # the scheduler's per-step poll: finished offloads unlock their nodes
            op = rng.random()
            if op < 0.40:
                scenario.serve(rng.choice(prompts), f"s{step}")
            elif op < 0.48:  # a request matched but left waiting in the queue: its disk reads run meanwhile
                scenario.match_only(rng.choice(prompts), f"q{step}")
            elif op < 0.75:
                scenario.churn()
            elif op < 0.97:
                executor.release()
                if rng.random() < 0.3:
                    # Now and then the scheduler is slower than the copies (a forward takes a while): without
                    # this, a loop of empty steps outruns the disk threads and only finds the tiers full.
                    manager.wait(timeout=10)
                tree.take_events()
                scenario.check_tiers_hold_only_live_blocks()
            else:
                scenario.reset()
        executor.release(last=True)  # the step's copies are handed over by the flush below
        assert stack.cache.flush(timeout=60)
        assert not executor.errors, executor.errors[:5]
        scenario.check_tiers_hold_only_live_blocks()

        # Every host row holds exactly its block's KV, and every row is accounted for.
        host = manager.host
        for meta in host.metas():
            row = host.rows([meta.block_id])[0]
            assert torch.equal(host.slab[row, : layout.page_bytes], scenario.kv(meta.block_id)), meta.block_id
        accounting = host.accounting()
        assert accounting["registered"] + accounting["free"] == host.capacity, accounting
        assert (accounting["pinned"], accounting["in_flight"], accounting["orphaned"]) == (0, 0, 0), accounting
        if "disk" in manager.tiers:
            check_disk(manager.tiers["disk"].store, scenario)
        # Every device page: no lock left behind, and all of them come back.
        assert tree.protected_size() == 0
        tree.evict(EvictParams(num_tokens=stack.size))
        assert allocator.available_size() == stack.size

        # The scenario did what it is for (loose bounds: thread timing steers the trajectory).
        assert scenario.checked_loads > 100 and scenario.loads_during_churn > 8 and scenario.resets > 0
        assert executor.checked > 50 and executor.discarded > 0  # copies of a reset cache were really in flight
        if "disk" in manager.tiers:
            assert scenario.disk_loads > 0
    finally:
        executor.release()
        stack.cache.close()
        executor.shutdown()


def check_disk(disk, scenario) -> None:
    """Every registered disk block's slot holds its header and exactly its KV; every slot is accounted for."""
    from sglang_kvbm.tiers.format import decode_header

    accounting = disk.accounting()
    assert accounting["registered"] + accounting["free"] == accounting["slots"], accounting
    assert (accounting["writing"], accounting["lost"], accounting["fds"]) == (0, 0, 1), accounting
    page_bytes = scenario.layout.page_bytes
    for slot, header in disk._index.entries():
        segment = disk.segments.of(slot)
        with open(segment.path, "rb") as f:
            f.seek((slot - segment.first) * disk.slot_bytes)
            raw = f.read(disk.slot_bytes)
        on_disk = decode_header(torch.frombuffer(bytearray(raw[: disk.header_bytes]), dtype=torch.uint8))
        assert on_disk == header
        data = torch.frombuffer(bytearray(raw[disk.header_bytes : disk.header_bytes + page_bytes]), dtype=torch.uint8)
        assert torch.equal(data, scenario.kv(header.block_id)), header.block_id
