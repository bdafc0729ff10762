"""One worker thread with two queues: what someone waits for runs before background work.

The disk has one writer and one reader thread (each owns its staging buffers,
see ``disk.store``), and each serves two kinds of work:

* the writer: device -> disk copies, whose completions the tree waits for in
  order (a node stays locked on the device until its offload is reported),
  and background host -> disk copies, which nobody waits for;
* the reader: prefetches started by lookups of queued requests, and the reads
  a load is blocked on right now.

A plain FIFO puts the first kind behind any amount of the second. Here a job
is submitted ``urgent`` or not, and a queued background job can be promoted
(:meth:`LaneExecutor.promote`) when something starts waiting for it. Jobs
already running are never interrupted, so callers keep background jobs small.
"""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Executor, Future
from typing import Callable, Optional


class LaneExecutor(Executor):
    def __init__(self, thread_name: str, initializer: Optional[Callable[[], None]] = None) -> None:
        """``initializer`` runs first on the thread (a CUDA copy worker's device and staging, see ``cuda_copies``)."""
        self._initializer = initializer
        self._cv = threading.Condition()
        self._urgent: deque = deque()
        self._background: deque = deque()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=thread_name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable, /, *args, **kwargs) -> Future:
        """Queue background work (behind every urgent job)."""
        return self._put(self._background, fn, args, kwargs)

    def submit_urgent(self, fn: Callable, /, *args, **kwargs) -> Future:
        """Queue work someone waits for: it runs after the job running now and other urgent ones."""
        return self._put(self._urgent, fn, args, kwargs)

    def _put(self, lane: deque, fn, args, kwargs) -> Future:
        future: Future = Future()
        with self._cv:
            if self._closed:
                raise RuntimeError("cannot schedule new work after shutdown")
            lane.append((future, fn, args, kwargs))
            self._cv.notify()
        return future

    def promote(self, futures) -> None:
        """Move these queued background jobs to the urgent lane, keeping their order (running ones stay)."""
        wanted = set(futures)
        with self._cv:
            moving = [job for job in self._background if job[0] in wanted]
            if moving:
                for job in moving:
                    self._background.remove(job)
                self._urgent.extend(moving)

    def _next(self) -> Optional[tuple]:
        with self._cv:
            while not (self._urgent or self._background or self._closed):
                self._cv.wait()
            if self._urgent:
                return self._urgent.popleft()
            if self._background:
                return self._background.popleft()
            return None

    def _run(self) -> None:
        if self._initializer is not None:
            self._initializer()
        while (job := self._next()) is not None:
            future, fn, args, kwargs = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args, **kwargs)
            except BaseException as exc:
                future.set_exception(exc)
            else:
                future.set_result(result)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._cv:
            self._closed = True
            if cancel_futures:
                for lane in (self._urgent, self._background):
                    for future, *_ in lane:
                        future.cancel()
                    lane.clear()
            self._cv.notify_all()
        if wait and self._thread is not threading.current_thread():
            self._thread.join()
