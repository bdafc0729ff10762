"""The truth about a worker's tiers: how many tokens of a sequence each tier would serve now.

Cumulative, as Dynamo's indexer reports them (``gpu``, ``cpu``, ``disk`` in its
``/query`` answer): ``device`` from the device pool alone, ``host`` from device
and host, ``disk`` from all three; whole pages only. Read-only: nothing is
split, touched or loaded. It must run on the scheduler thread (the tree and
the tiers are that thread's); other threads ask through :class:`TierQueries`,
which the scheduler thread answers once per step.
"""

from __future__ import annotations

import dataclasses
import queue
from array import array
from concurrent.futures import Future

from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.utils import get_storage_hash_str

from sglang_kvbm.core.connector import KvbmConnector
from sglang_kvbm.core.tiers import DEVICE, DISK, HOST


@dataclasses.dataclass(frozen=True)
class TierTokens:
    device: int
    host: int
    disk: int
    beyond: tuple = dataclasses.field(default=(), compare=False, repr=False)  # block ids past ``disk``: remote tiers' to answer

    def counts(self) -> dict:
        return {DEVICE.name: self.device, HOST.name: self.host, DISK.name: self.disk}


def tier_tokens(cache, connector: KvbmConnector, token_ids, *, extra_key=None, cache_salt=None,
                sidecars=None) -> TierTokens:
    """Tokens of ``token_ids`` each tier would serve now. A hybrid model's (``sidecars``): only up to the last
    boundary whose sliding-window pages or Mamba state are held too (the KV events alone over-state it)."""
    ps = cache.page_size
    bigram = cache is not None and cache.tree_core.is_eagle  # EAGLE: keys are (token, next token) pairs
    key = RadixKey(array("q", token_ids), extra_key, cache_salt=cache_salt, is_bigram=bigram).page_aligned(ps)
    if len(key) == 0:
        return TierTokens(0, 0, 0)
    device = cache.tree_core.match_full_device_prefix(key)[0] // ps * ps if cache is not None else 0
    rest = get_storage_hash_str(key, None, page_size=ps)[device // ps :]
    host, lower = connector.peek(rest)
    if sidecars:
        host, lower = sidecars.longest(rest, host), sidecars.longest(rest, lower)
    return TierTokens(device, device + host * ps, device + lower * ps, tuple(rest[lower:]))


class TierQueries:
    """Questions from other threads (the HTTP endpoint), answered between scheduler steps."""

    def __init__(self, answer, maxsize: int = 256) -> None:
        self._answer = answer
        self._queue: queue.Queue = queue.Queue(maxsize=maxsize)

    def ask(self, token_ids, *, extra_key=None, cache_salt=None, timeout: float = 10.0) -> TierTokens:
        future: Future = Future()
        self._queue.put((list(token_ids), extra_key, cache_salt, future), timeout=timeout)
        return future.result(timeout=timeout)

    def answer_pending(self) -> None:
        """Scheduler thread: answer every queued question (cheap when there is none)."""
        while not self._queue.empty():
            try:
                token_ids, extra_key, cache_salt, future = self._queue.get_nowait()
            except queue.Empty:
                return
            try:
                future.set_result(self._answer(token_ids, extra_key=extra_key, cache_salt=cache_salt))
            except Exception as exc:  # reported to the asking thread, never raised in the scheduler
                future.set_exception(exc)

