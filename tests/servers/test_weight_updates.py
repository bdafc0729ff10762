"""Weights replaced in memory, and the KV cache paused: SGLang's own weight updater drives the tiers.

In process, SGLang's real ``SchedulerWeightUpdaterManager`` methods run over a
real stack (SGLang's default tree, the linker, real host rows, a real disk tier
through NIXL), with the hooks this library installs on them. What cannot run
in a test process stands in: the model runner that loads new weights (the
real-server test at the end runs the real one), the scheduler object around
the tree (it only hands over ``tree_cache``), and the memory saver (the real
one pauses CUDA memory; the stand-in records when it is asked to).
"""

from __future__ import annotations

import threading

import pytest
import torch
from sglang.srt.constants import GPU_MEMORY_TYPE_CUDA_GRAPH, GPU_MEMORY_TYPE_KV_CACHE
from sglang.srt.disaggregation.kv_events import BlockRemoved
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.managers.io_struct import (
    EndWeightUpdateReqInput,
    ReleaseMemoryOccupationReqInput,
    UpdateWeightFromDiskReqInput,
    UpdateWeightsFromTensorReqInput,
)
from sglang.srt.managers.scheduler_components.weight_updater import (
    SchedulerWeightUpdaterManager,
    _WeightUpdateSession,
)
from sglang.srt.utils.torch_memory_saver_adapter import _TorchMemorySaverAdapterNoop

from conftest import build_stack
from harness.disk import event_hash, load_exact, on_disk_only
from sglang_kvbm.ops.demo.server import free_port

pytestmark = pytest.mark.usefixtures("loads_wait_for_their_reads")  # what a load serves, not how long it waits

NO_DRIVER = "Found no NVIDIA driver"  # release_memory_occupation ends with a CUDA synchronize


class Runner:
    """The model runner's weight updater as the scheduler calls it; answers ``ok`` (no model in this process)."""

    def __init__(self, ok: bool = True) -> None:
        self.weight_updater = self
        self.ok = ok

    def update_weights_from_disk(self, model_path, load_format, recapture_cuda_graph=False):
        return self.ok, "weights loaded" if self.ok else "failed halfway"

    def end_weight_update(self, *, run_post_load):
        pass


class Worker:
    def __init__(self, runner: Runner) -> None:
        self.runner = runner

    def weight_update_runners(self):
        return [("target", self.runner)]


class Scheduler:
    """What the updater reads of SGLang's scheduler."""

    disaggregation_mode = DisaggregationMode.NULL
    _engine_paused = False

    def __init__(self, tree) -> None:
        self.tree_cache = tree

    def record_weight_version_change(self, new_version=None):
        pass


class RecordingSaver(_TorchMemorySaverAdapterNoop):
    """The memory saver off (SGLang's no-op adapter), noting each pause and whether a copy was in flight then."""

    def __init__(self, stack, log: list) -> None:
        self.stack, self.log = stack, log

    def pause(self, tag: str):
        self.log.append(("pause", tag, self.stack.manager.busy()))
        return super().pause(tag)


def updater_for(stack, *, runner: Runner = None, log: list = None) -> SchedulerWeightUpdaterManager:
    """SGLang's scheduler-side weight updater over ``stack``'s tree (its constructor reads the server's TP group)."""
    log = [] if log is None else log
    updater = object.__new__(SchedulerWeightUpdaterManager)
    updater.tp_worker = Worker(runner or Runner())
    updater.draft_worker = None
    updater.memory_saver_adapter = RecordingSaver(stack, log)
    updater.flush_cache = lambda **kwargs: log.append(("flush", stack.manager.busy())) or stack.tree.reset() or True
    updater.is_fully_idle = lambda **kwargs: True
    updater.scheduler = Scheduler(stack.tree)
    updater.metrics_collector = None
    updater.offload_tags = set()
    updater.stashed_model_static_state = None
    updater._session = None
    updater.tp_cpu_group = None
    return updater


def removed(events, medium) -> set:
    return {h for e in events if isinstance(e, BlockRemoved) and e.medium == medium for h in e.block_hashes}


# -- the KV cache paused (--enable-memory-saver) --------------------------------------------


