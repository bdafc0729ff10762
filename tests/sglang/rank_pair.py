"""One pair of real processes for tests/sglang/test_tp_pair.py and tests/sglang/test_pp_pair.py.

Run as a script (two processes over one gloo group), it plays the ranks of a
tensor-parallel pair (``tp_pair_worker``), then the stages of a pipeline-parallel
pair (``pp_pair_worker``): SGLang starts neither on CPU (its model-parallel set-up
builds pynccl on CUDA torch builds). Each process spends ~12 s importing SGLang,
so both tests share the one pair, started once per pytest session (:func:`results`).

A collective that pairs with another kind on the other process fails (or hangs
until gloo's timeout), which ends the process non-zero.
"""

import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
_results = None


def results(tmp_path_factory) -> list[dict]:
    """Each process's findings, ``{"tp": {scenario: ...}, "pp": {scenario: ...}}``, for ranks 0 and 1."""
    global _results
    if _results is None:
        _results = _run(tmp_path_factory.mktemp("pair"))
    return _results


def _run(tmp: Path) -> list[dict]:
    from sglang_kvbm.ops.demo.server import free_port

    port = free_port()
    procs = [subprocess.Popen([sys.executable, __file__, str(rank), str(port), str(tmp / f"rank{rank}.json"),
                               str(tmp / "disk")])
             for rank in (0, 1)]
    try:
        codes = [proc.wait(timeout=300) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert codes == [0, 0], "a rank or stage failed: its collectives did not pair up (see the output above)"
    return [json.loads((tmp / f"rank{rank}.json").read_text()) for rank in (0, 1)]


def main(rank: int, port: int, out: str, root: str) -> None:
    import datetime
    import os

    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(HERE))
    import pp_pair_worker
    import tp_pair_worker

    from sglang_kvbm.manager import lookups

    # Loads must land whatever the machine is doing (conftest.loads_wait_for_their_reads); the one
    # scenario about the budget (tp_pair_worker.slow_read) sets its own.
    lookups.WAIT_FLOOR_S = lookups.FIRST_READ_WAIT_S = 30.0

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=240))
    group = dist.group.WORLD  # the attention-TP group of the TP pair, then the PP group of the PP pair
    found: dict = {}
    # KVBM_TEST_PAIR_ROLES: which pairs to play (test_patch.py runs the TP pair alone on the patched tree)
    roles = os.environ.get("KVBM_TEST_PAIR_ROLES", "tp,pp").split(",")
    for role, worker in (("tp", tp_pair_worker), ("pp", pp_pair_worker)):
        if role not in roles:
            continue
        found[role] = {}
        for scenario in worker.SCENARIOS:
            found[role][scenario.__name__] = scenario(rank, group, f"{root}/{role}")
            check = torch.tensor([1])
            dist.all_reduce(check, group=group)  # a collective left unpaired by the scenario fails here at the latest
    with open(out, "w") as f:
        json.dump(found, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
