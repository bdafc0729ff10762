"""KVBM's G4: blocks as objects in an S3-compatible bucket, moved by NIXL's ``OBJ`` backend (it ships in ``nixl``).

One object per block, ``<identity tag>/<block id>``: the disk tier's slot byte
for byte (``block_objects``). What NIXL's OBJ backend does, measured against
an S3 emulator (nixl 1.3.2, its bundled aws-sdk-cpp 1.11.760; README "Object
tier") and how this module answers it:

* A write's object must come from one buffer at offset 0, so header and block
  are copied into a bounce row and put from there; a read gets the whole
  object into a bounce row, where it is verified before it is copied to the
  staging rows it was asked into. A failed GET writes S3's error text into its
  buffer and a short object leaves the rest of it stale: verification (header,
  identity, checksum) turns both into misses.
* A transfer that fails raises while its other requests may still be writing
  into their buffers, and releasing the handle cancels nothing: the bounce
  buffer of a failed transfer is never used again (it is freed
  :data:`ABANDON_S` later), and the store is marked down for ``retry_s``.
* The SDK retries a refused connection for 25 s and a hung server for up to
  136 s by default; the plugin has no setting for it. ``AWS_RETRY_MODE=standard``
  with ``AWS_MAX_ATTEMPTS`` set (here 1, unless set already, before the backend
  is made) bounds it (1 attempt measured: milliseconds refused, 3-10 s hung); a
  single attempt failed a HEAD now and then on a loaded 2-core machine.
* Which objects exist: ``query_memory`` sends one HEAD per key.
* Object descriptors are registered per transfer (a few microseconds a key),
  each under a device id never used before: the plugin maps ids to keys, and
  an id registered again would move another key's writes.

Every call runs on the tier's own thread (NIXL lets go of the GIL meanwhile).
"""

from __future__ import annotations

import itertools
import logging
import os
import time
import urllib.parse
from typing import NamedTuple, Optional, Sequence

import torch

from sglang_kvbm.base.needs import pip_install
from sglang_kvbm.base.values import ConfigError
from sglang_kvbm.core.identity import BlockId
from sglang_kvbm.core.pages import Page
from sglang_kvbm.tiers.block_objects import sign, tag_of, verify
from sglang_kvbm.tiers.format import header_bytes_for
from sglang_kvbm.tiers.heartbeat import Heartbeat
from sglang_kvbm.transfer.host_memory import aligned_empty

logger = logging.getLogger(__name__)
BOUNDED_RETRIES = {"AWS_RETRY_MODE": "standard", "AWS_MAX_ATTEMPTS": "1"}
ABANDON_S = 120.0  # a failed transfer's buffer is kept this long: its stragglers end within 10 s (bounded retries)
THREADS = 4  # the backend's request threads (its default is half the cores: 1 on a 2-core host)


class ObjectSettings(NamedTuple):
    bucket: str
    endpoint: Optional[str] = None  # e.g. http://127.0.0.1:9000 (path-style addressing); None: AWS's own
    region: Optional[str] = None
    access_key: Optional[str] = None
    secret_key: Optional[str] = None

    def __repr__(self) -> str:  # credentials masked: settings end up in logs and tracebacks
        shown = (f"{name}={'***' if name in ('access_key', 'secret_key') and value is not None else value!r}"
                 for name, value in zip(self._fields, self))
        return f"ObjectSettings({', '.join(shown)})"


