"""The version patch: applied to SGLang 0.5.23's real source, then served end to end with --enable-kvbm.

The patched tree runs from ``PYTHONPATH`` with plugins switched off
(``SGLANG_PLUGINS=none``), so the backend is reached through the patch's own
flags and registration, not the entry point.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import run_e2e_sequence, same_output
from sglang_kvbm.ops.demo.server import ServerError, SglangServer

pytestmark = pytest.mark.server

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def patched_tree(tmp_path_factory):
    dest = tmp_path_factory.mktemp("sglang") / "checkout"
    # The version patch and the upstream one-rank fix (its paths then run in every test here).
    subprocess.run([sys.executable, str(ROOT / "patches" / "checkout_sglang.py"), "--dest", str(dest),
                    "--patch", str(ROOT / "patches" / "sglang-v0.5.23-kvbm.patch"),
                    "--patch", str(ROOT / "patches" / "sglang-v0.5.23-linker-one-rank.patch")], check=True)
    assert "_attn_groups_reduce" in (dest / "python/sglang/srt/mem_cache/unified_radix_cache.py").read_text()
    return dest / "python"


def patched_server(model_dir, tree, log, kvbm_config):
    return SglangServer(
        model_dir,
        max_total_tokens=1024,
        extra_args=["--enable-kvbm", "--kvbm-config", json.dumps(kvbm_config)],
        env={"PYTHONPATH": str(tree), "SGLANG_PLUGINS": "none"},
        log_path=log,
    )


def test_patched_sglang_serves_host_hits_with_stock_output(model_dir, patched_tree, stock_results, tmp_path):
    log = tmp_path / "server.log"
    with patched_server(model_dir, patched_tree, log, {"DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": 2048}) as server:
        results = run_e2e_sequence(server)
    text = log.read_text()
    assert str(patched_tree) in text  # the patched tree is what ran
    # --enable-kvbm became SGLang's linker on its default tree.
    assert "Tree cache initialized: source=default impl=UnifiedRadixCache" in text
    assert "'unified_cache_external_linker_config': {'linker': 'KvbmLinker'" in text
    assert "kvbm: page 4 tokens" in text
    assert results[-1]["meta_info"]["cached_tokens_details"]["host"] == 596
    for ours, name in zip(results, ("A", "B", "C", "A2")):
        assert same_output(ours, stock_results[name]), name


def test_bad_kvbm_config_stops_the_launcher(model_dir, patched_tree, tmp_path):
    log = tmp_path / "server.log"
    server = patched_server(model_dir, patched_tree, log, {"cpu_cache_gb": -1})
    with pytest.raises(ServerError):
        server.start(timeout=600)
    server.stop()
    assert "--kvbm-config cpu_cache_gb='-1' must be a positive size" in log.read_text()


def test_one_rank_fix_keeps_tensor_parallel_ranks_agreeing(patched_tree):
    """The upstream fix skips the attention groups' reductions at one rank only: two gloo ranks on the patched
    tree still agree on every hit, load and offload (the TP pair tests, run on it)."""
    env = {**os.environ, "PYTHONPATH": str(patched_tree), "KVBM_TEST_PAIR_ROLES": "tp"}  # the patch is TP's
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(ROOT / "tests" / "sglang" /
                           "test_tp_pair.py")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout
