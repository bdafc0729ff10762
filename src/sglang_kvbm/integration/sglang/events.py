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

from sglang.srt.disaggregation.kv_events import BlockRemoved, BlockStored, StorageMedium
from sglang.srt.mem_cache.events import KVCacheEventRecorder

from sglang_kvbm.core.ports import BlockMeta
from sglang_kvbm.core.tiers import Tier


class SglangEventSink:
    """:class:`~sglang_kvbm.core.ports.EventSink` onto a queue of SGLang events (disabled: drops everything)."""

    def __init__(self, enabled: bool, page_size: int) -> None:
        self._queue = KVCacheEventRecorder(enabled=enabled, page_size=page_size)

    @property
    def enabled(self) -> bool:
        return self._queue.enabled

    def stored(self, tier: Tier, blocks: Sequence[BlockMeta]) -> None:
        if not self.enabled:
            return
        medium = StorageMedium(tier.medium)
        for meta in blocks:
            ident = meta.event
            if ident is None:
                continue
            tokens = meta.token_ids
            if ident.bigram:  # as SGLang's recorder publishes EAGLE pages: (token, next token) pairs
                tokens = list(zip(tokens[:-1], tokens[1:]))
            self._queue.enqueue(
                BlockStored(
                    block_hashes=[ident.block_hash],
                    parent_block_hash=ident.parent_block_hash,
                    token_ids=list(tokens),
                    block_size=len(tokens),
                    lora_id=None,
                    medium=medium,
                    cache_salt=ident.cache_salt,
                    lora_name=ident.lora_name,
                )
            )

    def removed(self, tier: Tier, blocks: Sequence[BlockMeta]) -> None:
        if not self.enabled:
            return
        hashes = [meta.event.block_hash for meta in blocks if meta.event is not None]
        if hashes:
            self._queue.enqueue(BlockRemoved(block_hashes=hashes, medium=StorageMedium(tier.medium)))

    def take(self) -> list:
        return self._queue.take()

    def clear(self) -> None:
        self._queue.take()
