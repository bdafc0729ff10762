"""Page identity: SGLang's page hash chain, written out without SGLang.

A page is identified the way SGLang 0.5.23 identifies it in its radix tree
(``TreeNode.hash_value``) and in its storage back-ends:

* ``digest_0 = SHA256(seed || tokens_0)`` where ``seed`` is the request's
  namespace digest (absent when neither ``extra_key`` nor ``cache_salt`` is set),
* ``digest_i = SHA256(digest_{i-1} || tokens_i)``,

with each page's token ids packed as little-endian ``uint32``. The hex digest is
the :data:`BlockId` every tier of this library uses, so two requests in different
namespaces (LoRA adapter, ``cache_salt``) never share a block in any tier.

The id published in KV events is a different projection of the same chain
(first 8 bytes as a signed int64, then namespaced again for the router); the
SGLang adapter takes those from SGLang's own recorder, see
``integration/sglang/events.py``. :func:`event_id` is the un-namespaced case.

SGLang computes these hashes with a C++ extension; the adapter uses it on the
hot path. This module is the specification the tests hold that extension to,
and what tools use where SGLang is not importable.
"""

from __future__ import annotations

import hashlib
import struct
import uuid
from typing import Optional, Sequence

BlockId = str
"""Hex SHA-256 digest of a page, chained over its prefix (64 characters)."""

_NAMESPACE_TAG = b"sglang-cache-namespace-v1"
_U32_MAX = 0xFFFFFFFF


def namespace_seed(extra_key: Optional[str], cache_salt: Optional[str]) -> Optional[BlockId]:
    """Digest that starts a namespaced chain, or None for the default namespace.

    Presence bytes and length prefixes keep ``("a", "bc")`` and ``("ab", "c")`` apart.
    """
    if extra_key is None and cache_salt is None:
        return None
    digest = hashlib.sha256(_NAMESPACE_TAG)
    for part in (extra_key, cache_salt):
        if part is None:
            digest.update(b"\x00")
            continue
        encoded = part.encode("utf-8")
        digest.update(b"\x01" + len(encoded).to_bytes(8, "little") + encoded)
    return digest.hexdigest()


def page_hashes(
    token_ids: Sequence[int],
    page_size: int,
    prior: Optional[BlockId] = None,
) -> list[BlockId]:
    """Chain hashes of the *full* pages of ``token_ids``, continuing from ``prior``.

    ``prior`` is the hash of the page before ``token_ids[0]`` (or a namespace
    seed); None starts a chain at the root of the default namespace. A trailing
    partial page is not hashed: only full pages are blocks.
    """
    if page_size <= 0:
        raise ValueError(f"page_size must be positive, got {page_size}")
    out: list[BlockId] = []
    digest = bytes.fromhex(prior) if prior else None
    full = len(token_ids) - len(token_ids) % page_size
    for start in range(0, full, page_size):
        page = token_ids[start : start + page_size]
        if any(t < 0 or t > _U32_MAX for t in page):
            raise ValueError("token ids must fit in uint32 (SGLang's wide-token encoding is not supported)")
        h = hashlib.sha256()
        if digest is not None:
            h.update(digest)
        h.update(struct.pack(f"<{len(page)}I", *page))
        digest = h.digest()
        out.append(digest.hex())
    return out


def chain_hashes(
    token_ids: Sequence[int],
    page_size: int,
    *,
    extra_key: Optional[str] = None,
    cache_salt: Optional[str] = None,
) -> list[BlockId]:
    """Block ids of the full pages of a whole sequence from the root of its namespace."""
    return page_hashes(token_ids, page_size, prior=namespace_seed(extra_key, cache_salt))


def event_id(block_id: BlockId) -> int:
    """The int64 a KV event carries for an un-namespaced page: first 8 bytes, big-endian, signed."""
    value = int(block_id[:16], 16)
    return value - (1 << 64) if value >= (1 << 63) else value


def rekeyed(fingerprint: bytes, reason: str) -> bytes:
    """A new identity for a running server whose weights were replaced in memory (``reason`` says how).

    Derived from the old one, the reason and a random draw: no server started
    from files, nor this one after a restart, ever computes it, so what the
    disk tier writes from now on is never read by another server.
    """
    draw = f"weights updated in memory: {reason}: {uuid.uuid4().hex}".encode()
    return hashlib.sha256(fingerprint + draw).digest()[:16]
