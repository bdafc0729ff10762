"""The layer counter's contract on CPU: a layer is readable only after its copy, and a failure is reported,
not raised into the forward. (tests/gpu runs the same contract with CUDA events on a GPU.)

The loader test drives the real stack: SGLang's tree and pools on CPU, the KvbmLinker, its loader thread.
"""

import threading

import torch

from sglang_kvbm.transfer.layer_counter import LayerCounter


def _waiter(counter, layer):
    done = threading.Event()
    thread = threading.Thread(target=lambda: (counter.wait_until(layer), done.set()), daemon=True)
    thread.start()
    return done


def test_a_layer_is_readable_only_after_its_copy():
    counter = LayerCounter(3)
    index = counter.update_producer()
    counter.set_consumer(index)
    second = _waiter(counter, 1)
    assert not second.wait(0.2)  # nothing copied yet
    counter.complete(index, 0)
    assert not second.wait(0.2)  # layer 0 only
    counter.complete(index, 1)
    assert second.wait(10)
    counter.wait_until(0)  # done layers return at once
    counter.complete(index, 2)
    assert counter.finish(index)


def test_a_failed_batch_releases_every_wait_and_finish_reports_it():
    counter = LayerCounter(4)
    index = counter.update_producer()
    counter.set_consumer(index)
    counter.complete(index, 0)
    last = _waiter(counter, 3)
    counter.fail(index, RuntimeError("disk gone"))
    assert last.wait(10)  # the forward goes on (on whatever the slots hold) ...
    assert not counter.finish(index)  # ... and the scheduler drops the requests afterwards


def test_no_batch_means_no_wait_and_finish_waits_for_every_layer():
    counter = LayerCounter(2)
    counter.wait_until(1)  # nothing consumed: returns
    index = counter.update_producer()
    finished = threading.Event()
    threading.Thread(target=lambda: (counter.finish(index), finished.set()), daemon=True).start()
    counter.complete(index, 0)
    assert not finished.wait(0.2)
    counter.complete(index, 1)
    assert finished.wait(10)
    assert counter.done_event(index) is None  # CPU: landed is landed
    counter.forget(index)
    assert counter.finish(index)


def test_the_forward_reads_layer_0_while_layer_1_is_still_copying(stack_factory):
    stack = stack_factory(layers=2)
    tokens = list(range(32))
    written = stack.insert(tokens, seed=3)
    stack.settle()
    stack.evict_all()
    stack.scramble_pool()
    gate = threading.Event()
    stack.linker.loader.before_layer = lambda index, layer: layer == 1 and gate.wait(30)
    req, _, loaded, slots, index = stack.admit(tokens + [1])
    assert loaded == 32
    counter = stack.linker.layer_done_counter
    counter.set_consumer(index)  # what SGLang's model worker does for the batch
    counter.wait_until(0)
    pages = (slots[:: stack.page_size] // stack.page_size).tolist()
    layout = stack.layout
    k0, k1 = layout.layers[0][0], layout.layers[1][0]
    spans = [(layout.buffer_offsets[b], layout.buffer_page_bytes[b]) for b in (k0, k1)]
    for page, want in zip(pages, written):
        got = layout.read_page(page)
        (o0, n0), (o1, n1) = spans
        assert torch.equal(got[o0 : o0 + n0], want[o0 : o0 + n0])  # layer 0: landed
        assert not torch.equal(got[o1 : o1 + n1], want[o1 : o1 + n1])  # layer 1: not yet
    layer_1 = _waiter(counter, 1)
    assert not layer_1.wait(0.2)
    gate.set()
    assert layer_1.wait(10)
    assert stack.finish(req)
    assert all(torch.equal(g, w) for g, w in zip(stack.read_pages(slots), written))
