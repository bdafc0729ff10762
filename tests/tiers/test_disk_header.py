"""Disk slot headers sized from the page: big pages, large token ids, long salts and LoRA names.

A header row is ``DiskStore.header_bytes_for(page_size)`` bytes (4 KiB-aligned for
O_DIRECT); every block of that page size fits it with room for its names. A block
whose cache_salt/lora_name cannot fit is not written (a miss, one log line), and
the rest of the write goes on.
"""

from __future__ import annotations

import logging

import pytest
import torch

from harness.disk import disk_stored, load_exact, on_disk_only, push_out_of_host
from sglang_kvbm.core.pages import one_page
from sglang_kvbm.tiers.disk.store import DiskStore
from sglang_kvbm.tiers.format import BlockHeader, decode_header, encode_header, header_bytes_for

pytestmark = pytest.mark.usefixtures("loads_wait_for_their_reads")  # what a load serves, not how long it waits

WORST_ID = "f" * 64  # block ids are 64 hex characters
NAME_ROOM = 768  # what header_bytes_for promises cache_salt + lora_name together (UTF-8)


@pytest.mark.parametrize("page_size", [1, 1024])
def test_header_round_trips_at_page_1_and_1024_with_worst_case_ids(page_size):
    header = BlockHeader(
        fingerprint=b"\xff" * 16,
        block_id=WORST_ID,
        checksum=2**64 - 1,
        token_ids=[2**64 - 1] * page_size,  # msgpack's widest integer: 9 bytes each
        event_hash=-(2**63),
        event_parent=-(2**63),
        cache_salt="s" * (NAME_ROOM // 2),
        lora_name="l" * (NAME_ROOM // 2),
        parent_id=WORST_ID,
    )
    size = DiskStore.header_bytes_for(page_size)
    assert size == header_bytes_for(page_size) and size % 4096 == 0
    row = torch.empty(size, dtype=torch.uint8)
    encode_header(header, row)
    assert decode_header(row) == header


def test_a_header_longer_than_its_row_is_refused_on_read():
    row = torch.zeros(header_bytes_for(1024), dtype=torch.uint8)
    encode_header(BlockHeader(b"f" * 16, WORST_ID, 1, [200_000] * 1024), row)
    assert decode_header(row) is not None
    assert decode_header(row[:4096]) is None  # its length says it runs past the row: not a whole header


def test_page_1024_with_large_token_ids_is_written_and_read_back(stack_factory, tmp_path):
    stack = stack_factory(page_size=1024, size=4096, host_blocks=2, disk_blocks=16, disk_dir=tmp_path, events=True)
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(65536, 200_001, (2048,), generator=gen).tolist()
    written = on_disk_only(stack, tokens, seed=31)
    disk = stack.manager.tiers["disk"].store
    assert disk.header_bytes == 12288 and disk.stats.write_failures == 0
    for block_id in stack.block_ids(tokens):
        assert disk._index.header(disk._index.slot(block_id)).token_ids[0] >= 65536
    load_exact(stack, tokens, written)
    assert stack.linker.connector.stats.onboard_blocks_d2d == 2


@pytest.mark.parametrize("host_blocks", [4, 0], ids=["host-to-disk", "device-to-disk"])
def test_a_salt_too_long_for_the_header_is_a_miss_with_one_log_line(stack_factory, tmp_path, caplog, host_blocks):
    stack = stack_factory(host_blocks=host_blocks, disk_blocks=64, disk_dir=tmp_path, events=True)
    salt = "x" * 5000  # more than a 4 KiB header holds
    salted = [list(range(100, 108)), list(range(200, 208))]
    caplog.clear()  # what the stack said at start-up
    with caplog.at_level(logging.INFO, logger="sglang_kvbm"):
        for seed, tokens in enumerate(salted):
            stack.insert(tokens, seed=seed, cache_salt=salt)
            stack.settle()
        plain = list(range(300, 308))
        stack.insert(plain, seed=9)
        stack.settle()
    disk = stack.manager.tiers["disk"].store
    assert not any(disk.holds(b) for t in salted for b in stack.block_ids(t, cache_salt=salt))
    assert all(disk.registered(b) for b in stack.block_ids(plain))
    assert disk.stats.headers_too_large == 4 and disk.stats.write_failures == 0
    assert disk.accounting()["writing"] == 0  # the slots reserved for them went back
    ours = [r for r in caplog.records if r.name.startswith("sglang_kvbm") and r.levelno >= logging.WARNING]
    assert len(ours) == 1 and ours[0].levelno == logging.WARNING, caplog.text
    assert "cache_salt" in ours[0].getMessage()
    stored = {h for e in disk_stored(stack.tree.take_events()) for h in e.block_hashes}
    assert len(stored) == 2  # only the plain pages are announced on disk
    if host_blocks:
        push_out_of_host(stack)
    stack.evict_all()
    assert stack.admit(salted[0] + [1], cache_salt=salt)[1].host_hit_length == 0  # recomputed


def test_a_block_that_does_not_fit_leaves_the_rest_of_its_write(tmp_path):
    from sglang_kvbm.tiers.disk.setup import probe
    from sglang_kvbm.transfer.host_memory import aligned_empty

    found = probe(tmp_path, 1 << 20, zerofill_fallback=True, disable_o_direct=False)
    store = DiskStore(probe=found, num_slots=4, block_bytes=4096, fingerprint=b"f" * 16, page_size=16)
    try:
        rows = aligned_empty((3, 4096))
        store.register_dram(rows)
        for i in range(3):
            rows[i].fill_(i + 1)
        metas = [
            one_page(f"{i:064x}", tuple(range(16)), event_hash=i, cache_salt="x" * (5000 if i == 1 else 8))
            for i in range(3)
        ]
        reserved, _ = store.reserve([m.block_id for m in metas])
        headers = store.write(reserved, metas, list(rows))
        assert headers[1] is None and headers[0] is not None and headers[2] is not None
        registered = store.commit(reserved, headers)
        assert [m.block_id for m in registered] == [metas[0].block_id, metas[2].block_id]
        assert store.accounting()["writing"] == 0 and store.accounting()["free"] == 2
        began = store.begin_read([metas[0].block_id, metas[2].block_id])
        assert began is not None
        entries, holds = began
        back, header_rows = aligned_empty((2, 4096)), aligned_empty((2, store.header_bytes))
        store.register_dram(back)
        store.register_dram(header_rows)
        assert store.read(entries, list(back), list(header_rows)) == []
        store.end_read([metas[0].block_id, metas[2].block_id], holds)
        assert torch.equal(back[0], rows[0]) and torch.equal(back[1], rows[2])
    finally:
        store.close()
