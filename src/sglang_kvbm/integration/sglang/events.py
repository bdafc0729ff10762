"""KV events for the lower tiers, in SGLang's own types and wire format.

:class:`SglangEventSink` turns what the tiers report into SGLang's
``BlockStored``/``BlockRemoved`` with the ``CPU_PINNED``/``DISK`` medium, queued
in a ``KVCacheEventRecorder`` of its own (which coalesces consecutive pages of
a chain, as the tree's does). The linker hands them to SGLang's publisher
right after the tree's own ``GPU`` events, through the cache's ``take_events``,
so one stream per worker carries every tier in the order things happened.
"""

from __future__ import annotations

import operator
from itertools import chain
from typing import Sequence

from sglang.srt.disaggregation.kv_events import BlockRemoved, StorageMedium

from sglang_kvbm.core.ports import BlockMeta
from sglang_kvbm.core.tiers import Tier
from sglang_kvbm.integration.sglang.compat import block_stored, event_recorder

_event = operator.attrgetter("event")
_hash = operator.attrgetter("block_hash")
_parent = operator.attrgetter("parent_block_hash")
_tokens = operator.attrgetter("token_ids")
_namespace = operator.attrgetter("cache_salt", "lora_name", "bigram")


def _one_chain(idents: list) -> bool:
    """Every page has an identity, none is an EAGLE bigram page, one namespace, each page's parent the one
    before: what SGLang's recorder would coalesce into one event (each test a C-level pass)."""
    if None in idents:
        return False
    namespaces = set(map(_namespace, idents))
    if len(namespaces) != 1 or next(iter(namespaces))[2]:
        return False
    return all(map(operator.eq, map(_parent, idents[1:]), map(_hash, idents)))


class SglangEventSink:
    """:class:`~sglang_kvbm.core.ports.EventSink` onto a queue of SGLang events (disabled: drops everything)."""

    def __init__(self, enabled: bool, page_size: int) -> None:
        self._queue = event_recorder(enabled=enabled, page_size=page_size)

    @property
    def enabled(self) -> bool:
        return self._queue.enabled

    def stored(self, tier: Tier, blocks: Sequence[BlockMeta]) -> None:
        if not self.enabled or not blocks:
            return
        medium = StorageMedium(tier.medium)
        idents = list(map(_event, blocks))
        if _one_chain(idents):  # a copy's pages: one event for all of them, built in C
            first = idents[0]
            tokens = list(chain.from_iterable(map(_tokens, blocks)))
            self._queue.enqueue(block_stored(
                block_hashes=list(map(_hash, idents)), parent_block_hash=first.parent_block_hash, token_ids=tokens,
                block_size=len(tokens) // len(blocks), lora_id=None, medium=medium, cache_salt=first.cache_salt,
                lora_name=first.lora_name))
            return
        for meta, ident in zip(blocks, idents):
            if ident is None:
                continue
            tokens = meta.token_ids
            if ident.bigram:  # as SGLang's recorder publishes EAGLE pages: (token, next token) pairs
                tokens = list(zip(tokens[:-1], tokens[1:]))
            self._queue.enqueue(
                block_stored(
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
        hashes = list(map(_hash, filter(None, map(_event, blocks))))
        if hashes:
            self._queue.enqueue(BlockRemoved(block_hashes=hashes, medium=StorageMedium(tier.medium)))

    def take(self) -> list:
        return self._queue.take()

    def clear(self) -> None:
        self._queue.take()
