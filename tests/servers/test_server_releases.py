"""``--radix-cache-backend kvbm`` on other SGLang releases' real servers: evicted prefixes come back from host and disk
with stock's greedy output (``make compat``).

CI proves SGLang 0.5.23 (every server test) and 0.5.21 (Dynamo's workers, ``test_dynamo*.py``). ``make compat`` runs
this file with ``KVBM_TEST_RELEASES`` naming the interpreters of other releases' environments (0.5.21's and
0.5.22's), and for each starts a stock server and a kvbm server whose device pool holds one prompt and whose host
tier holds less than one: of A, B, C, A, C, the second A comes from disk and the second C from host. On SGLang 0.5.21
both servers load the test-only CPU stand-in for its paged allocator's Triton kernels (``conftest.CPU_PAGED_ALLOC_ENV``).
Without ``KVBM_TEST_RELEASES`` every test here is skipped, by name.
"""

from __future__ import annotations

import os
import subprocess

import pytest

from conftest import CPU_PAGED_ALLOC_ENV, same_output
from sglang_kvbm.ops.demo.model import prompt_ids
from sglang_kvbm.ops.demo.server import SglangServer

pytestmark = pytest.mark.server

RELEASES = os.environ.get("KVBM_TEST_RELEASES", "").split()
SEQUENCE = ["A", "B", "C", "A", "C"]
PAGE = 4


def release_of(python: str) -> str:
    return subprocess.run([python, "-c", "from importlib.metadata import version; print(version('sglang'))"],
                          capture_output=True, text=True, check=True).stdout.strip()


@pytest.mark.skipif(not RELEASES, reason="KVBM_TEST_RELEASES names no other SGLang release's interpreter (make compat)")
@pytest.mark.parametrize("python", RELEASES or ["none"])
def test_evicted_prefixes_come_back_from_host_and_disk_with_stocks_output(python, model_dir, tmp_path):
    release = release_of(python)
    prompts = {name: prompt_ids(seed, 600) for seed, name in enumerate("ABC")}
    env = {**CPU_PAGED_ALLOC_ENV, "OMP_NUM_THREADS": "1"}
    with SglangServer(model_dir, python=python, page_size=PAGE, max_total_tokens=8192, env=env,
                      log_path=tmp_path / "stock.log") as stock:
        reference = [stock.generate(prompts[name], max_new_tokens=8) for name in SEQUENCE[:3]]
    tiers = {
        "DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": "160",  # 640 tokens: the last prompt stored, not the one before
        "DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS": "2048",
        "DYN_KVBM_DISK_CACHE_DIR": str(tmp_path / "disk"),
        "DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER": "true",
    }
    (tmp_path / "disk").mkdir()
    with SglangServer(model_dir, python=python, page_size=PAGE, max_total_tokens=1024, env={**env, **tiers},
                      extra_args=["--radix-cache-backend", "kvbm"], log_path=tmp_path / "kvbm.log") as kvbm:
        ours = [kvbm.generate(prompts[name], max_new_tokens=8) for name in SEQUENCE]
    want = dict(zip(SEQUENCE[:3], reference))
    for name, got in zip(SEQUENCE, ours):
        assert same_output(got, want[name]), f"sglang {release}: {name} differs from stock"
    a2, c2 = ours[3]["meta_info"], ours[4]["meta_info"]
    assert a2["cached_tokens_details"].get("storage", 0) > 0, f"sglang {release}: A was not served from disk: {a2}"
    assert c2["cached_tokens_details"].get("host", 0) > 0, f"sglang {release}: C was not served from host: {c2}"
