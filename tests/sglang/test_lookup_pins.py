"""Loads on an SGLang that can take no refusal (0.5.21): what the lookup reports is pinned then, and a failed copy is
copied again before the forward reads it.

SGLang 0.5.21 raises when a linker's ``load`` answers False and inserts the loaded tail into its tree before the copy,
so neither a refusal nor a failed copy can be reported. The pieces that make that safe run on every release (a real
host tier and connector, a real loader thread and layer counter); the flow through SGLang 0.5.21's own tree and
linker wrapper runs where that release is installed (``make compat``), and is skipped, by name, elsewhere.
"""

from __future__ import annotations

import pytest
import torch

from conftest import LOADS_REFUSABLE
from sglang_kvbm.integration.sglang.lookup_pins import LoadCannotBeServed, LookupPins

only_on_0_5_21 = pytest.mark.skipif(LOADS_REFUSABLE, reason="this SGLang takes refused loads (0.5.22 on): the "
                                                            "linker pins at load() there")


class FailingLayers:
    """The loader's per-layer hook, failing the first ``times`` batches it sees at ``layer`` (an injected copy fault)."""

    def __init__(self, times: int = 1, layer: int = 1) -> None:
        self.times, self.layer, self.failed = times, layer, []

    def __call__(self, index: int, layer: int) -> None:
        if layer == self.layer and len(self.failed) < self.times and index not in self.failed:
            self.failed.append(index)
            raise OSError(f"injected copy fault in batch {index}, layer {layer}")


def pushed_to_host(stack, tokens, seed):
    written = stack.insert(tokens, seed=seed)
    stack.settle()
    assert stack.evict_all() == len(tokens)
    stack.scramble_pool()
    return written


def eight_blocks_in_host(stack_factory, seed):
    """A stack whose host tier holds exactly one 8-block prefix; its keys, and pins over its connector."""
    stack = stack_factory(host_blocks=8)
    tokens = list(range(32))
    pushed_to_host(stack, tokens, seed=seed)
    return stack, stack.block_ids(tokens), LookupPins(stack.linker.connector)


def test_a_pin_holds_its_blocks_against_other_work_and_a_narrower_load_takes_a_subset(stack_factory):
    stack, keys, pins = eight_blocks_in_host(stack_factory, seed=1)
    assert pins.pin("a", keys, 8) == 8
    stack.insert(list(range(2000, 2016)), seed=2)  # other work would push half of the prefix out of host
    stack.settle()
    assert stack.linker.connector.peek(keys)[0] == 8  # pinned: nothing was evicted
    plan = pins.take("a", keys[:4] + keys[6:])  # pages another insert added meanwhile are left out of the load
    assert plan.blocks == 6 and len(pins) == 0
    stack.linker.connector.cancel(plan)
    with pytest.raises(LoadCannotBeServed):
        pins.take("b", keys)  # never looked up


def test_a_lookup_again_or_a_cancel_lets_the_earlier_pin_go(stack_factory):
    stack, keys, pins = eight_blocks_in_host(stack_factory, seed=3)
    pins.pin("a", keys, 8)
    pins.pin("a", keys, 8)  # the request waited a round: looked up again
    assert len(pins) == 1 and pins.release("a") and not pins.release("a")
    stack.insert(list(range(2000, 2032)), seed=4)
    stack.settle()
    assert stack.linker.connector.peek(keys)[0] < 8  # unpinned: evictable again


def test_a_failed_copy_is_copied_again_before_the_forward_reads_it(stack_factory):
    """The counter's redo, as the linker sets it on 0.5.21, here on whatever SGLang is installed."""
    stack = stack_factory()
    tokens = list(range(100, 132))
    written = pushed_to_host(stack, tokens, seed=5)
    counter, loader = stack.linker.layer_done_counter, stack.linker.loader
    counter.redo, loader.before_layer = loader.redo, FailingLayers()
    req, match, loaded, slots, index = stack.admit(tokens + [7])
    assert loaded == 32 and index >= 0
    loader.wait_idle()
    counter.set_consumer(index)
    for layer in range(counter.num_layers):  # the forward, layer by layer
        counter.wait_until(layer)
    assert loader.before_layer.failed == [index]
    assert stack.finish(req)  # landed
    for got, want in zip(stack.read_pages(slots), written):
        assert torch.equal(got, want)


def test_a_copy_that_fails_again_stops_the_forward_rather_than_read_wrong_kv(stack_factory):
    stack = stack_factory()
    tokens = list(range(100, 132))
    pushed_to_host(stack, tokens, seed=6)
    counter, loader = stack.linker.layer_done_counter, stack.linker.loader

    def broken(index):
        raise OSError("injected: the rows cannot be read either")

    counter.redo, loader.before_layer = broken, FailingLayers()
    _, _, loaded, _, index = stack.admit(tokens + [7], "x")
    loader.wait_idle()
    counter.set_consumer(index)
    with pytest.raises(RuntimeError, match="rather than read wrong KV"):
        for layer in range(counter.num_layers):
            counter.wait_until(layer)
    counter.redo = loader.redo  # the process would be gone; the fixture's close copies the batch once more


