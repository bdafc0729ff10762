"""G4: blocks in a Mooncake Store that every worker of a fleet reads and writes.

One object per block, named as SGLang's HiCache names its L3 pages on Mooncake
(``mem_cache/storage/mooncake_store/mooncake_store.py``: ``{tag}_{model}_{page
hash}_{tp rank}_k``, ``..._{page hash}__k`` for MLA), so the names Dynamo's
router derives from request tokens (``--shared-cache-type hicache``) are ours
too. The tag carries the server's identity (the disk tier's fingerprint: model,
weights, KV dtype and layout, pool shape, TP/PP sizes; not the rank, which the
name's suffix carries as SGLang's does, so every rank of a worker shares the tag
the router is told), so a server of another identity never reads these objects;
a namespaced page (``cache_salt``, LoRA) has a namespaced hash already. One
object holds a rank's K and V together (SGLang writes ``_k`` and ``_v``):
:mod:`sglang_kvbm.tiers.mooncake.events` announces it under both names.

An object is the disk tier's slot, byte for byte: a header row (``tiers.format``:
block id, identity, xxh3 of the block, token ids, event identity) then the
block row. Both go out from registered host memory without a copy
(``batch_put_from_multi_buffers``) and come back the same way into staging rows,
where the header and checksum are verified before any byte may reach the
device: a missing, evicted, foreign or damaged object is a miss.

Mooncake's calls block and answer with error codes, never exceptions; with the
master gone each one takes ~4.5 s to fail (its batch calls let go of the GIL
meanwhile, measured; ``setup`` does not: see :meth:`MooncakeStore.connect`). So every
call runs on the G4 thread (never the scheduler's), and the first RPC failure
marks the store down for ``retry_s``: calls in that window answer "miss" at once.
A write names its objects, and signs its headers, with the identity it is given
(the one its block was queued under: see ``writes.MooncakeWrites``), not whatever the
store is re-keyed to meanwhile.

Not Mooncake's own ``MooncakeStore`` (SGLang's ``HiCacheStorage``): it moves
bytes only to and from SGLang's host KV pool, in raw pages without a header,
so nothing it reads could be verified. Stock HiCache workers and this library
therefore do not read each other's objects (the names match, the tags differ).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from typing import Optional, Sequence

import torch

from sglang_kvbm.core.identity import BlockId
from sglang_kvbm.core.pages import Page
from sglang_kvbm.tiers.block_objects import sign, tag_of, verify
from sglang_kvbm.tiers.format import header_bytes_for
from sglang_kvbm.tiers.heartbeat import Heartbeat
from sglang_kvbm.tiers.mooncake import listeners
from sglang_kvbm.tiers.mooncake.probe import endpoints, unreachable_endpoints

logger = logging.getLogger(__name__)

RPC_FAIL = -900  # the master did not answer (Mooncake's ErrorCode::RPC_FAIL)


@dataclasses.dataclass(frozen=True)
class MooncakeSettings:
    master: str  # host:port of mooncake_master's RPC
    metadata: str  # P2PHANDSHAKE (no metadata server), or a metadata server's URL
    protocol: str = "tcp"
    segment_bytes: int = 0  # memory this worker lends the store (0: a standalone store process lends it)
    local_buffer_bytes: int = 16 << 20
    hostname: str = "127.0.0.1"  # what this client advertises to the others


def key_prefix(tag: str, model_name: str) -> str:
    """SGLang's ``MooncakeStore`` key prefix: its ``extra_backend_tag`` and the served model name."""
    return "_".join(part for part in (tag, model_name.replace("/", "-")) if part)


def object_suffix(tp_rank: int, *, mla: bool = False, pp_rank: int = 0, pp_size: int = 1) -> str:
    """What follows the page hash in SGLang's ``MooncakeStore`` names (``mha_suffix``/``mla_suffix`` + ``_k``):
    ``_{tp}_k`` (``_{tp}_{pp}_k`` under PP) for MHA; MLA's latent is the same on every TP rank: ``__k``
    (``_{pp}_k``)."""
    if mla:
        return f"_{pp_rank}_k" if pp_size > 1 else "__k"
    return f"_{tp_rank}_{pp_rank}_k" if pp_size > 1 else f"_{tp_rank}_k"


