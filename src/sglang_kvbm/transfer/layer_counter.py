"""Layer-by-layer loads: a layer is readable only after its copy, and the wait for it is on the device.

The forward asks, before each layer reads its KV (SGLang's KV pool calls
``wait_until(layer)``), whether that layer's loads have landed. The loader
thread enqueues the copies of layer after layer and, after each, calls
:meth:`LayerCounter.complete`:

* on CUDA it records one event per layer on the copy stream (nothing waits on
  the host for the copy), and ``wait_until(l)`` makes the *forward's* stream
  wait for event ``l`` (``wait_event``, on the GPU). A ``wait_event`` on an event
  not recorded yet is a no-op, so ``wait_until`` first waits on the host until
  the loader has *recorded* event ``l``; enqueueing is quick, so that wait is
  short, and the copy itself overlaps the forward's earlier layers;
* on CPU a copy is synchronous, so "recorded" means "landed" and the host wait
  is the whole wait.

:meth:`LayerCounter.finish` (after the forward) waits on the host until every
layer was enqueued, orders the current stream after the last copy, and returns
whether all of them were; :meth:`LayerCounter.done_event` tells when the copies
have really ended (the rows they read can be reused then), to be polled, never
waited on. Where the engine cannot be told that a batch failed (SGLang 0.5.21:
the loaded pages are in its tree before the copy), :attr:`LayerCounter.redo` is
set: the forward's first wait on a failed batch copies the batch again itself,
from the rows its plans still pin, before it reads a layer. Imports torch only
(no SGLang): the GPU suite runs it on a bare machine.
"""

from __future__ import annotations

import threading
from typing import Callable, Optional

import torch


class _Batch:
    """One forward's loads: how many layers the loader has recorded so far (in layer order), and their events.

    One condition per batch, not one per layer (a forward of 80 layers made 80 ``threading.Event``\\ s on the
    scheduler thread); batches are reused once forgotten, CUDA events and all (their copies ended).
    """

    __slots__ = ("recorded", "events", "error", "cv")

    def __init__(self, num_layers: int, cuda: bool) -> None:
        self.cv = threading.Condition(threading.Lock())
        self.recorded = 0
        self.events = [torch.cuda.Event() for _ in range(num_layers)] if cuda else None
        self.error: Optional[BaseException] = None

    def wait(self, layers: int) -> None:
        """Until the first ``layers`` layers are recorded (or the batch failed)."""
        if self.recorded >= layers:  # the usual case: no lock
            return
        with self.cv:
            self.cv.wait_for(lambda: self.recorded >= layers)


class LayerCounter:
    def __init__(self, num_layers: int, *, cuda: bool = False) -> None:
        self.num_layers = num_layers
        self.cuda = cuda
        self.producer_index = -1
        self.consumer_index = -1
        self._batches: dict[int, _Batch] = {}
        self._spare: list[_Batch] = []  # forgotten batches, reused
        self._lock = threading.Lock()
        # redo(index): copy batch ``index`` again on this thread (all layers), raising if it cannot; None: a failed
        # batch is reported by finish() and the engine drops its requests
        self.redo: Optional[Callable[[int], None]] = None

    def update_producer(self) -> int:
        """A new batch of loads; its index is what the forward consumes (``set_consumer``)."""
        with self._lock:
            batch = self._spare.pop() if self._spare else _Batch(self.num_layers, self.cuda)
            self.producer_index += 1
            self._batches[self.producer_index] = batch
            return self.producer_index

    def set_consumer(self, index: int) -> None:
        self.consumer_index = index

    def consuming(self) -> bool:
        """Whether the forward now consumes a batch of loads (tests and tools)."""
        return self._batch(self.consumer_index) is not None

    def _batch(self, index: int) -> Optional[_Batch]:
        with self._lock:
            return self._batches.get(index)

    def complete(self, index: int, layer: int) -> None:
        """Loader thread: layer ``layer`` of batch ``index`` is enqueued (CUDA: on the current stream) or done."""
        batch = self._batch(index)
        if batch is None:
            return
        if batch.events is not None:
            batch.events[layer].record()
        with batch.cv:
            batch.recorded = layer + 1
            batch.cv.notify_all()

    def fail(self, index: int, error: BaseException) -> None:
        """Loader thread: the batch cannot land; layers not recorded yet are released as failed."""
        with self._lock:  # not forgotten (and reused) under it
            batch = self._batches.get(index)
            if batch is None:
                return
            with batch.cv:
                batch.error = error
                batch.recorded = self.num_layers
                batch.cv.notify_all()

    def wait_until(self, layer: int) -> None:
        """Forward: layer ``layer`` of the consumed batch is readable after this (on the current stream).

        A failure does not raise into the forward: it runs on whatever the slots
        hold, and :meth:`finish` reports the failure so the scheduler drops the
        requests before their output is used.
        """
        batch = self._batch(self.consumer_index)
        if batch is None:
            return
        batch.wait(layer + 1)
        if batch.error is not None and self.redo is not None:
            self._redo(self.consumer_index, batch)
        elif batch.events is not None and batch.error is None:
            torch.cuda.current_stream().wait_event(batch.events[layer])

    def _redo(self, index: int, batch: _Batch) -> None:
        """The engine reads this batch's pages whatever happens: copy them again here (CUDA: on the current stream,
        which the forward's reads follow), or stop the forward."""
        try:
            self.redo(index)
        except BaseException as exc:
            raise RuntimeError(
                "kvbm: a layer-wise load failed, and copying it again from the rows it pinned failed too; this SGLang "
                "cannot be told that a load failed (its tree holds the pages already), so the forward stops here "
                "rather than read wrong KV"
            ) from exc
        batch.error = None
        batch.events = None  # landed on the current stream: nothing of the loader's to wait for

    def recorded_all(self, index: int) -> bool:
        """Whether every layer of batch ``index`` was handed over or failed (no wait)."""
        batch = self._batch(index)
        return batch is None or batch.recorded >= self.num_layers

    def finish(self, index: int) -> bool:
        """After the forward: wait until every layer was enqueued; True when all of them landed (or will)."""
        batch = self._batch(index)
        if batch is None:
            return True
        batch.wait(self.num_layers)
        if batch.error is not None and self.redo is not None:
            self._redo(index, batch)
        if batch.events is not None and batch.error is None:
            torch.cuda.current_stream().wait_event(batch.events[-1])  # nothing later on this stream overtakes it
        return batch.error is None

    def done_event(self, index: int) -> Optional[torch.cuda.Event]:
        """The event after the last copy of batch ``index`` (CUDA; None on CPU or when it failed)."""
        batch = self._batch(index)
        if batch is None or batch.events is None or batch.error is not None:
            return None
        return batch.events[-1]

    def forget(self, index: int) -> None:
        """Batch ``index`` is over (its copies ended): its condition and events serve a later batch."""
        with self._lock:
            batch = self._batches.pop(index, None)
            if batch is not None and (batch.events is not None or not self.cuda):  # a redone batch's events are gone
                batch.recorded, batch.error = 0, None
                self._spare.append(batch)

    def reset(self) -> None:
        with self._lock:
            self.producer_index = -1
            self.consumer_index = -1
            self._batches.clear()
