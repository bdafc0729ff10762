"""A pipeline-parallel pair: the stages agree on every lookup, load and offload, each from its own layers' tiers.

Two real processes over a gloo group acting as PP stages 0 and 1 (see rank_pair.py and pp_pair_worker.py
for why not a PP=2 server; they are the TP pair's processes, which play that part first). SGLang runs a
scheduler per stage over the same requests and reduces linker answers over attention ranks only: stages
that answer differently run different batches (stage 1 would extend tokens stage 0 never computed) or
pair a collective with another kind (in production a hang).
"""

import pytest
from rank_pair import results

from conftest import needs_refusable_loads

# Two ranks (or stages) of the 0.5.22-on scheduler flow, refusals included. On SGLang 0.5.21 every rank pins at
# lookup what it reports and SGLang intersects the lengths (MIN), so no rank is ever asked for more than it pinned.
pytestmark = needs_refusable_loads
# The pair's workers build SGLang's sliding-window fixtures from its test kits (0.5.23 on).
pytest.importorskip("sglang.test.kits.unified_radix_cache", reason="SGLang before 0.5.23 ships no unified-radix-cache "
                    "test kits")

PAGE = 4


@pytest.fixture(scope="module")
def stages(tmp_path_factory):
    return [found["pp"] for found in results(tmp_path_factory)]


def _bytes_ok(got, written) -> bool:
    return len(got["pages"]) == got["loaded"] // PAGE and got["pages"] == written[: len(got["pages"])]


def test_stages_load_the_prefix_every_stage_holds_each_its_own_layers(stages):
    s0, s1 = (s["disagree"] for s in stages)
    assert s0["local_hit"] == [8, 8] and s1["local_hit"] == [5, 5]  # (host run, host-or-disk run) per stage
    assert s0["hit"] == s1["hit"] == 20  # the 5 pages both stages hold, not 8 on stage 0 and 5 on stage 1
    assert s0["loaded"] == s1["loaded"] == 20 and s0["landed"] and s1["landed"]
    for s in (s0, s1):  # each stage got its own layers' KV back, byte for byte
        assert s["pages"] == s["written"][:5]
    assert s0["written"] != s1["written"]  # (the stages' KV differ: a mix-up could not pass)
    assert (s0["start_layer"], s1["start_layer"]) == (0, 2)
    assert s0["disk_dir"] != s1["disk_dir"]  # the stage is part of the disk identity
    assert s0["events"] > 0 and s1["events"] == 0  # only PP rank 0 publishes


def test_a_load_one_stage_cannot_serve_is_refused_by_both(stages):
    s0, s1 = (s["staging_race"] for s in stages)
    for s in (s0, s1):
        assert (s["first"]["hit"], s["first"]["loaded"]) == (16, 0)  # both found 4 pages, both recomputed
        assert (s["second"]["hit"], s["second"]["loaded"], s["second"]["landed"]) == (4, 4, True)
        assert _bytes_ok(s["second"], s["written"])  # the next load, after the next collectives


def test_a_node_stays_locked_on_every_stage_until_every_stage_holds_it(stages):
    s0, s1 = (s["slow_offload"] for s in stages)
    assert (s0["local_done"], s1["local_done"]) == (1, 0)  # stage 0's copy ended, stage 1's did not
    # Unlocking it on stage 0 alone would let stage 0 evict a node stage 1 keeps: the trees would drift apart.
    assert s0["pending_while_one_copies"] == s1["pending_while_one_copies"] == 1
    assert s0["pending_after"] == s1["pending_after"] == 0


def test_a_layer_one_stage_failed_to_load_drops_the_request_on_both(stages):
    s0, s1 = (s["failed_landing"] for s in stages)
    for s in (s0, s1):
        assert (s["first"]["hit"], s["first"]["loaded"], s["first"]["landed"]) == (16, 16, False)
        assert (s["second"]["hit"], s["second"]["loaded"], s["second"]["landed"]) == (16, 16, True)
        assert _bytes_ok(s["second"], s["written"])


def test_a_sliding_window_hybrid_serves_the_boundary_every_stage_can_restore(stages):
    s0, s1 = (s["swa_window"] for s in stages)
    # Stage 1 lacks the window page of boundary 6: both serve boundary 5, with stage 0's and stage 1's own bytes.
    assert (s0["hit"], s0["loaded"]) == (s1["hit"], s1["loaded"]) == (5, 5)
    assert not s0["failed"] and not s1["failed"] and s0["bytes_equal"] and s1["bytes_equal"]


def test_stages_without_the_group_to_agree_over_refuse_to_start():
    """A PP worker whose pipeline group is missing could not make its stages agree: it says so at start-up."""
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams

    from sglang_kvbm.config import KvbmConfig
    from sglang_kvbm.integration.sglang.ranks import setup_of

    params = CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=None, page_size=4,
                             pp_rank=1, pp_size=2)
    with pytest.raises(ValueError, match="--pp-size 2.*could not agree"):
        setup_of(None, params, {"config": KvbmConfig(cpu_cache_blocks=8)})