class MooncakeStore:
    def __init__(
        self, settings: MooncakeSettings, *, fingerprint: bytes, model_name: str, suffix: str, page_size: int,
        block_bytes: int, retry_s: float = 5.0,
    ) -> None:
        self.settings = settings
        self.model_name = model_name
        self.rekey(fingerprint)
        self.suffix = suffix  # object_suffix(): the rank's part of every name
        self.header_bytes = header_bytes_for(page_size)
        self.block_bytes = block_bytes
        self.retry_s = retry_s
        self._client = None
        self._lent: list[torch.Tensor] = []  # host memory Mooncake moves bytes to and from, registered on connect
        self._down_until = 0.0
        self.last_fault = float("-inf")  # monotonic time of the last failed call (the master may have lost objects)
        self._closed = False
        self._heartbeat: Optional[Heartbeat] = None
        self._lock = threading.Lock()  # one call at a time (register, reads, writes come from different threads)
        self.stats = {"written": 0, "read": 0, "misses": 0, "rejected": 0, "removed": 0, "down": 0,
                      # the write-through's (writes.MooncakeWrites): blocks not queued (queue full), writes dropped (a
                      # reset or re-key since queued), queued again (failed, or offered while down), given up, and
                      # written again (G4 had lost them: a master restart)
                      "write_queue_full": 0, "write_stale": 0, "write_retried": 0, "write_gave_up": 0, "rewritten": 0}

    def rekey(self, fingerprint: bytes) -> None:
        """Read and write under another identity from now on (weights replaced in memory: see ``weight_updates``)."""
        self.fingerprint = fingerprint
        self.tag = tag_of(fingerprint)  # SGLang's extra_backend_tag, as Dynamo's router is told it
        self.prefix = key_prefix(self.tag, self.model_name)

    def key(self, block_id: BlockId, fingerprint: Optional[bytes] = None) -> str:
        """The object's name under this store's identity, or under ``fingerprint``."""
        prefix = self.prefix if fingerprint is None else key_prefix(tag_of(fingerprint), self.model_name)
        return f"{prefix}_{block_id}{self.suffix}"

    # -- connection -------------------------------------------------------------------------

    def connect(self) -> bool:
        """Join the store; False (logged, retried by later calls) when the master does not answer.

        Mooncake's ``setup`` holds the GIL while it waits for a master that is
        not there (measured: 90 s, every thread of the process stopped), so the
        master and the metadata server are first probed with a plain TCP
        connect, which does not.
        """
        if self._client is not None:
            return True
        if self._closed:
            return False
        unreachable = unreachable_endpoints(self.settings.master, self.settings.metadata)
        if unreachable:
            self._fail(f"{', '.join(unreachable)} did not accept a connection")
            return False
        from mooncake.store import MooncakeDistributedStore

        s = self.settings
        # What the client advertises to its peers (Mooncake reads it at setup; without it, the host's first
        # address even beside a local master). It moves no listener: those are on every address (README).
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", s.hostname)
        client = MooncakeDistributedStore()
        before = listeners.snapshot()
        rc = client.setup(s.hostname, s.metadata, s.segment_bytes, s.local_buffer_bytes, s.protocol, "", s.master)
        if rc != 0:
            self._fail(f"setup returned {rc} (master {s.master}, metadata {s.metadata})")
            return False
        listeners.log_opened(logger, before)  # what setup opened, bound where
        for tensor in self._lent:
            self._register(client, tensor)
        self._client = client
        logger.info("kvbm: G4 joined Mooncake master %s as %s (lends %d bytes, objects %s_<page>%s)",
                    s.master, client.get_hostname(), s.segment_bytes, self.prefix, self.suffix)
        return True

    def start_heartbeat(self, **kwargs) -> None:
        """Ask the master (and the metadata server) about once a second whether they answer (``tiers.heartbeat``):
        a lost master marks G4 down within about two seconds, and its first answer marks it up again."""
        if self._heartbeat is None and not self._closed:
            self._heartbeat = Heartbeat("g4", lambda: endpoints(self.settings.master, self.settings.metadata),
                                        self._fail, self._answers_again, **kwargs)

    def _answers_again(self) -> None:
        self._down_until = 0.0
        logger.info("kvbm: G4 (Mooncake) master %s answers again: G4 is up", self.settings.master)

    @property
    def down(self) -> bool:
        """Marked down after a failure, until ``retry_s`` passed (cheap: any thread may ask)."""
        return time.monotonic() < self._down_until

    @property
    def available(self) -> bool:
        """Up and connected (connects, when it was not, on the calling thread: the G4 thread's business)."""
        return not self.down and (self._client is not None or self.connect())

    def _fail(self, why: str) -> None:
        self.last_fault = time.monotonic()
        if time.monotonic() >= self._down_until:
            logger.warning("kvbm: G4 (Mooncake) unavailable: %s; its blocks are misses for the next %.0f s",
                           why, self.retry_s)
            self.stats["down"] += 1
        self._down_until = time.monotonic() + self.retry_s

    @property
    def connected(self) -> bool:
        return self._client is not None

    def register_dram(self, tensor: torch.Tensor) -> None:
        """Let Mooncake move bytes to and from ``tensor`` without a copy (host slab, staging, header rows);
        registered now, or when it connects (``DiskStore.register_dram``'s counterpart)."""
        self._lent.append(tensor)
        if self._client is not None:
            with self._lock:
                self._register(self._client, tensor)

    @staticmethod
    def _register(client, tensor: torch.Tensor) -> None:
        rc = client.register_buffer(tensor.data_ptr(), tensor.numel() * tensor.element_size())
        if rc != 0:
            raise RuntimeError(f"Mooncake register_buffer returned {rc}")

    def close(self) -> None:
        """Leave the store (what this worker lent leaves with it); later calls answer "miss" and never reconnect."""
        self._closed = True
        if self._heartbeat is not None:
            self._heartbeat.stop()
        with self._lock:  # after the call under way, if any
            client, self._client = self._client, None
            if client is not None:
                client.close()

    # -- blocks (a worker thread: each call may block for seconds when the master is lost) -------------

    def contains(self, block_ids: Sequence[BlockId], fingerprint: Optional[bytes] = None) -> list[bool]:
        if not block_ids or not self.available:
            return [False] * len(block_ids)
        keys = [self.key(b, fingerprint) for b in block_ids]
        with self._lock:
            if self._client is None:  # closed meanwhile
                return [False] * len(block_ids)
            found = self._client.batch_is_exist(keys)
        if any(f == RPC_FAIL for f in found):
            self._fail("the master did not answer a lookup")
            return [False] * len(block_ids)
        return [f == 1 for f in found]

    def write(self, metas: Sequence[Page], rows: Sequence[torch.Tensor], headers: Sequence[torch.Tensor],
              fingerprint: Optional[bytes] = None) -> list[bool]:
        """Put each block (its header into ``headers[i]``, then ``rows[i]``) under this store's identity, or under
        ``fingerprint`` (names and headers both); an object already there is kept."""
        fingerprint = self.fingerprint if fingerprint is None else fingerprint
        if not metas or not self.available:
            return [False] * len(metas)
        sent, ptrs = [], []  # indices of the blocks whose header fits, and their buffers
        for i, (meta, row, header) in enumerate(zip(metas, rows, headers)):
            if not sign(meta, row, header, fingerprint):  # a header too large: this block is simply not shared
                continue
            sent.append(i)
            ptrs.append([header.data_ptr(), row.data_ptr()])
        keys = [self.key(metas[i].block_id, fingerprint) for i in sent]
        with self._lock:
            if self._client is None:  # closed meanwhile
                return [False] * len(metas)
            results = self._client.batch_put_from_multi_buffers(
                keys, ptrs, [[self.header_bytes, self.block_bytes]] * len(keys)) if keys else []
        if any(r == RPC_FAIL for r in results):
            self._fail("the master did not answer a write")
        ok = [False] * len(metas)
        for i, result in zip(sent, results):
            ok[i] = result == 0
        self.stats["written"] += sum(ok)
        return ok

    def read(self, block_ids: Sequence[BlockId], rows: Sequence[torch.Tensor], headers: Sequence[torch.Tensor]
             ) -> list[Optional[Page]]:
        """Get each block into ``rows[i]`` (its header into ``headers[i]``) and verify it: its meta, or None (a miss)."""
        if not block_ids or not self.available:
            return [None] * len(block_ids)
        keys = [self.key(b) for b in block_ids]
        ptrs = [[h.data_ptr(), r.data_ptr()] for h, r in zip(headers, rows)]
        sizes = [[self.header_bytes, self.block_bytes]] * len(keys)
        with self._lock:
            if self._client is None:  # closed meanwhile
                return [None] * len(block_ids)
            got = self._client.batch_get_into_multi_buffers(keys, ptrs, sizes)
        if any(g == RPC_FAIL for g in got):
            self._fail("the master did not answer a read")
        out: list[Optional[Page]] = []
        rejected = []
        for block_id, n, row, header in zip(block_ids, got, rows, headers):
            meta = self._verify(block_id, n, row, header)
            out.append(meta)
            self.stats["read" if meta is not None else "misses"] += 1
            if meta is None and n >= 0:
                rejected.append(keys[len(out) - 1])
        if rejected:
            self._remove(rejected)
        return out

    def _remove(self, keys: list[str]) -> None:
        """Delete objects that failed verification: Mooncake keeps an existing key on a put, so a damaged
        object left in place would stay a miss for every worker until evicted; removed, the next write
        of the block (the request that recomputes it writes through) replaces it."""
        with self._lock:
            if self._client is None:
                return
            results = [self._client.remove(key, True) for key in keys]  # force: ignore leases of readers
        self.stats["removed"] += sum(r == 0 for r in results)

    def _verify(self, block_id: BlockId, n: int, row: torch.Tensor, header_row: torch.Tensor) -> Optional[Page]:
        if n < 0:
            return None  # not there (evicted, never written, its lender gone): a plain miss
        if n != self.header_bytes + self.block_bytes:
            meta, reason = None, f"not a block object ({n} bytes)"
        else:
            meta, reason = verify(block_id, row, header_row, self.fingerprint)
        if meta is None:
            self.stats["rejected"] += 1
            logger.warning("kvbm: G4 object %s rejected (%s); the request recomputes it", self.key(block_id), reason)
        return meta