# -- through SGLang 0.5.21's own tree and linker wrapper --------------------------------------------------------


@only_on_0_5_21
def test_host_losing_blocks_between_lookup_and_load_still_loads_them(stack_factory):
    from array import array

    from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    from conftest import make_req

    stack = stack_factory(host_blocks=8)
    tokens = list(range(32))
    written = pushed_to_host(stack, tokens, seed=7)
    req = make_req(tokens + [1])
    match = stack.tree.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens)), req=req))
    assert match.host_hit_length == 32
    stack.insert(list(range(2000, 2016)), seed=8)  # other work would push half of the prefix out of host
    stack.settle()
    req.last_node, req.prefix_indices = match.last_device_node, match.device_indices
    slots, node = stack.tree.init_load_back(
        InitLoadBackParams(best_match_node=match.best_match_node, host_hit_length=32, req=req))
    assert len(slots) == 32  # the lookup pinned them: the load cannot miss
    index = stack.tree.ready_to_load_host_cache()
    assert stack.linker.layer_done_counter.finish(index)
    stack.tree.check_hicache_events()
    assert stack.tree.linker.pending_loads == {}  # the tree let go of its own pin on the loaded node
    for got, want in zip(stack.read_pages(slots), written):
        assert torch.equal(got, want)


@only_on_0_5_21
def test_a_request_not_admitted_lets_its_pin_go_when_the_batch_starts(stack_factory):
    from array import array

    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    from conftest import make_req

    stack = stack_factory(host_blocks=8)
    tokens = list(range(32))
    pushed_to_host(stack, tokens, seed=9)
    req = make_req(tokens + [1], "waiting")
    assert stack.tree.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens)), req=req)).host_hit_length
    assert len(stack.linker.pins) == 1
    stack.tree.ready_to_load_host_cache()  # the batch formed without it
    assert len(stack.linker.pins) == 0


@only_on_0_5_21
def test_a_failed_copy_through_the_tree_serves_the_right_bytes(stack_factory):
    stack = stack_factory()
    tokens = list(range(100, 132))
    written = pushed_to_host(stack, tokens, seed=10)
    stack.linker.loader.before_layer = fault = FailingLayers()
    req, _, loaded, slots, index = stack.admit(tokens + [7])
    assert loaded == 32 and stack.finish(req) and fault.failed == [index]
    for got, want in zip(stack.read_pages(slots), written):
        assert torch.equal(got, want)


@only_on_0_5_21
def test_a_request_whose_blocks_are_being_read_waits_in_the_queue_not_on_the_scheduler_thread(stack_factory, tmp_path):
    """SGLang 0.5.21 cannot refuse a load: the tree's init_load_back answers None (SGLang keeps the request waiting)
    while its reads below host are in flight, and the next round loads them."""
    from concurrent.futures import ThreadPoolExecutor, wait

    from conftest import GatedLanes

    reader = GatedLanes("kvbm-test-disk-read")
    stack = stack_factory(page_size=4, host_blocks=4, disk_blocks=64, disk_dir=tmp_path, reader=reader,
                          executor=ThreadPoolExecutor(1, thread_name_prefix="kvbm-test-offload"))
    tokens = list(range(300, 308))
    written = stack.insert(tokens, seed=11)
    stack.settle()
    stack.evict_all()
    keys = stack.block_ids(tokens)
    stack.manager.host.remove(keys)  # on disk only
    busy = reader.submit(lambda: None)  # the disk is busy: the reads below stay in flight
    reader.wait_held()
    req, match, loaded, _, _ = stack.admit(tokens + [1], "a", requeue=False)
    assert match.host_hit_length == 8 and loaded == 0  # reported, and kept waiting: nothing loaded...
    assert reader.held == 1 and stack.manager.reads.load_waits == 0  # ...and nothing waited for the disk
    assert stack.linker.pins.deferrals >= 1 and len(stack.linker.pins) == 0
    reader.open()
    busy.result(timeout=10)
    wait(stack.manager.staging.in_flight(), timeout=10)
    stack.scramble_pool()
    req, match, loaded, slots, _ = stack.admit(tokens + [1], "a")  # the next round
    assert loaded == 8 and stack.finish(req)
    for got, want in zip(stack.read_pages(slots), written):
        assert torch.equal(got, want)
    stack.tree.linker.release_request("a")
