"""What handing work to an idle thread costs the thread that hands it over (the scheduler's, in a server).

The linker hands each step's device -> host copies to its copy thread (``Offloads.flush``
-> ``LaneExecutor``, a ``threading.Condition``) and each forward's loads to its loader
thread (``LayerLoader.start``, a ``queue.Queue``). In a server both threads sleep between
steps, so each hand-over wakes a sleeping thread: a futex wake-up, plus the woken thread
asking for the GIL the scheduler holds. ``critical_path.py`` counts both in the cache
calls; this script measures them alone, on whatever machine runs it, so a figure read
on one machine (a VM here) can be told from one read on another.

For each way of handing over (a ``Condition`` as ``LaneExecutor`` does, ``queue.Queue``
as the loader does, ``queue.SimpleQueue``), the handing thread's wall and CPU time per
hand-over: to a thread idle for ``--idle`` ms while the hander works (spins) or sleeps,
and, as the baseline measured in the same run, to a thread already awake (no sleep in
between). Medians over ``--repeats``.

    python benchmarks/thread_wake.py
    python benchmarks/thread_wake.py --idle 0.1,3,20 --repeats 2000
"""

from __future__ import annotations

import argparse
import queue
import statistics
import sys
import threading
import time

from common import table


class ConditionLane:
    """``LaneExecutor``'s hand-over: a deque under a ``Condition``."""

    def __init__(self) -> None:
        self.cv, self.jobs = threading.Condition(), []

    def put(self, job) -> None:
        with self.cv:
            self.jobs.append(job)
            self.cv.notify()

    def get(self):
        with self.cv:
            while not self.jobs:
                self.cv.wait()
            return self.jobs.pop()


def worker(lane) -> None:
    while (job := lane.get()) is not None:
        job.set()


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def measure(lane, idle_s: float, hander: str, repeats: int) -> tuple[float, float]:
    """Median wall and CPU microseconds of one ``put`` (the worker idle for ``idle_s`` first; 0: right after)."""
    walls, cpus = [], []
    for _ in range(repeats):
        if idle_s:
            (spin if hander == "spins" else time.sleep)(idle_s)
        done = threading.Event()
        wall, cpu = time.perf_counter(), time.thread_time()
        lane.put(done)
        walls.append(time.perf_counter() - wall)
        cpus.append(time.thread_time() - cpu)
        done.wait()
    return statistics.median(walls) * 1e6, statistics.median(cpus) * 1e6


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--idle", default="0.1,3", help="ms the worker sleeps before each hand-over, comma-separated")
    parser.add_argument("--repeats", type=int, default=1000)
    args = parser.parse_args(argv)
    lanes = {"Condition (LaneExecutor)": ConditionLane(), "queue.Queue (loader)": queue.Queue(),
             "queue.SimpleQueue": queue.SimpleQueue()}
    threads = [threading.Thread(target=worker, args=(lane,), daemon=True) for lane in lanes.values()]
    for thread in threads:
        thread.start()
    rows = []
    for name, lane in lanes.items():
        awake_wall, awake_cpu = measure(lane, 0.0, "-", args.repeats)
        rows.append([name, "awake (baseline)", "-", awake_wall, awake_cpu, 1.0])
        for idle in (float(ms) / 1e3 for ms in args.idle.split(",")):
            for hander in ("spins", "sleeps"):
                wall, cpu = measure(lane, idle, hander, args.repeats)
                rows.append([name, f"idle {idle * 1e3:g} ms", hander, wall, cpu, cpu / max(awake_cpu, 1e-9)])
    print(table(["hand-over", "worker", "hander meanwhile", "wall us", "CPU us", "CPU / awake"], rows))
    for lane in lanes.values():
        lane.put(None)
    for thread in threads:
        thread.join(timeout=5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