def release_on_a_thread(updater, tags):
    """Run ``release_memory_occupation`` as the scheduler thread would; returns the thread and what it raised."""
    raised = []

    def run():
        try:
            updater.release_memory_occupation(ReleaseMemoryOccupationReqInput(tags=tags))
        except RuntimeError as exc:  # its last line, torch.cuda.synchronize(), on a machine with no GPU
            raised.append(str(exc))

    thread = threading.Thread(target=run, name="scheduler")
    thread.start()
    return thread, raised


def test_kv_cache_is_paused_only_after_every_copy_ended(stack_factory):
    stack = stack_factory(gated=True)
    stack.insert(list(range(16)), seed=1)  # the tree's write-through: a device -> host copy, held at the gate
    assert stack.manager.busy()
    log = []
    thread, raised = release_on_a_thread(updater_for(stack, log=log), [GPU_MEMORY_TYPE_KV_CACHE])
    thread.join(timeout=1.0)
    assert thread.is_alive() and log == []  # not paused under the copy reading device KV
    stack.executor.gate.set()
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert log[:2] == [("pause", GPU_MEMORY_TYPE_KV_CACHE, False), ("flush", False)]
    assert all(NO_DRIVER in r for r in raised)


def test_a_release_that_keeps_the_kv_cache_waits_for_nothing(stack_factory):
    stack = stack_factory(gated=True)
    stack.insert(list(range(16)), seed=2)
    log = []
    thread, _ = release_on_a_thread(updater_for(stack, log=log), [GPU_MEMORY_TYPE_CUDA_GRAPH])
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert log == [("pause", GPU_MEMORY_TYPE_CUDA_GRAPH, True)]  # device KV untouched: copies go on


# -- weights replaced in memory ----------------------------------------------------------------


def disk_stack(tmp_path, **kwargs):
    return build_stack(host_blocks=4, disk_blocks=64, disk_dir=tmp_path, events=True, **kwargs)


def test_weights_updated_without_a_flush_drop_the_tiers_and_a_restart_reads_nothing_written_after(tmp_path):
    old_kv, new_kv = list(range(100, 116)), list(range(200, 216))
    a = disk_stack(tmp_path)
    try:
        on_disk_only(a, old_kv, seed=3)
        first_dir, first_fingerprint = a.manager.tiers["disk"].store.directory, a.manager.tiers["disk"].store.fingerprint
        old_hashes = {event_hash(a.manager.tiers["disk"].store, i) for i in a.block_ids(old_kv)}
        a.tree.take_events()
        answer = updater_for(a).update_weights_from_disk(UpdateWeightFromDiskReqInput(model_path="new", flush_cache=False))
        assert answer.success
        # Nothing the old weights produced is served any more, and the router hears so.
        assert a.linker.connector.peek(a.block_ids(old_kv)) == (0, 0)
        assert a.admit(old_kv + [1], "old")[1].host_hit_length == 0
        assert old_hashes <= removed(a.tree.take_events(), "DISK")
        # The disk tier moved to an identity no server started from the files computes.
        disk = a.manager.tiers["disk"].store
        assert disk.fingerprint != first_fingerprint and disk.directory != first_dir and not first_dir.exists()
        # It goes on serving the new weights' KV.
        written = on_disk_only(a, new_kv, seed=4)
        load_exact(a, new_kv, written, rid="new")
    finally:
        a.cache.close()

    b = disk_stack(tmp_path)  # a restart on the original files
    try:
        assert b.manager.tiers["disk"].store.directory == first_dir
        assert len(b.manager.tiers["disk"].store) == 0
        assert b.linker.connector.peek(b.block_ids(new_kv)) == (0, 0)
    finally:
        b.cache.close()


def test_an_update_that_answers_failure_drops_too(stack_factory, tmp_path):
    """SGLang answers failure after weights changed (flush refused, a draft failing after the target, a rollback)."""
    stack = stack_factory(host_blocks=8, disk_blocks=64, disk_dir=tmp_path)
    tokens = list(range(300, 316))
    stack.insert(tokens, seed=5)
    stack.settle()
    answer = updater_for(stack, runner=Runner(ok=False)).update_weights_from_disk(
        UpdateWeightFromDiskReqInput(model_path="new", flush_cache=False))
    assert not answer.success
    assert stack.linker.connector.peek(stack.block_ids(tokens)) == (0, 0)


