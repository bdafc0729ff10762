"""A real server with FP8 KV (``--kv-cache-dtype fp8_e4m3``: SGLang's CPU FP8 pool) and the kvbm tiers.

Stock SGLang with the same FP8 pool, large enough to keep every prompt, is the reference; the kvbm
server's pool is too small, so the repeated prompt comes back from the host tier. Greedy output must
equal stock's (logprobs within conftest.LOGPROB_TOLERANCE), and the hit must be the host tier's.
(Stock FP8 on CPU is self-consistent: two stock servers that differ only in pool size agree.)
"""

from __future__ import annotations

import pytest

from conftest import run_e2e_sequence, same_output
from sglang_kvbm.testing.server import SglangServer

pytestmark = pytest.mark.server
FP8 = ["--kv-cache-dtype", "fp8_e4m3"]


def test_fp8_kv_host_hit_equals_stock(model_dir, tmp_path):
    with SglangServer(model_dir, max_total_tokens=8192, extra_args=FP8, log_path=tmp_path / "stock.log") as stock:
        reference = run_e2e_sequence(stock)
    with SglangServer(model_dir, max_total_tokens=1024, extra_args=[*FP8, "--radix-cache-backend", "kvbm"],
                      env={"DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": "2048"}, log_path=tmp_path / "kvbm.log") as kvbm:
        ours = run_e2e_sequence(kvbm)
    assert "kvbm: local backend" in (tmp_path / "kvbm.log").read_text()
    details = ours[-1]["meta_info"]["cached_tokens_details"]
    assert details.get("host", 0) > 500 and not details.get("device"), details  # the repeat came from the host tier
    for got, want in zip(ours, reference):
        assert same_output(got, want)
