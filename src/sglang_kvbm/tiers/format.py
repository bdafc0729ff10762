"""What a block looks like on disk, and how it proves it is intact.

Every disk slot is one header row followed by the block's bytes::

    [ magic 8 | header length 4 | header xxh3 8 | msgpack(BlockHeader) | zero pad ] [ block bytes ]

The header row is :func:`header_bytes_for` the page size: room for the page's
token ids at msgpack's widest (9 bytes each), the fixed fields, and
``NAME_BYTES`` of cache_salt + lora_name, rounded up to 4 KiB for O_DIRECT. A
block whose header could still not fit (longer names) is not written
(:func:`header_fits`); the write goes on without it.

The header names the block (its id, the identity fingerprint of the server that
wrote it) and carries an xxh3-64 checksum of the block bytes. A read is served
only when the magic, the header checksum, the fingerprint, the block id and the
data checksum all match; anything else is a miss.
"""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING, Optional

import msgspec
import numpy as np
import xxhash

from sglang_kvbm.core.pages import Page, one_page

if TYPE_CHECKING:
    import torch

HEADER_ALIGN = 4096  # O_DIRECT
NAME_BYTES = 768  # cache_salt + lora_name (UTF-8) that always fit
_FIXED_BYTES = 256  # the rest with 16-byte fingerprints and 64-character ids: 222 bytes at most
_TOKEN_BYTES = 9  # msgpack's widest integer
_FRAMING_BYTES = 78  # prefix, msgpack headers of every field, the fixed-width integers
MAGIC = b"SGKVBM\x00\x01"
_PREFIX = struct.Struct("<8sIQ")  # magic, payload length, payload xxh3-64
FORMAT_VERSION = 2  # 2: headers carry the parent's block id


class BlockHeader(msgspec.Struct, array_like=True, frozen=True):
    fingerprint: bytes
    block_id: str
    checksum: int  # xxh3-64 of the block bytes (the whole padded row)
    token_ids: list[int]
    event_hash: Optional[int] = None
    event_parent: Optional[int] = None
    cache_salt: Optional[str] = None
    lora_name: Optional[str] = None
    parent_id: Optional[str] = None
    bigram: bool = False  # EAGLE pages: token_ids holds one raw token more (see ``core.pages``)

    @classmethod
    def of(cls, page: Page, checksum: int, fingerprint: bytes) -> "BlockHeader":
        return cls(fingerprint, page.block_id, checksum, list(page.token_ids), page.event_hash, page.event_parent,
                   page.cache_salt, page.lora_name, page.parent_id, page.bigram)

    def meta(self) -> Page:
        return one_page(self.block_id, self.token_ids, parent_id=self.parent_id, event_hash=self.event_hash,
                        event_parent=self.event_parent, cache_salt=self.cache_salt, lora_name=self.lora_name,
                        bigram=self.bigram)


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(BlockHeader)


class HeaderTooLarge(ValueError):
    """A block's header (long token ids or names) does not fit its header row."""


def header_bytes_for(page_size: int) -> int:
    """The header row of a page size: its token ids, the fixed fields and ``NAME_BYTES``, 4 KiB-aligned."""
    return -(-(_FIXED_BYTES + NAME_BYTES + _TOKEN_BYTES * page_size) // HEADER_ALIGN) * HEADER_ALIGN


def header_fits(meta: Page, fingerprint: bytes, header_bytes: int) -> bool:
    """Whether ``meta``'s header fits a row of ``header_bytes`` (an upper bound on its size, any checksum)."""
    size = _FRAMING_BYTES + len(fingerprint) + _TOKEN_BYTES * len(meta.token_ids)
    size += sum(len(s.encode()) for s in (meta.block_id, meta.parent_id, meta.cache_salt, meta.lora_name) if s)
    return size <= header_bytes


def checksum(row: torch.Tensor) -> int:
    """xxh3-64 of a contiguous uint8 row, without copying it."""
    return xxhash.xxh3_64_intdigest(memoryview(row.numpy()))


def encode_header(header: BlockHeader, out: torch.Tensor) -> None:
    """Write ``header`` into a uint8 header row (of :func:`header_bytes_for` bytes)."""
    payload = _encoder.encode(header)
    if _PREFIX.size + len(payload) > out.numel():
        raise HeaderTooLarge(f"header of block {header.block_id[:16]} is {len(payload)} bytes, its row {out.numel()}")
    buf = out.numpy()
    buf[:] = 0
    prefix = _PREFIX.pack(MAGIC, len(payload), xxhash.xxh3_64_intdigest(payload))
    buf[: _PREFIX.size] = np.frombuffer(prefix, dtype=np.uint8)
    buf[_PREFIX.size : _PREFIX.size + len(payload)] = np.frombuffer(payload, dtype=np.uint8)


def decode_header(row: torch.Tensor) -> Optional[BlockHeader]:
    """The header in a header row, or None if it is not a whole, intact header."""
    return parse_header(row.numpy().tobytes())


def parse_header(raw: bytes) -> Optional[BlockHeader]:
    """:func:`decode_header` of the row's bytes."""
    magic, length, digest = _PREFIX.unpack_from(raw)
    if magic != MAGIC or length > len(raw) - _PREFIX.size:
        return None
    payload = raw[_PREFIX.size : _PREFIX.size + length]
    if xxhash.xxh3_64_intdigest(payload) != digest:
        return None
    try:
        return _decoder.decode(payload)
    except msgspec.DecodeError:
        return None
