"""KV events for the lower tiers, in SGLang's own types and wire format.

:class:`SglangEventSink` turns what the tiers report into SGLang's
``BlockStored``/``BlockRemoved`` with the ``CPU_PINNED``/``DISK`` medium, queued
in a ``KVCacheEventRecorder`` of its own (which coalesces consecutive pages of
a chain, as the tree's does). The linker hands them to SGLang's publisher
right after the tree's own ``GPU`` events, through the cache's ``take_events``,
so one stream per worker carries every tier in the order things happened.
"""

from __future__ import annotations

from typing import Sequence

from sglang.srt.disaggregation.kv_events import BlockRemoved, StorageMedium

from sglang_kvbm.core.pages import Page, event_hashes, stored_run
from sglang_kvbm.core.tiers import Tier
from sglang_kvbm.integration.sglang.compat import block_stored, event_recorder


class SglangEventSink:
    """:class:`~sglang_kvbm.core.ports.EventSink` onto a queue of SGLang events (disabled: drops everything)."""

    def __init__(self, enabled: bool, page_size: int) -> None:
        self._queue = event_recorder(enabled=enabled, page_size=page_size)

    @property
    def enabled(self) -> bool:
        return self._queue.enabled

    def stored(self, tier: Tier, blocks: Sequence[Page]) -> None:
        if not self.enabled or not blocks:
            return
        medium = StorageMedium(tier.medium)
        run = stored_run(blocks)
        if run is not None:  # a copy's pages: one chain of one namespace, one event, its fields read in C++
            hashes, parent, tokens, salt, lora = run
            self._queue.enqueue(block_stored(
                block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=len(tokens) // len(hashes),
                lora_id=None, medium=medium, cache_salt=salt, lora_name=lora))
            return
        for page in blocks:
            if page.event_hash is None:
                continue
            tokens = page.token_ids
            if page.bigram:  # as SGLang's recorder publishes EAGLE pages: (token, next token) pairs
                tokens = list(zip(tokens[:-1], tokens[1:]))
            self._queue.enqueue(
                block_stored(
                    block_hashes=[page.event_hash],
                    parent_block_hash=page.event_parent,
                    token_ids=list(tokens),
                    block_size=len(tokens),
                    lora_id=None,
                    medium=medium,
                    cache_salt=page.cache_salt,
                    lora_name=page.lora_name,
                )
            )

    def removed(self, tier: Tier, blocks: Sequence[Page]) -> None:
        if not self.enabled:
            return
        hashes = event_hashes(blocks)
        if hashes:
            self._queue.enqueue(BlockRemoved(block_hashes=hashes, medium=StorageMedium(tier.medium)))

    def take(self) -> list:
        return self._queue.take()

    def clear(self) -> None:
        self._queue.take()
