"""KV events for the lower tiers, on SGLang's own recorder and wire format.

The cache's ``KVCacheEventRecorder`` already carries SGLang's GPU events and is
drained by the scheduler's publisher (``--kv-events-config``); this sink appends
``CPU_PINNED``/``DISK`` events to the same queue, so one stream per worker
carries every tier in the order things happened.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from sglang.srt.disaggregation.kv_events import BlockRemoved, BlockStored, StorageMedium
from sglang.srt.mem_cache.events import KVCacheEventRecorder

from sglang_kvbm.core.ports import BlockMeta, EventIdentity
from sglang_kvbm.core.tiers import Tier


class SglangEventSink:
    """:class:`~sglang_kvbm.core.ports.EventSink` onto a cache's ``KVCacheEventRecorder``."""

    def __init__(self) -> None:
        self._recorder: Optional[KVCacheEventRecorder] = None

    def bind(self, recorder: KVCacheEventRecorder) -> None:
        self._recorder = recorder

    @property
    def enabled(self) -> bool:
        return self._recorder is not None and self._recorder.enabled

    def stored(self, tier: Tier, blocks: Sequence[BlockMeta]) -> None:
        if not self.enabled:
            return
        medium = StorageMedium(tier.medium)
        for meta in blocks:
            ident = meta.event
            if ident is None:
                continue
            # enqueue() coalesces consecutive pages of one chain into one event.
            self._recorder.enqueue(
                BlockStored(
                    block_hashes=[ident.block_hash],
                    parent_block_hash=ident.parent_block_hash,
                    token_ids=list(meta.token_ids),
                    block_size=len(meta.token_ids),
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
            self._recorder.enqueue(BlockRemoved(block_hashes=hashes, medium=StorageMedium(tier.medium)))


def page_event_identities(recorder: KVCacheEventRecorder, node: Any) -> Optional[list[EventIdentity]]:
    """Per-page event ids of a tree node, exactly as SGLang's recorder publishes them.

    Runs SGLang's own ``record_store`` on a scratch recorder with the same
    settings (format, LoRA names), so namespacing by ``cache_salt``/LoRA and the
    parent link match the node's GPU events bit for bit. None when events are off.
    """
    if not recorder.enabled:
        return None
    scratch = KVCacheEventRecorder(
        enabled=True,
        page_size=recorder.page_size,
        dynamo_format=recorder.dynamo_format,
        lora_names=recorder.lora_names,
    )
    scratch.record_store(node)
    identities: list[EventIdentity] = []
    for event in scratch.take():
        parent = event.parent_block_hash
        for block_hash in event.block_hashes:
            identities.append(EventIdentity(block_hash, parent, event.cache_salt, event.lora_name))
            parent = block_hash
    return identities
