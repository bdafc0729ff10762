"""A tensor-parallel pair: per-rank shards and directories, hits intersected across ranks by SGLang's wrapper,
and ``load()`` answering the same on both ranks when only one of them cannot load.

Two real processes over a gloo group (see rank_pair.py and tp_pair_worker.py for why not a TP=2 server).
SGLang requires every rank to take the same branch in ``load()``: a rank that loads while the other
recomputes pairs its next collective with another kind on the other rank (a crash, or in production a hang).
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
def ranks(tmp_path_factory):
    return [found["tp"] for found in results(tmp_path_factory)]


def _bytes_ok(result, attempt) -> bool:
    got = result[attempt]
    return len(got["pages"]) == got["loaded"] // PAGE and got["pages"] == result["written"][: len(got["pages"])]


def test_tp_pair_loads_the_common_prefix_of_both_ranks_each_from_its_own_shard(ranks):
    r0, r1 = (r["disagree"] for r in ranks)
    assert r0["local_hit"] == [8, 8] and r1["local_hit"] == [5, 5]  # (host run, host-or-disk run) per rank
    # SGLang intersects the ranks' restorable lengths: both load the 5 pages both hold.
    assert r0["hit"] == r1["hit"] == 20
    assert r0["loaded"] == r1["loaded"] == 20 and r0["landed"] and r1["landed"]
    for r in (r0, r1):  # each rank got its own shard back
        assert r["pages"] == r["written"][:5]
    assert r0["disk_dir"] != r1["disk_dir"]  # the rank is part of the disk identity
    assert r0["events"] > 0 and r1["events"] == 0  # only attention-TP rank 0 publishes


@pytest.mark.parametrize("scenario, first_hit, second_hit", [
    ("corrupt", 32, 12),  # rank 1's page 3 fails verification: afterwards both hold 3 pages in common
    ("slow_read", 16, 16),  # rank 1's read outlasts its meter's estimate: afterwards it is staged
    ("staging_race", 16, 4),  # rank 1 lost page 1 between lookup and load: afterwards 1 page in common
])
def test_a_load_only_one_rank_can_serve_is_refused_on_both(ranks, scenario, first_hit, second_hit):
    r0, r1 = (r[scenario] for r in ranks)
    for r in (r0, r1):
        assert r["first"]["hit"] == first_hit  # both looked it up as restorable
        assert r["first"]["loaded"] == 0  # and both recomputed: rank 0 could have loaded, rank 1 could not
        assert (r["second"]["hit"], r["second"]["loaded"], r["second"]["landed"]) == (second_hit, second_hit, True)
    assert _bytes_ok(r0, "second") and _bytes_ok(r1, "second")  # the next load, after the next collectives