class ObjectStore:
    def __init__(self, settings: ObjectSettings, *, fingerprint: bytes, page_size: int, block_bytes: int,
                 batch_blocks: int, retry_s: float = 5.0) -> None:
        """``batch_blocks``: the most blocks one call moves (its bounce buffer's rows)."""
        self.settings = settings
        self.header_bytes = header_bytes_for(page_size)
        self.block_bytes = block_bytes
        self.slot_bytes = self.header_bytes + block_bytes
        self.batch_blocks = batch_blocks
        self.retry_s = retry_s
        self.rekey(fingerprint)
        self._agent = None
        self._bounce: Optional[torch.Tensor] = None
        self._abandoned: list[tuple[float, torch.Tensor, object]] = []
        self._device_ids = itertools.count(1)
        self._down_until = 0.0
        self._closed = False
        self._heartbeat: Optional[Heartbeat] = None
        self.stats = {"written": 0, "read": 0, "misses": 0, "rejected": 0, "down": 0, "abandoned_buffers": 0}

    def rekey(self, fingerprint: bytes) -> None:
        self.fingerprint = fingerprint
        self.tag = tag_of(fingerprint)

    def key(self, block_id: BlockId, fingerprint: Optional[bytes] = None) -> str:
        return f"{self.tag if fingerprint is None else tag_of(fingerprint)}/{block_id}"

    # -- the client (the tier's thread) ---------------------------------------------------------

    @property
    def down(self) -> bool:
        return time.monotonic() < self._down_until

    def _fail(self, what: str, exc: BaseException) -> None:
        if not self.down:
            logger.warning("kvbm: object storage %s failed (%s); its blocks are misses for the next %.0f s", what,
                           exc, self.retry_s)
            self.stats["down"] += 1
        self._down_until = time.monotonic() + self.retry_s

    def start_heartbeat(self, **kwargs) -> None:
        """Ask the endpoint about once a second whether it accepts a connection (``tiers.heartbeat``); none for AWS's
        own endpoint (unset ``DYN_KVBM_OBJECT_ENDPOINT``), whose calls' failures alone mark the tier down."""
        endpoint = self.settings.endpoint
        if endpoint is None or self._heartbeat is not None or self._closed:
            return
        parsed = urllib.parse.urlsplit(endpoint)
        address = f"{parsed.hostname}:{parsed.port or (443 if parsed.scheme == 'https' else 80)}"
        self._heartbeat = Heartbeat("object", lambda: [address],
                                    lambda why: self._fail("heartbeat", ConnectionError(why)), self._answers_again,
                                    **kwargs)

    def _answers_again(self) -> None:
        self._down_until = 0.0
        logger.info("kvbm: object storage %s answers again: the object tier is up", self.settings.endpoint)

    def _client(self):
        """The NIXL agent with the OBJ backend, made on first use (0.07 s), or None while down or closed."""
        if self._closed or self.down:
            return None
        if self._agent is None:
            try:
                from nixl._api import nixl_agent, nixl_agent_config
            except ImportError as exc:
                raise ConfigError(f"the object tier (DYN_KVBM_OBJECT_ENABLED) moves blocks through NIXL, which is "
                                  f"not installed ({exc}): {pip_install('disk')}") from None
            for name, value in BOUNDED_RETRIES.items():
                os.environ.setdefault(name, value)
            try:
                agent = nixl_agent(f"sglang-kvbm-object-{os.getpid()}-{id(self):x}", nixl_agent_config(backends=[]))
                agent.create_backend("OBJ", self.backend_params())
            except Exception as exc:  # NIXL raises its own types
                self._fail("set-up", exc)
                return None
            self._agent = agent
            self._new_bounce()
        return self._agent

    def backend_params(self) -> dict:
        s = self.settings
        params = {"bucket": s.bucket, "num_threads": str(THREADS)}
        if s.endpoint:
            parsed = urllib.parse.urlsplit(s.endpoint)
            params.update(endpoint_override=s.endpoint, scheme=parsed.scheme, use_virtual_addressing="false")
        for name in ("region", "access_key", "secret_key"):
            if getattr(s, name):
                params[name] = getattr(s, name)
        return params

    def _new_bounce(self) -> None:
        self._bounce = aligned_empty((self.batch_blocks, self.slot_bytes))
        self._bounce_registration = self._agent.register_memory(self._bounce, backends=["OBJ"])

    def _abandon(self) -> None:
        """A transfer failed: its requests may still write into the bounce buffer. Keep it aside, take another;
        free those set aside long enough ago."""
        now = time.monotonic()
        kept = []
        for abandoned in self._abandoned:
            if now - abandoned[0] < ABANDON_S:
                kept.append(abandoned)
            else:
                self._release(abandoned)
        self._abandoned = kept + [(now, self._bounce, self._bounce_registration)]
        self.stats["abandoned_buffers"] += 1
        self._new_bounce()

    def _release(self, abandoned) -> None:
        self._agent.deregister_memory(abandoned[2], backends=["OBJ"])

    def _move(self, op: str, keys: Sequence[str], rows: Sequence[int]) -> None:
        """``op`` (``WRITE``/``READ``) whole objects between ``keys`` and bounce ``rows``; raises on failure."""
        agent = self._agent
        ids = [next(self._device_ids) for _ in keys]
        objects = agent.register_memory([(0, 0, d, k) for d, k in zip(ids, keys)], "OBJ", backends=["OBJ"])
        try:
            base = self._bounce.data_ptr()
            local = agent.get_xfer_descs([(base + r * self.slot_bytes, self.slot_bytes, 0) for r in rows], "DRAM")
            remote = agent.get_xfer_descs([(0, self.slot_bytes, d) for d in ids], "OBJ")
            handle = agent.initialize_xfer(op, local, remote, agent.name, backends=["OBJ"])
            try:
                state, wait = agent.transfer(handle), 50e-6
                while state == "PROC":
                    time.sleep(wait)
                    wait = min(wait * 2, 2e-3)
                    state = agent.check_xfer_state(handle)
                if state != "DONE":
                    raise RuntimeError(f"{op} ended {state}")
            finally:
                agent.release_xfer_handle(handle)
        finally:
            agent.deregister_memory(objects, backends=["OBJ"])

    # -- blocks -----------------------------------------------------------------------------------

    def contains(self, block_ids: Sequence[BlockId]) -> list[bool]:
        """Which of these blocks have an object (one HEAD each); all False while down."""
        agent = self._client()
        if agent is None or not block_ids:
            return [False] * len(block_ids)
        try:
            found = agent.query_memory([(0, 0, 0, self.key(b)) for b in block_ids], "OBJ", "OBJ")
        except Exception as exc:
            self._fail("a lookup", exc)
            return [False] * len(block_ids)
        return [f is not None for f in found]

    def write(self, metas: Sequence[Page], rows: Sequence[torch.Tensor], fingerprint: bytes) -> list[bool]:
        """Put each block (signed under ``fingerprint``) from its host row; which ones were written."""
        ok = [False] * len(metas)
        agent = self._client()
        if agent is None:
            return ok
        for start in range(0, len(metas), self.batch_blocks):
            batch = range(start, min(start + self.batch_blocks, len(metas)))
            sent = []
            for slot, i in enumerate(batch):
                bounce = self._bounce[slot]
                header, data = bounce[: self.header_bytes], bounce[self.header_bytes :]
                if sign(metas[i], rows[i], header, fingerprint):
                    data.copy_(rows[i])
                    sent.append((slot, i))
            try:
                self._move("WRITE", [self.key(metas[i].block_id, fingerprint) for _, i in sent], [s for s, _ in sent])
            except Exception as exc:
                self._abandon()
                self._fail("a write", exc)
                return ok
            for _, i in sent:
                ok[i] = True
        self.stats["written"] += sum(ok)
        return ok

    def read(self, block_ids: Sequence[BlockId], rows: Sequence[torch.Tensor], headers: Sequence[torch.Tensor]
             ) -> list[Optional[Page]]:
        """Get each block, verify it, copy it into ``rows[i]`` (header into ``headers[i]``): its meta, or None."""
        out: list[Optional[Page]] = [None] * len(block_ids)
        agent = self._client()
        if agent is None:
            return out
        for start in range(0, len(block_ids), self.batch_blocks):
            batch = list(range(start, min(start + self.batch_blocks, len(block_ids))))
            try:
                self._move("READ", [self.key(block_ids[i]) for i in batch], range(len(batch)))
            except Exception as exc:  # a missing object among them, or the server: every block of it a miss
                self._abandon()
                self._fail("a read", exc)
                self.stats["misses"] += len(block_ids) - start
                return out
            for slot, i in enumerate(batch):
                bounce = self._bounce[slot]
                header, data = bounce[: self.header_bytes], bounce[self.header_bytes :]
                meta, why = verify(block_ids[i], data, header, self.fingerprint)
                if meta is None:
                    self.stats["rejected"] += 1
                    logger.warning("kvbm: object %s rejected (%s); the request recomputes it", self.key(block_ids[i]),
                                   why)
                    continue
                rows[i].copy_(data)
                headers[i][: self.header_bytes].copy_(header)
                out[i] = meta
                self.stats["read"] += 1
        return out

    def close(self) -> None:
        """No more calls (the tier's thread has stopped)."""
        self._closed = True
        if self._heartbeat is not None:
            self._heartbeat.stop()
        if self._agent is not None:
            for abandoned in self._abandoned:
                self._release(abandoned)
            self._agent.deregister_memory(self._bounce_registration, backends=["OBJ"])
            self._abandoned, self._agent = [], None
