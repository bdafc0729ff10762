"""A block as one object in a shared store: the disk tier's slot byte for byte, signed on write, proven on read.

Remote tiers (stores shared by workers) keep each block as a header row
(``tiers.format``: block id, identity, xxh3 of the block, token ids, event
identity) followed by the block row. A write signs the header with the
identity the block was computed under; a read is served only once the header
decodes, names this identity and this block, and the checksum matches the
bytes: a missing, evicted, foreign, truncated or damaged object is a miss.
"""

from __future__ import annotations

from typing import Optional

import torch

from sglang_kvbm.core.identity import BlockId
from sglang_kvbm.core.pages import Page
from sglang_kvbm.tiers.format import BlockHeader, HeaderTooLarge, checksum, decode_header, encode_header

TAG_PREFIX = "kvbm-"  # every tag this library names objects under starts so


def tag_of(fingerprint: bytes) -> str:
    """The identity's part of every object name (16 hex digits of the fingerprint)."""
    return TAG_PREFIX + fingerprint.hex()[:16]


def sign(meta: Page, row: torch.Tensor, header: torch.Tensor, fingerprint: bytes) -> bool:
    """Write ``meta``'s header for ``row`` into ``header``; False when it does not fit (the block is not shared)."""
    try:
        encode_header(BlockHeader.of(meta, checksum(row), fingerprint), header)
    except HeaderTooLarge:
        return False
    return True


def verify(block_id: BlockId, row: torch.Tensor, header: torch.Tensor, fingerprint: bytes
           ) -> tuple[Optional[Page], Optional[str]]:
    """``(meta, None)`` when the object read into ``header`` and ``row`` is this block under this identity, else
    ``(None, why)``."""
    decoded = decode_header(header)
    if decoded is None:
        return None, "not a block object"
    if decoded.fingerprint != fingerprint or decoded.block_id != block_id:
        return None, "another server's or another block's object"
    if decoded.checksum != checksum(row):
        return None, "checksum mismatch"
    return decoded.meta(), None
