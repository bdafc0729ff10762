"""Reads kept where they land (``manager.kept_reads``): a load's blocks from disk join the host tier.

Real SGLang tree and pools on CPU, the disk tier on real files through NIXL.
After a disk load lands, its blocks are in host (bytes equal to what was
written, announced ``CPU_PINNED`` from ``disk``), so a return visit after the
device evicted them is a host hit that reads nothing from disk; with
``SGLANG_KVBM_KEEP_READS=0`` nothing is kept; host capacity bounds what is.
(The same path keeps G4 reads: ``tests/fleet`` checks it across hosts.)
"""

from __future__ import annotations

import pytest

from conftest import chain_links
from harness.disk import event_hash, load_exact, medium, on_disk_only
from sglang_kvbm.config import KvbmConfig

pytestmark = pytest.mark.usefixtures("loads_wait_for_their_reads")


def stack_of(stack_factory, tmp_path, **kwargs):
    kwargs.setdefault("host_blocks", 8)
    return stack_factory(disk_dir=tmp_path, events=True, disk_blocks=64, **kwargs)


def host_stored(events) -> list:
    return [e for e in events if type(e).__name__ == "BlockStored" and medium(e) == "CPU_PINNED"]


def test_a_disk_read_is_kept_in_host_and_a_return_visit_reads_no_disk(stack_factory, tmp_path):
    stack = stack_of(stack_factory, tmp_path)
    disk = stack.manager.tiers["disk"]
    prefix = list(range(500, 532))  # 8 pages: the whole host tier
    written = on_disk_only(stack, prefix, seed=3)
    ids = stack.block_ids(prefix)
    stack.tree.take_events()
    load_exact(stack, prefix, written)
    stack.settle()
    assert stack.linker.connector.peek(ids) == (8, 8)  # host holds it all now (and disk still does)
    stored = host_stored(stack.tree.take_events())
    assert [h for _, h in chain_links(stored)] == [event_hash(disk.store, i) for i in ids]
    assert stack.manager.stats["blocks_kept"] == 8
    assert stack.linker.connector.stats.offload_blocks["disk->host"] == 8
    stack.evict_all()
    stack.scramble_pool()
    reads = disk.store.stats.reads
    load_exact(stack, prefix, written, "again")  # from host rows the keep copied: byte for byte
    assert disk.store.stats.reads == reads
    stats = stack.linker.connector.stats
    assert stats.onboard_blocks_h2d == 8 and stats.onboard_blocks_d2d == 8


def test_keep_reads_off_leaves_host_as_it_was(stack_factory, tmp_path):
    stack = stack_of(stack_factory, tmp_path, config={"keep_reads": False})
    prefix = list(range(600, 632))
    written = on_disk_only(stack, prefix, seed=4)
    ids = stack.block_ids(prefix)
    stack.tree.take_events()
    load_exact(stack, prefix, written)
    stack.settle()
    assert stack.linker.connector.peek(ids) == (0, 8)
    assert host_stored(stack.tree.take_events()) == []
    assert stack.manager.kept is None


def test_host_capacity_bounds_what_is_kept_from_the_head_of_the_prefix(stack_factory, tmp_path):
    stack = stack_of(stack_factory, tmp_path, host_blocks=4)
    prefix = list(range(700, 732))  # 8 pages, host holds 4
    written = on_disk_only(stack, prefix, seed=5)
    ids = stack.block_ids(prefix)
    load_exact(stack, prefix, written)
    stack.settle()
    assert stack.linker.connector.peek(ids) == (4, 8)  # the head is kept: a lookup reaches it from the start
    assert stack.manager.stats["blocks_kept"] == 4
    assert stack.manager.stats["blocks_not_kept_no_room"] == 4


def test_the_setting_parses_and_defaults_on():
    assert KvbmConfig.from_env({}).keep_reads is True
    assert KvbmConfig.from_env({"SGLANG_KVBM_KEEP_READS": "0"}).keep_reads is False
