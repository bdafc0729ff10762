"""Measure prefill cost while serving, for the disk onboarding decision.

The cache never sees a forward pass, so the factory wraps *this scheduler's*
model worker instance (never the class, never another process) to time extend
batches: on CPU by wall clock around the synchronous call, on CUDA with events
resolved later without synchronising. Batches that load from the tiers are
not timed: their forward waits for the loads too.
"""

from __future__ import annotations

import collections
import functools
import time
from typing import Any

import torch

from sglang_kvbm.core.onboard_policy import LinearCostMeter


def attach_prefill_meter(tp_worker: Any, meter: LinearCostMeter) -> None:
    original = tp_worker.forward_batch_generation
    on_cuda = torch.cuda.is_available() and str(getattr(tp_worker, "device", "cpu")).startswith("cuda")
    pending: collections.deque = collections.deque()

    def drain() -> None:
        while pending and pending[0][1].query():
            start, end, tokens = pending.popleft()
            meter.record(tokens, start.elapsed_time(end) / 1e3)

    @functools.wraps(original)
    def timed(batch=None, *args, **kwargs):
        mode = getattr(batch, "forward_mode", None)
        tokens = getattr(batch, "extend_num_tokens", None)
        # A batch with loads from the tiers (a consumer index) also waits for them, layer by layer: its time is not
        # the prefill of its new tokens alone, and would make recomputing look dearer than it is.
        loading = getattr(batch, "hicache_consumer_index", -1) >= 0
        if mode is None or not mode.is_extend() or not tokens or loading:
            return original(batch, *args, **kwargs)
        if on_cuda:
            drain()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = original(batch, *args, **kwargs)
            end.record()
            pending.append((start, end, tokens))
            return out
        began = time.perf_counter()
        out = original(batch, *args, **kwargs)
        meter.record(tokens, time.perf_counter() - began)
        return out

    tp_worker.forward_batch_generation = timed
