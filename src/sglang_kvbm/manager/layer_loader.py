"""Loads into the device pool one layer at a time, off the scheduler thread.

SGLang's forward waits on the layer it is about to read
(``MHATokenToKVPool.get_key_buffer`` -> the layer counter's ``wait_until``),
so while layer 0 computes, layer 1 is being copied. The scheduler thread only
hands over a batch (:meth:`LayerLoader.start`) with the events its slots are
ready after; this loader's thread enters its own stream after them
(``PagedKvLayout.copying``), computes the device pages there, and copies layer
after layer, marking each one on the counter (``layer_counter``): on CPU once
it has landed, on CUDA once it is enqueued (the counter records the layer's
event; nothing here waits for the device). A batch that fails is failed on the
counter, after the copies it enqueued have ended.

Sidecar pools (sliding-window pages, Mamba states: ``sidecars``) load in the
same pass, each from its own tiers into its own pool, on the layers its
layout maps; one layer is complete once every pool's part of it is.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable, Optional, Sequence

from sglang_kvbm.core.tiers import HOST
from sglang_kvbm.manager.block_manager import LocalBlockManager
from sglang_kvbm.transfer import copies

logger = logging.getLogger(__name__)


class LayerLoader:
    def __init__(
        self,
        manager: LocalBlockManager,
        counter,
        *,
        sidecars: Optional[dict[str, LocalBlockManager]] = None,
        observe: Callable[[str, int, float], None] = lambda path, nbytes, seconds: None,
        before_layer: Optional[Callable[[int, int], None]] = None,
    ) -> None:
        """``before_layer(index, layer)`` runs on the loader thread before each layer (tests hold layers back)."""
        self._manager = manager
        self._layout = manager.layout
        self._sidecars = dict(sidecars or {})
        self._counter = counter
        self._observe = observe
        self.before_layer = before_layer
        self._stream = self._layout.new_stream()  # this thread's own, drawn before it starts
        self._init = self._layout.worker_init()
        self._queue: queue.Queue = queue.Queue()
        self._idle = threading.Condition()
        self._busy = 0
        self._batches: dict[int, list] = {}  # counter index -> its loads, until forgotten (for redo)
        self._thread = threading.Thread(target=self._run, name="kvbm-load", daemon=True)
        self._thread.start()

    def start(self, loads: Sequence[tuple], ready: Sequence = ()) -> int:
        """Queue one forward's loads to run after ``ready``; returns the counter index.

        A load is ``(plan, device token slots)``, or ``(plan, slots, {sidecar: (plan, its device slots)})``.
        """
        index = self._counter.update_producer()
        loads = list(loads)
        self._batches[index] = loads
        with self._idle:
            self._busy += 1
        self._queue.put((index, loads, tuple(ready)))
        return index

    def redo(self, index: int) -> None:
        """Copy batch ``index`` again, every layer, on the calling thread (CUDA: its current stream); its plans
        still pin the rows it reads (``LayerCounter.redo``)."""
        for pool_layout, batch in self._copy_batches(self._batches[index], record=False):
            for layer in range(self._layout.num_layers):
                copies.load_layer(pool_layout, batch, layer)

    def forget(self, index: int) -> None:
        self._batches.pop(index, None)

    def _run(self) -> None:
        if self._init is not None:
            self._init()
        while True:
            task = self._queue.get()
            if task is None:
                return
            index, loads, ready = task
            try:
                self._load(index, loads, ready)
            except BaseException as exc:  # reported by finish(): the scheduler drops the loading requests
                logger.exception("kvbm: layer-wise load failed")
                if self._stream is not None:
                    self._stream.synchronize()  # what was enqueued ends before the rows it reads are let go
                self._counter.fail(index, exc)
            finally:
                with self._idle:
                    self._busy -= 1
                    self._idle.notify_all()

    def _load(self, index: int, loads, ready) -> None:
        started = time.perf_counter()
        layout = self._layout
        with layout.copying(self._stream, ready):
            batches = self._copy_batches(loads, record=layout.is_cuda)
            for layer in range(layout.num_layers):
                if self.before_layer is not None:
                    self.before_layer(index, layer)
                for pool_layout, batch in batches:
                    copies.load_layer(pool_layout, batch, layer)
                self._counter.complete(index, layer)
        if not layout.is_cuda:  # on CUDA this is the enqueue time, not the copy's: not a transfer figure
            nbytes = sum(batch.blocks[HOST.name] * pool_layout.page_bytes for pool_layout, batch in batches)
            self._observe("onboard_h2d", nbytes, time.perf_counter() - started)

    def _copy_batches(self, loads, *, record: bool) -> list:
        """Per pool, what the copies of ``loads`` read and write (``record``: slots are read on this thread's
        stream)."""
        pools = [(self._layout, self._manager, [load[:2] for load in loads])]
        pools += [(manager.layout, manager, [load[2][name] for load in loads if len(load) > 2 and name in load[2]])
                  for name, manager in self._sidecars.items()]
        batches = []
        for pool_layout, manager, pool_loads in pools:
            parts = []
            for plan, slots in pool_loads:
                if record:
                    slots.record_stream(self._stream)  # made on the scheduler's stream, read on this one
                parts += manager.load_parts(plan, pool_layout.pages_of(slots))
            batches.append((pool_layout, copies.load_batch(pool_layout, parts)))
        return batches

    def wait_idle(self, timeout: Optional[float] = None) -> bool:
        """Wait until every queued batch has been handed to the device (reset and close)."""
        with self._idle:
            return self._idle.wait_for(lambda: self._busy == 0, timeout)

    def close(self) -> None:
        self.wait_idle()
        self._queue.put(None)
        self._thread.join(timeout=10)
