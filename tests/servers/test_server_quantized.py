"""A real server with FP8 KV (``--kv-cache-dtype fp8_e4m3``: SGLang's CPU FP8 pool) and the kvbm tiers.

The server's pool is too small to keep three 600-token prompts, so the first prompt, sent again,
comes back from the host tier: its greedy output must equal the same server's cold run of it
(logprobs within conftest.LOGPROB_TOLERANCE), and the hit must be the host tier's. The reference is
that cold run, not a stock FP8 server: what kvbm adds is the load, and a cold run computes its KV as
stock does (tests/servers/test_server_e2e.py shows kvbm's cold runs equal stock's; stock FP8 on CPU is
self-consistent: two stock servers that differ only in pool size agree).
"""

from __future__ import annotations

import pytest

from conftest import run_e2e_sequence, same_output
from sglang_kvbm.ops.demo.server import SglangServer

pytestmark = pytest.mark.server
FP8 = ["--kv-cache-dtype", "fp8_e4m3"]


def test_fp8_kv_host_hit_equals_the_cold_run(model_dir, tmp_path):
    with SglangServer(model_dir, max_total_tokens=1024, extra_args=[*FP8, "--radix-cache-backend", "kvbm"],
                      env={"DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": "2048"}, log_path=tmp_path / "kvbm.log") as kvbm:
        cold, _, _, again = run_e2e_sequence(kvbm)
    assert "kvbm: page " in (tmp_path / "kvbm.log").read_text()
    assert cold["meta_info"]["cached_tokens"] == 0, cold["meta_info"]
    details = again["meta_info"]["cached_tokens_details"]
    assert details.get("host", 0) > 500 and not details.get("device"), details  # the repeat came from the host tier
    assert same_output(again, cold)
