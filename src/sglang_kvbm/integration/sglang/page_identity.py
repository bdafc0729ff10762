"""What a stored page is, beyond its bytes: token ids, parent, and its KV-event identity.

SGLang's tree hands the linker a node's storage keys and device slots, not its
tokens. The tokens come from the insert that made the offload: the linker
keeps the inserted key (:class:`InsertContext`, captured on the scheduler
thread, a copy of its token ids), and a copy thread later describes the pages
(:meth:`InsertContext.describe`): it rebuilds the key's storage-hash chain with
SGLang's own hash, finds the node in it, and runs SGLang's own
``KVCacheEventRecorder.record_store`` on a stand-in for the node, so the
``CPU_PINNED``/``DISK`` events carry exactly the block hashes, parent links and
``cache_salt``/LoRA namespacing of the tree's ``GPU`` events (tests compare
them with the real tree's events for every namespace variant).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Optional, Sequence

from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.utils import compute_node_event_hash_values, get_storage_hash_str

from sglang_kvbm.core.identity import BlockId
from sglang_kvbm.core.ports import BlockMeta, EventIdentity
from sglang_kvbm.integration.sglang.compat import event_lora_name, event_recorder


class PageIdentityError(RuntimeError):
    """The pages handed over are not where the inserted key says they are."""


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

    __slots__ = ("tokens", "extra_key", "cache_salt", "bigram", "priority", "page_size", "events")

    def __init__(self, key: RadixKey, priority: int, page_size: int, events: Optional[EventSettings]) -> None:
        ids = key.raw_token_ids()  # a copy (C: a list's pointers or an array's bytes), not a conversion per token
        self.tokens = ids[:] if ids is key.token_ids else ids
        self.extra_key = key.extra_key
        self.cache_salt = key.cache_salt
        self.bigram = key.is_bigram  # EAGLE: the tree keys pages by (token, next token) pairs
        self.priority = priority
        self.page_size = page_size
        self.events = events

    def describe(self, keys: Sequence[BlockId], positions: Sequence[int]) -> list[BlockMeta]:
        """Metas of ``keys[p]`` for each ``p`` in ``positions`` (copy thread)."""
        ps = self.page_size
        whole = RadixKey(self.tokens, self.extra_key, cache_salt=self.cache_salt, is_bigram=self.bigram)
        full = len(whole) // ps * ps
        key = whole[:full]
        chain = get_storage_hash_str(key, None, page_size=ps) if full else []
        try:
            start = chain.index(keys[0])
        except ValueError:
            raise PageIdentityError("the stored node is not on the inserted key's path") from None
        if chain[start : start + len(keys)] != list(keys):
            raise PageIdentityError("the stored node's keys do not follow the inserted key")
        events = self._event_identities(key, chain, start, len(keys)) if self.events is not None else None
        out = []
        for p in positions:
            page = start + p
            out.append(
                BlockMeta(
                    keys[p],
                    tuple(self.tokens[page * ps : (page + 1) * ps + self.bigram]),  # bigrams: one raw token more
                    events[p] if events is not None else None,
                    chain[page - 1] if page else None,
                )
            )
        return out

    def _event_identities(self, key: RadixKey, chain: list[str], start: int, count: int) -> list[EventIdentity]:
        """SGLang's own event identities for pages ``start .. start+count`` of ``key``."""
        ps = self.page_size
        namespaced = key.extra_key is not None or key.cache_salt is not None
        event_chain = chain
        if namespaced:  # the event chain of a namespaced key is its own (salt-seeded, extra_key left out)
            whole = SimpleNamespace(key=key, parent=None, hash_value=chain, event_hash_value=None)
            event_chain = compute_node_event_hash_values(whole, ps)
        root = SimpleNamespace(parent=None, key=RadixKey([]), hash_value=[], event_hash_value=[])
        parent = root
        if start:
            parent = SimpleNamespace(
                parent=root,
                key=key[: start * ps],
                hash_value=chain[:start],
                event_hash_value=event_chain[:start] if namespaced else None,
            )
        node = SimpleNamespace(
            parent=parent,
            key=key[start * ps : (start + count) * ps],
            hash_value=chain[start : start + count],
            event_hash_value=event_chain[start : start + count] if namespaced else None,
        )
        recorder = self.events.recorder()
        recorder.record_store(node)
        identities: list[EventIdentity] = []
        for event in recorder.take():
            link = event.parent_block_hash
            for block_hash in event.block_hashes:
                identities.append(EventIdentity(block_hash, link, event.cache_salt, event_lora_name(event), self.bigram))
                link = block_hash
        if len(identities) != count:
            raise PageIdentityError(f"SGLang's recorder described {len(identities)} pages of {count}")
        return identities
