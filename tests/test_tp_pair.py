"""A tensor-parallel pair: per-rank shards and directories, hits intersected across ranks by SGLang's wrapper.

Two real processes over a gloo group (see tp_pair_worker.py for why not a TP=2 server).
"""

import json
import subprocess
import sys
from pathlib import Path

from sglang_kvbm.testing.server import free_port

HERE = Path(__file__).resolve().parent


def test_tp_pair_loads_the_common_prefix_of_both_ranks_each_from_its_own_shard(tmp_path):
    port = free_port()
    procs = [
        subprocess.Popen([sys.executable, str(HERE / "tp_pair_worker.py"), str(rank), str(port),
                          str(tmp_path / f"rank{rank}.json"), str(tmp_path / "disk")])
        for rank in (0, 1)
    ]
    try:
        for proc in procs:
            assert proc.wait(timeout=300) == 0
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    r0, r1 = (json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1))
    assert r0["local_hit"] == [8, 8] and r1["local_hit"] == [5, 5]  # (host run, host-or-disk run) per rank
    # SGLang intersects the ranks' restorable lengths: both load the 5 pages both hold.
    assert r0["host_hit_length"] == r1["host_hit_length"] == 20
    assert r0["loaded"] == r1["loaded"] == 20 and r0["landed"] and r1["landed"]
    assert r0["bytes_ok"] and r1["bytes_ok"]  # each rank got its own shard back
    assert r0["disk_dir"] != r1["disk_dir"]  # the rank is part of the disk identity
    assert r0["events"] > 0 and r1["events"] == 0  # only attention-TP rank 0 publishes
