"""What a block looks like on disk, and how it proves it is intact.

Every disk slot is one 4 KiB header followed by the block's bytes::

    [ magic 8 | header length 4 | header xxh3 8 | msgpack(BlockHeader) | zero pad ] [ block bytes ]

The header names the block (its id, the identity fingerprint of the server that
wrote it) and carries an xxh3-64 checksum of the block bytes. A read is served
only when the magic, the header checksum, the fingerprint, the block id and the
data checksum all match; anything else is a miss.
"""

from __future__ import annotations

import struct
from typing import Optional

import msgspec
import numpy as np
import torch
import xxhash

from sglang_kvbm.core.ports import BlockMeta, EventIdentity

HEADER_BYTES = 4096
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

    @classmethod
    def of(cls, meta: BlockMeta, checksum: int, fingerprint: bytes) -> "BlockHeader":
        ev = meta.event
        return cls(
            fingerprint,
            meta.block_id,
            checksum,
            list(meta.token_ids),
            None if ev is None else ev.block_hash,
            None if ev is None else ev.parent_block_hash,
            None if ev is None else ev.cache_salt,
            None if ev is None else ev.lora_name,
            meta.parent_id,
        )

    def meta(self) -> BlockMeta:
        event = None
        if self.event_hash is not None:
            event = EventIdentity(self.event_hash, self.event_parent, self.cache_salt, self.lora_name)
        return BlockMeta(self.block_id, tuple(self.token_ids), event, self.parent_id)


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(BlockHeader)


class HeaderTooLarge(ValueError):
    """A block's header (long token ids or salt) does not fit in one 4 KiB header."""


def checksum(row: torch.Tensor) -> int:
    """xxh3-64 of a contiguous uint8 row, without copying it."""
    return xxhash.xxh3_64_intdigest(memoryview(row.numpy()))


def encode_header(header: BlockHeader, out: torch.Tensor) -> None:
    """Write ``header`` into a 4 KiB uint8 row."""
    payload = _encoder.encode(header)
    if _PREFIX.size + len(payload) > HEADER_BYTES:
        raise HeaderTooLarge(f"header of block {header.block_id[:16]} is {len(payload)} bytes")
    buf = out.numpy()
    buf[:] = 0
    prefix = _PREFIX.pack(MAGIC, len(payload), xxhash.xxh3_64_intdigest(payload))
    buf[: _PREFIX.size] = np.frombuffer(prefix, dtype=np.uint8)
    buf[_PREFIX.size : _PREFIX.size + len(payload)] = np.frombuffer(payload, dtype=np.uint8)


def decode_header(row: torch.Tensor) -> Optional[BlockHeader]:
    """The header in a 4 KiB row, or None if it is not a whole, intact header."""
    raw = row.numpy().tobytes()
    magic, length, digest = _PREFIX.unpack_from(raw)
    if magic != MAGIC or length > HEADER_BYTES - _PREFIX.size:
        return None
    payload = raw[_PREFIX.size : _PREFIX.size + length]
    if xxhash.xxh3_64_intdigest(payload) != digest:
        return None
    try:
        return _decoder.decode(payload)
    except msgspec.DecodeError:
        return None