def test_later_updates_drop_without_moving_again(stack_factory, tmp_path):
    stack = stack_factory(host_blocks=8, disk_blocks=64, disk_dir=tmp_path)
    updater = updater_for(stack)
    updater.update_weights_from_disk(UpdateWeightFromDiskReqInput(model_path="one", flush_cache=False))
    moved = stack.manager.tiers["disk"].store.directory, stack.manager.tiers["disk"].store.fingerprint
    tokens = list(range(400, 416))
    stack.insert(tokens, seed=6)
    stack.settle()
    assert stack.linker.connector.peek(stack.block_ids(tokens)) != (0, 0)
    updater.update_weights_from_disk(UpdateWeightFromDiskReqInput(model_path="two", flush_cache=False))
    assert stack.linker.connector.peek(stack.block_ids(tokens)) == (0, 0)
    assert (stack.manager.tiers["disk"].store.directory, stack.manager.tiers["disk"].store.fingerprint) == moved  # already this run's own


@pytest.fixture
def tp_group():
    """A TP group of one rank (gloo), for the barrier the updater's session calls end with."""
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield torch.distributed.group.WORLD
    torch.distributed.destroy_process_group()


def test_a_session_ended_drops_the_tiers(stack_factory, tp_group):
    """Weights written by a peer between begin and end (P2P/RDMA) come with no update call at all."""
    stack = stack_factory(host_blocks=8)
    tokens = list(range(500, 516))
    stack.insert(tokens, seed=7)
    stack.settle()
    updater = updater_for(stack)
    updater.tp_cpu_group = tp_group
    updater._session = _WeightUpdateSession(selector="all")  # what begin_weight_update leaves
    assert updater.end_weight_update(EndWeightUpdateReqInput()).success
    assert stack.linker.connector.peek(stack.block_ids(tokens)) == (0, 0)


def test_a_refused_session_end_keeps_the_tiers(stack_factory):
    stack = stack_factory(host_blocks=8)
    tokens = list(range(600, 616))
    stack.insert(tokens, seed=8)
    stack.settle()
    assert not updater_for(stack).end_weight_update(EndWeightUpdateReqInput()).success  # no session open
    assert stack.linker.connector.peek(stack.block_ids(tokens)) == (4, 4)  # host, host or disk


def test_a_server_without_this_linker_is_left_alone(stack_factory):
    stack = stack_factory(host_blocks=8)
    updater = updater_for(stack)
    updater.scheduler = None
    answer = updater.update_weights_from_tensor(UpdateWeightsFromTensorReqInput(serialized_named_tensors=[]))
    assert not answer.success  # SGLang's own refusal (no session), nothing of ours in the way


# -- a real server ---------------------------------------------------------------------------------


def identity_dirs(directory) -> list:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("sglang-kvbm-"))


@pytest.mark.server
def test_real_server_update_weights_from_disk_moves_the_disk_tier(model_dir, tmp_path):
    """SGLang's own /update_weights_from_disk, without a flush, in a real server: the disk tier moves to another
    identity and serves the new weights' KV from there. That a restart on the original files reads nothing of it
    is told in process (``test_weights_updated_without_a_flush_drop_the_tiers_and_a_restart_reads_nothing_written_after``),
    without a second server start."""
    import requests
    from test_server_disk import start

    from sglang_kvbm.ops.demo.model import prompt_ids

    directory = tmp_path / "kvbm-disk"
    before, after = ([prompt_ids(seed, 600) for seed in seeds] for seeds in ((20, 21, 22), (30, 31, 32)))
    with start(model_dir, directory, tmp_path / "server.log") as server:
        for prompt in before:
            server.generate(prompt, max_new_tokens=1)
        original = identity_dirs(directory)
        response = requests.post(f"{server.url}/update_weights_from_disk",
                                 json={"model_path": str(model_dir), "flush_cache": False}, timeout=600)
        assert response.json()["success"], response.text
        moved = identity_dirs(directory)
        assert len(original) == len(moved) == 1 and moved != original
        for prompt in after + after[:1]:  # the new weights' KV: device -> host -> disk, then served from disk
            result = server.generate(prompt, max_new_tokens=1)
        assert result["meta_info"]["cached_tokens_details"].get("storage", 0) > 0, result["meta_info"]
    assert "disk tier moved from identity" in (tmp_path / "server.log").read_text()
