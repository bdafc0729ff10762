"""Security defaults: loopback binds, private files, refused shared directories, tenant isolation in
every tier, no unpickling or evaluation of input."""

from __future__ import annotations

import re
import stat
from array import array
from pathlib import Path

import pytest
import requests
import torch
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams
from sglang.srt.mem_cache.common import match_kv_cache
from sglang.srt.mem_cache.radix_cache import RadixKey

from conftest import make_req
from sglang_kvbm.backends.local.disk_setup import probe
from sglang_kvbm.config import ConfigError, KvbmConfig
from sglang_kvbm.integration.sglang import build_cache
from test_disk_tier import Tiers

SRC = Path(__file__).resolve().parents[1] / "src" / "sglang_kvbm"


def test_disk_tier_files_are_private(tmp_path):
    t = Tiers(tmp_path)
    t.store(list(range(16)), [1, 2, 3, 4])
    t.close()
    directory = next(tmp_path.glob("sglang-kvbm-*"))
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    files = list(directory.iterdir())
    assert {f.name for f in files} >= {"lock", "journal", "index.msgpack", "seg-0000.kv"}
    for f in files:
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f


def test_shared_cache_directory_is_refused_unless_sticky(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(ConfigError, match="writable by every user"):
        probe(shared, 1 << 20, zerofill_fallback=False, disable_o_direct=False)
    shared.chmod(0o1777)  # like /tmp: others cannot replace what this user creates
    probe(shared, 1 << 20, zerofill_fallback=False, disable_o_direct=False)


def test_endpoint_binds_loopback_by_default():
    config = KvbmConfig(cpu_cache_blocks=64, metrics=True, metrics_port=_free_port())
    cache = build_cache(_params(), config)
    try:
        assert cache.endpoint.address[0] == "127.0.0.1"
        url = f"http://127.0.0.1:{config.metrics_port}"
        assert requests.get(f"{url}/stats", timeout=10).status_code == 200
        # A body that is not JSON is refused, never decoded any other way.
        assert requests.post(f"{url}/tiers", data=b"\x80\x04pickle", timeout=10).status_code == 400
    finally:
        cache.close()


def _params():
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

    kvcache = MHATokenToKVPool(64, 4, torch.float32, 2, 8, 2, "cpu", False)
    allocator = PagedTokenToKVPoolAllocator(64, 4, torch.float32, "cpu", kvcache, need_sort=False)
    return CacheInitParams(
        disable=False,
        req_to_token_pool=ReqToTokenPool(size=4, max_context_len=1024, device="cpu", enable_memory_saver=False),
        token_to_kv_pool_allocator=allocator,
        page_size=4,
    )


def _free_port():
    from sglang_kvbm.testing.server import free_port

    return free_port()


def test_cache_salt_never_shares_blocks_in_any_tier(tmp_path):
    params = _params()
    config = KvbmConfig(cpu_cache_blocks=4, disk_cache_blocks=64, disk_cache_dir=str(tmp_path),
                        disable_disk_offload_filter=True)
    cache = build_cache(params, config, model_path="test-model")
    allocator = params.token_to_kv_pool_allocator
    tokens = list(range(100, 132))
    try:
        slots = allocator.alloc(32)
        cache.insert(InsertParams(key=RadixKey(array("q", tokens), cache_salt="tenant-a"), value=slots.to(torch.int64)))
        cache.connector.flush(timeout=60)
        cache.evict(EvictParams(num_tokens=64))
        for salt, expected in (("tenant-b", 0), (None, 0), ("tenant-a", 32)):
            req = make_req(tokens + [1], rid=f"r-{salt}", cache_salt=salt)
            match_kv_cache(req, cache)
            assert (req.prefix_len, req.host_hit_length) == (0, expected), salt
            tiers = cache.tier_tokens(tokens, cache_salt=salt)
            assert tiers.disk == expected and tiers.host <= 16, (salt, tiers)  # 4 host blocks: the rest is on disk
    finally:
        cache.close()


def test_nothing_on_an_input_path_is_unpickled_or_evaluated():
    offenders = []
    for path in SRC.rglob("*.py"):
        text = path.read_text()
        for pattern in (r"\bpickle\b", r"\beval\(", r"\bexec\(", r"marshal\.loads", r"yaml\.load\("):
            if re.search(pattern, text):
                offenders.append(f"{path.relative_to(SRC)}: {pattern}")
    assert not offenders
