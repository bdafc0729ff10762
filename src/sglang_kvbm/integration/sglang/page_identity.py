"""What a stored page is, beyond its bytes: token ids, parent, and its KV-event identity.

SGLang's tree hands the linker a node's storage keys and device slots, not its
tokens. The tokens come from the insert that made the offload: the linker
keeps the inserted key (:class:`InsertContext`, captured on the scheduler
thread, a copy of its token ids), and a copy thread later describes the node
(:meth:`InsertContext.describe`) in one compiled call (``_blocks.describe``):
it walks the key's storage-hash chain with SGLang's hash, bit for bit, until
the node's first key, checks each of its keys against its tokens, and keeps
one record of the node (token ids, the parent of its first page, event ids),
all without the GIL. Each stored page is a view of that record.

Event ids: for a key SGLang does not namespace (no ``extra_key``, no
``cache_salt``) they are the storage keys' (``hash_str_to_int64``), which the
record computes. A namespaced key's come from SGLang's own
``KVCacheEventRecorder.record_store`` on a stand-in for the node, so the
``CPU_PINNED``/``DISK`` events carry exactly the block hashes, parent links and
``cache_salt``/LoRA namespacing of the tree's ``GPU`` events (tests compare
them with the real tree's events for every namespace variant).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Optional, Sequence

from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.utils import storage_namespace_seed

from sglang_kvbm._blocks import PageIdentityError, describe
from sglang_kvbm.core.identity import BlockId
from sglang_kvbm.core.pages import Page, Pages
from sglang_kvbm.integration.sglang.compat import event_lora_name, event_recorder

__all__ = ["EventSettings", "InsertContext", "PageIdentityError"]


class EventSettings:
    """How this worker's recorder names events (None when events are off)."""

    def __init__(self, page_size: int, dynamo_format: bool, lora_names) -> None:
        self.page_size = page_size
        self.dynamo_format = dynamo_format
        self.lora_names = lora_names

    def recorder(self):
        return event_recorder(enabled=True, page_size=self.page_size, dynamo_format=self.dynamo_format,
                              lora_names=self.lora_names)


class InsertContext:
    """The key of one insert into the tree, for describing the pages its offloads store."""

    __slots__ = ("tokens", "length", "extra_key", "cache_salt", "bigram", "priority", "page_size", "events")

    def __init__(self, key: RadixKey, priority: int, page_size: int, events: Optional[EventSettings]) -> None:
        ids = key.raw_token_ids()  # a copy (C: a list's pointers or an array's bytes), not a conversion per token
        self.tokens = ids[:] if ids is key.token_ids else ids
        self.length = len(key) // page_size * page_size  # full pages only
        self.extra_key = key.extra_key
        self.cache_salt = key.cache_salt
        self.bigram = key.is_bigram  # EAGLE: the tree keys pages by (token, next token) pairs
        self.priority = priority
        self.page_size = page_size
        self.events = events

    def describe(self, keys: Sequence[BlockId], positions: Sequence[int]) -> list[Page]:
        """The pages ``keys[p]`` for each ``p`` in ``positions`` (copy thread)."""
        return self.record(keys).views(positions)

    def record(self, keys: Sequence[BlockId]) -> Pages:
        """The node whose storage keys are ``keys``, described (PageIdentityError: not on the inserted key)."""
        seed = storage_namespace_seed(self.extra_key, self.cache_salt)
        namespaced = self.extra_key is not None or self.cache_salt is not None
        plain_events = self.events is not None and not namespaced
        pages = describe(self.tokens, self.length, self.page_size, self.bigram,
                         bytes.fromhex(seed) if seed else None, keys, plain_events)
        if self.events is not None and namespaced:
            pages = pages.with_events(*self._namespaced_events(pages))
        return pages

    def _namespaced_events(self, pages: Pages) -> tuple[list[int], Optional[int], Optional[str], Optional[str]]:
        """SGLang's own event ids of a namespaced key's node (its recorder, on a stand-in node)."""
        ps, n = self.page_size, len(pages)
        key = RadixKey(self.tokens, self.extra_key, cache_salt=self.cache_salt, is_bigram=self.bigram)
        start = pages.start
        root = SimpleNamespace(parent=None, key=RadixKey([]), hash_value=[], event_hash_value=[])
        # The event chain of a namespaced key is its own (salt-seeded, extra_key left out): SGLang computes it for
        # every node from the first not yet hashed, here the stand-in parent (the key's first pages) and the node.
        parent = root
        if start:
            parent = SimpleNamespace(parent=root, key=key[: start * ps], hash_value=[pages.page(0).parent_id],
                                     event_hash_value=None)
        node = SimpleNamespace(parent=parent, key=key[start * ps : (start + n) * ps], hash_value=list(pages.ids),
                               event_hash_value=None)
        recorder = self.events.recorder()
        recorder.record_store(node)
        hashes: list[int] = []
        first_parent = salt = lora = None
        for event in recorder.take():
            if not hashes:
                first_parent, salt, lora = event.parent_block_hash, event.cache_salt, event_lora_name(event)
            hashes.extend(event.block_hashes)
        if len(hashes) != n:
            raise PageIdentityError(f"SGLang's recorder described {len(hashes)} pages of {n}")
        return hashes, first_parent, salt, lora

