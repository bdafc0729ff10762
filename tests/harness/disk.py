"""The disk tier seen from outside, for the tests: where a block's slot and bytes are, its events, faults to inject,
and stacks (``conftest.build_stack``) driven into "on disk only" and loaded back byte for byte."""

from __future__ import annotations

import itertools
from pathlib import Path

import torch
from sglang.srt.disaggregation.kv_events import BlockRemoved, BlockStored

from sglang_kvbm.integration.sglang.compat import device_prefix_len

_junk = itertools.count()


def medium(event) -> str:
    value = getattr(event, "medium", None)
    return getattr(value, "value", value) or "GPU"


def disk_removed(events) -> list[int]:
    return [h for e in events if isinstance(e, BlockRemoved) and medium(e) == "DISK" for h in e.block_hashes]


def disk_stored(events) -> list:
    return [e for e in events if isinstance(e, BlockStored) and medium(e) == "DISK"]


def slot_of(disk, block_id) -> int:
    slot = disk._index.slot(block_id)
    assert slot is not None, "not on disk"
    return slot


def event_hash(disk, block_id) -> int:
    return disk._index.header(slot_of(disk, block_id)).event_hash


def header_offset(disk, block_id) -> int:
    """Byte offset of a block's slot (its header) in its segment file."""
    return disk.segments.address(slot_of(disk, block_id))[1]


def data_offset(disk, block_id) -> int:
    return header_offset(disk, block_id) + disk.header_bytes


def segment_path(disk, block_id) -> Path:
    return disk.segments.of(slot_of(disk, block_id)).path


def flip_bit(path: Path, offset: int, mask: int = 0x01) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ mask]))


def push_out_of_host(stack) -> None:
    """Store as many unrelated blocks as the host holds: the least recently used host blocks leave it."""
    pages = stack.manager.host.capacity
    base = 1_000_000 + next(_junk) * 10_000
    stack.insert([base + i for i in range(pages * stack.page_size)], seed=base)
    stack.settle()


def on_disk_only(stack, tokens, *, seed: int) -> list[torch.Tensor]:
    """Insert ``tokens`` (every page goes to host, then to disk), then leave them on disk only."""
    written = stack.insert(tokens, seed=seed)
    stack.settle()
    push_out_of_host(stack)
    stack.evict_all()
    stack.scramble_pool()
    n = len(tokens) // stack.page_size
    assert stack.linker.connector.peek(stack.block_ids(tokens)) == (0, n), "not on disk only"
    return written


def load_exact(stack, tokens, written, rid="exact") -> None:
    """Admit ``tokens`` (all on host or disk): every page loads, byte for byte."""
    req, match, loaded, slots, _ = stack.admit(tokens + [1], rid)
    assert (device_prefix_len(match), loaded) == (0, len(tokens))
    assert stack.finish(req)
    for got, want in zip(stack.read_pages(slots), written):
        assert torch.equal(got, want)
    stack.allocator.free(slots)  # the request is done with them (it would insert them)


