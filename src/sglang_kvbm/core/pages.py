"""What a tier keeps about a page besides its bytes: a view into one record per node (``csrc/pages.h``).

The tree offloads a node at a time; a copy thread describes the node in one
compiled call (``_blocks.describe``: its pages found on the inserted key's
storage-hash chain and checked, without the GIL) into a :class:`Pages` record:
block ids, token ids, the parent of its first page and its KV-event ids. Each
stored page is a :class:`Page` view of that record, made in bulk; nothing about
a page becomes a Python object until a tier asks for it (a disk header, an
event built from many pages at once by ``_blocks.stored_run``; which pages of a list follow the one
before them, ``unchained``).

A :class:`Page` answers ``block_id``, ``parent_id`` (the block id of the page
before it in its sequence, None for a first page: a block is only worth
holding if its parent is held too), ``token_ids``, and, when it is announced in
KV events, ``event_hash``/``event_parent``/``cache_salt``/``lora_name``
(``event_hash`` None: not announced). ``bigram``: an EAGLE page, whose token
ids hold one raw token more and whose events carry (token, next token) pairs.
"""

from __future__ import annotations

from typing import Optional, Sequence

from sglang_kvbm._blocks import Page, Pages, event_hashes, stored_run, unchained

__all__ = ["Page", "Pages", "bare_pages", "event_hashes", "one_page", "stored_run", "unchained"]


def one_page(block_id: str, token_ids: Sequence[int] = (), *, parent_id: Optional[str] = None,
         event_hash: Optional[int] = None, event_parent: Optional[int] = None, cache_salt: Optional[str] = None,
         lora_name: Optional[str] = None, bigram: bool = False) -> Page:
    """One page on its own (a block read back from a disk header or a shared tier's object)."""
    events = None if event_hash is None else [event_hash]
    size = max(len(token_ids) - bigram, 1)
    return Pages((block_id,), token_ids, size, parent_id, bigram, events, event_parent, cache_salt,
                 lora_name).page(0)


def bare_pages(block_ids: Sequence[str]) -> Pages:
    """Pages known by their ids alone (a sidecar pool's: no tokens, no events)."""
    return Pages(block_ids, (), 1)
