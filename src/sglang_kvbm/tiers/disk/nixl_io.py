"""File I/O through NIXL's POSIX backend: registrations and pipelined transfers.

One :class:`NixlFileIO` per disk tier; the agent runs in NIXL's thread-safe
mode, so the writer and the reader thread post transfers concurrently, each
from its own registered buffers. :meth:`NixlFileIO.pipeline` keeps several
transfers in flight: while chunk ``k`` moves, chunk ``k+1`` is prepared
(headers and checksums for a write) and chunk ``k-1`` is consumed (verified
and copied for a read), which is how the copies approach the device's limit.
"""

from __future__ import annotations

import collections
import os
import time
from typing import Callable, Optional

from sglang_kvbm.base.needs import pip_install
from sglang_kvbm.base.values import ConfigError

Descriptors = list[tuple[int, int, int]]  # (address or offset, length, device id / fd)


class DiskIOError(RuntimeError):
    """A NIXL transfer to or from the disk cache failed."""


class NixlFileIO:
    def __init__(self, name: str) -> None:
        try:
            from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t
        except ImportError as exc:
            raise ConfigError(
                f"the disk tier (DYN_KVBM_DISK_CACHE_GB) moves blocks through NIXL, which is not installed "
                f"({exc}): {pip_install('disk')}"
            ) from None
        config = nixl_agent_config(backends=[], sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
        self._agent = nixl_agent(f"{name}-{os.getpid()}-{id(self):x}", config)
        self._agent.create_backend("POSIX", {})

    def register_memory(self, tensor) -> object:
        return self._agent.register_memory(tensor)

    def register_file(self, fd: int, size: int, name: str) -> object:
        return self._agent.register_memory([(0, size, fd, name)], "FILE")

    def deregister(self, registration: object) -> None:
        self._agent.deregister_memory(registration)

    def post(self, op: str, local: Descriptors, remote: Descriptors):
        """Start a transfer; returns a handle for :meth:`finish`, or the error that kept it from starting."""
        agent = self._agent
        try:
            handle = agent.initialize_xfer(
                op, agent.get_xfer_descs(local, "DRAM"), agent.get_xfer_descs(remote, "FILE"), agent.name
            )
        except Exception as exc:  # NIXL raises its own error types
            return DiskIOError(f"{op} could not be set up: {exc!r}")
        try:
            state = agent.transfer(handle)
        except Exception as exc:
            agent.release_xfer_handle(handle)
            return DiskIOError(f"{op} could not be started: {exc!r}")
        if state not in ("PROC", "DONE"):
            agent.release_xfer_handle(handle)
            return DiskIOError(f"{op} failed ({state})")
        return op, handle, state

    def finish(self, posted) -> None:
        """Wait for a posted transfer and release it; raises :class:`DiskIOError` if it failed."""
        if isinstance(posted, DiskIOError):
            raise posted
        op, handle, state = posted
        agent = self._agent
        try:
            wait = 20e-6
            while state == "PROC":
                time.sleep(wait)
                wait = min(wait * 2, 1e-3)
                state = agent.check_xfer_state(handle)
            if state != "DONE":
                raise DiskIOError(f"{op} failed ({state})")
        finally:
            agent.release_xfer_handle(handle)

    def transfer(self, op: str, local: Descriptors, remote: Descriptors) -> None:
        self.finish(self.post(op, local, remote))

    def pipeline(
        self,
        op: str,
        count: int,
        prepare: Callable[[int], tuple[Descriptors, Descriptors]],
        done: Callable[[int, Optional[DiskIOError]], None],
        depth: int = 2,
    ) -> None:
        """Move ``count`` chunks with up to ``depth`` in flight.

        ``prepare(k)`` returns chunk ``k``'s descriptors (it may raise
        :class:`DiskIOError` to fail that chunk); ``done(k, error)`` is called
        for every chunk, in order, once it has landed or failed. Every transfer
        started is finished before this returns, even when ``done`` raises, so
        no buffer is written after its owner moved on.
        """
        inflight: collections.deque = collections.deque()
        try:
            for k in range(count):
                try:
                    inflight.append((k, self.post(op, *prepare(k))))
                except DiskIOError as exc:
                    inflight.append((k, exc))
                while len(inflight) >= depth:
                    self._complete(*inflight.popleft(), done)
            while inflight:
                self._complete(*inflight.popleft(), done)
        finally:
            for _, posted in inflight:
                try:
                    self.finish(posted)
                except DiskIOError:
                    pass

    def _complete(self, k: int, posted, done) -> None:
        try:
            self.finish(posted)
        except DiskIOError as exc:
            done(k, exc)
            return
        done(k, None)
