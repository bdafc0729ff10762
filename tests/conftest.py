"""Shared fixtures: a real SGLang cache stack on CPU, and a locally generated model."""

from __future__ import annotations

import dataclasses
import os
import threading
from array import array
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

import pytest
import torch

from sglang_kvbm.manager import lookups
from sglang_kvbm.transfer.kv_layout import PagedKvLayout
from sglang_kvbm.transfer.lanes import LaneExecutor

# Dynamo's environment of this checkout (harness.dynamo_env), also when the package under test is the
# installed wheel rather than this source tree; the servers the tests start inherit it.
os.environ.setdefault("DYNAMO_PYTHON", str(Path(__file__).resolve().parents[1] / ".venv-dynamo" / "bin" / "python"))

try:  # what the installed SGLang's seam carries (tests/gpu runs without SGLang)
    from sglang_kvbm.integration.sglang.compat import seam as _seam

    SEAM = _seam()
except ImportError:
    SEAM = None
LOADS_REFUSABLE = SEAM is None or SEAM.refusable_loads
# Tests of what a linker does when a load is refused or fails: SGLang 0.5.21 can be told neither (its lookups pin what
# they report, and a failed copy is copied again before the forward reads it: test_lookup_pins.py).
needs_refusable_loads = pytest.mark.skipif(
    not LOADS_REFUSABLE, reason="SGLang 0.5.21 takes no refused or failed load (lookup pins instead)")


def _nixl_version():
    from importlib import metadata

    from packaging.version import Version

    try:
        return Version(metadata.version("nixl"))
    except metadata.PackageNotFoundError:
        return None


# NIXL 1.5 (what ai-dynamo[sglang]==1.6.1 pins; .venv has 1.3.2, what kvbm==1.6.1 pins) reports a short read and an
# EIO below the filesystem as failed transfers itself, and its OBJ backend's writes to moto's S3 emulator never
# finish here (not investigated; make compat runs it): tests of NIXL 1.3.2's behaviour say so.
NIXL_VERSION = _nixl_version()
NIXL_1_5 = NIXL_VERSION is not None and NIXL_VERSION.release[:2] >= (1, 5)
needs_nixl_1_3 = pytest.mark.skipif(NIXL_1_5, reason=f"NIXL {NIXL_VERSION} behaves otherwise (conftest.NIXL_1_5)")


# SGLang 0.5.21's paged allocator has no CPU path (two Triton kernels, unconditionally): its servers at --page-size > 1
# load a test-only stand-in (tests/servers/cpu_paged_alloc, never shipped), stock and kvbm servers alike. It patches nothing on
# a release that has a CPU path.
CPU_PAGED_ALLOC_ENV = {"PYTHONPATH": str(Path(__file__).parent / "servers" / "cpu_paged_alloc"), "KVBM_TEST_CPU_PAGED_ALLOC": "1"}


def needs(feature: str):
    """Skip on an SGLang whose seam lacks ``feature`` (a ``compat.Seam`` field), naming the release that has it."""
    missing = SEAM is not None and not getattr(SEAM, feature)
    first = SEAM.first_version_with.get(feature, "0.5.23") if SEAM is not None else ""
    return pytest.mark.skipif(missing, reason=f"this SGLang lacks {feature} (sglang>={first} has it)")

# Every server and worker a test starts inherits this (SglangServer and the Dynamo processes pass the
# environment on): a disk or G4 hit a test asserts lands however busy the machine is, instead of
# being recomputed once the live budget (50 ms over the read meter's estimate) has passed. The
# budget itself is tested in process (test_disk_lanes.py), where stacks take no setting from here.
os.environ.setdefault("SGLANG_KVBM_LOAD_WAIT_MS", "30000")
# Likewise whether a disk hit is read at all: the disk's read meter against the model's prefill meter decides,
# and on a machine busy with other work a read can measure slower than prefill, so a server test would see its
# disk hits recomputed (a hit figure of 100% fell to 40% under a load of 4). What a server reads is these tests'
# subject; whether reading pays is test_onboard_policy.py's and test_disk_tier.py's, in process, on pinned inputs.
os.environ.setdefault("SGLANG_KVBM_DISK_ONBOARD", "always")
# Two pytest-xdist workers share this machine's cores, each with servers of several processes: PyTorch's
# OpenMP threads (one per core in every process, spinning between parallel regions) oversubscribe them. One
# thread per server process: the same server tests ran 16-17% faster side by side (a 2-core VM, two A/B
# pairs). It changes no test's subject; what a test compares (kvbm against stock, a hit against a cold run)
# runs under the same setting.
os.environ.setdefault("OMP_NUM_THREADS", "1")


class GatedExecutor(ThreadPoolExecutor):
    """One worker thread, as in production, that starts work only once ``gate`` is open.

    Makes "a copy is still in flight" a state a test can hold, without sleeps.
    """

    def __init__(self) -> None:
        super().__init__(max_workers=1, thread_name_prefix="kvbm-test-offload")
        self.gate = threading.Event()
        self.submit(self._hold)

    def _hold(self) -> None:
        if not self.gate.wait(timeout=120):
            raise TimeoutError("test gate never opened")


class GatedLanes(LaneExecutor):
    """The disk writer as in production (one thread, device -> disk ahead of background writes), each job
    held until the test lets it run (:meth:`allow`): makes "a disk write is queued" a state a test can hold."""

    def __init__(self, name: str = "kvbm-test-disk-write") -> None:
        super().__init__(name)
        self._passes = threading.Semaphore(0)
        self._held = threading.Condition()
        self.submitted = self.allowed = self.held = 0

    def _put(self, lane, fn, args, kwargs):
        self.submitted += 1
        def gated(*a, **k):
            with self._held:
                self.held += 1
                self._held.notify_all()
            try:
                if not self._passes.acquire(timeout=120):
                    raise TimeoutError("the test never let this job run")
            finally:
                with self._held:
                    self.held -= 1
            return fn(*a, **k)

        return super()._put(lane, gated, args, kwargs)

    def wait_held(self) -> None:
        """Return once the thread has taken a job and waits for its pass (so later jobs queue behind it)."""
        with self._held:
            assert self._held.wait_for(lambda: self.held, timeout=60), "the thread took no job"

    def allow(self, jobs: int = 1) -> None:
        self.allowed += jobs
        self._passes.release(jobs)

    def open(self) -> None:
        self.allow(1 << 20)

    def drain(self) -> None:
        """Let every job queued now run, and return once they have."""
        marker = self.submit(lambda: None)  # background: behind everything queued
        self.allow(max(0, self.submitted - self.allowed))
        marker.result(timeout=60)


@dataclasses.dataclass
class Stack:
    """SGLang's default tree over real pools on CPU with a KvbmLinker, as the scheduler builds it."""

    cache: object  # KvbmCache: the tree, the linker, and the custom-server calls
    allocator: object
    kvcache: object
    executor: Optional[ThreadPoolExecutor]
    page_size: int
    size: int
    writer: object = None  # GatedLanes, with gated_writer
    _loading: dict = dataclasses.field(default_factory=dict)  # rid -> the batch its load started in

    @property
    def tree(self):
        return self.cache.tree

    @property
    def linker(self):
        return self.cache.linker

    @property
    def manager(self):
        return self.cache.linker.manager

    @property
    def layout(self) -> PagedKvLayout:
        return self.cache.linker.layout

    def write_random(self, slots: torch.Tensor, seed: int) -> list[torch.Tensor]:
        """Fill the pages behind ``slots`` with random bytes; returns each page's bytes, in token order."""
        gen = torch.Generator().manual_seed(seed)
        written = []
        for page in (slots[:: self.page_size] // self.page_size).tolist():
            data = torch.randint(0, 256, (self.layout.page_bytes,), dtype=torch.uint8, generator=gen)
            self.layout.write_page(page, data)
            written.append(data)
        return written

    def scramble_pool(self) -> None:
        """Overwrite every device page, so a load that did nothing cannot pass for one that worked."""
        garbage = torch.full((self.layout.page_bytes,), 0xA5, dtype=torch.uint8)
        for page in range(self.layout.num_pages):
            self.layout.write_page(page, garbage)

    def insert(self, tokens, *, seed: int, cache_salt=None, extra_key=None, priority: int = 0):
        """Write random KV for ``tokens`` (not cached yet) into fresh pages and insert it, as a checkpoint does."""
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        slots = self.allocator.alloc(len(tokens))
        assert slots is not None, "test pool too small"
        written = self.write_random(slots, seed)
        key = RadixKey(array("q", tokens), extra_key, cache_salt=cache_salt)
        result = self.tree.insert(InsertParams(key=key, value=slots.to(torch.int64), priority=priority))
        assert result.prefix_len == 0
        return written

    def insert_tail(self, prefix, tail, *, seed: int):
        """Insert ``prefix + tail`` where ``prefix`` is on the device: only the tail gets new pages."""
        hit = self.cache.prefix(prefix + [0])
        assert hit.device_tokens == len(prefix), "the prefix is not on the device"
        slots = self.allocator.alloc(len(tail))
        written = self.write_random(slots, seed)
        self.cache.insert(prefix + tail, slots, hit)
        self.cache.release(hit)
        return written

    def block_ids(self, tokens, *, cache_salt=None, extra_key=None) -> list[str]:
        """The storage keys (block ids) of the full pages of ``tokens``, as SGLang computes them."""
        from sglang.srt.mem_cache.radix_cache import RadixKey
        from sglang.srt.mem_cache.utils import get_storage_hash_str

        key = RadixKey(array("q", tokens), extra_key, cache_salt=cache_salt).page_aligned(self.page_size)
        return get_storage_hash_str(key, None, page_size=self.page_size) if len(key) else []

    def evict(self, num_tokens: int) -> int:
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        return self.tree.evict(EvictParams(num_tokens=num_tokens)).num_tokens_evicted

    def settle(self) -> None:
        """Every copy done and every finished offload handed back to the tree (unlocking its node)."""
        assert self.cache.flush(timeout=60)

    def evict_all(self) -> int:
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        return self.tree.evict(EvictParams(num_tokens=self.size)).num_tokens_evicted

    def host_blocks(self) -> int:
        return len(self.manager.host) if self.manager.host is not None else 0

    def admit(self, tokens, rid: str = "r", *, cache_salt=None, extra_key=None, requeue: bool = True):
        """What the scheduler does for a new request: match, load back (queued), start the layer-wise load.

        Returns ``(req, match, loaded tokens, private slots of the load or None, consumer index)``. A request the
        tree keeps waiting (``init_load_back`` answered None: SGLang 0.5.21 with reads below host in flight) is
        matched again once they land, as the scheduler's next round does; ``requeue=False``: it loaded 0.
        """
        from concurrent.futures import wait

        for _ in range(3):
            got, waiting = self._admit_once(tokens, rid, cache_salt=cache_salt, extra_key=extra_key)
            if not waiting or not requeue:
                break
            wait(self.manager.staging.in_flight(), timeout=60)
        return got

    def _admit_once(self, tokens, rid: str, *, cache_salt, extra_key):
        from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams, MatchPrefixParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        from sglang_kvbm.integration.sglang.compat import admit_match, loaded_tail

        req = make_req(tokens, rid, cache_salt=cache_salt, extra_key=extra_key)
        usable = (len(tokens) - 1) // self.page_size * self.page_size
        key = RadixKey(array("q", tokens[:usable]), extra_key, cache_salt=cache_salt)
        match = self.tree.match_prefix(MatchPrefixParams(key=key, req=req))
        admit_match(req, match)
        loaded, slots, index = 0, None, -1
        answer = None
        if match.host_hit_length:
            answer = self.tree.init_load_back(InitLoadBackParams(
                best_match_node=match.best_match_node, host_hit_length=match.host_hit_length, req=req))
            if answer is None:  # kept waiting for its reads (SGLang 0.5.21, ``lookup_pins``)
                return (req, match, 0, None, -1), True
        if answer is not None:
            loaded, inserted = loaded_tail(answer)
            if inserted is not None:  # SGLang 0.5.21: the tail's slots, in the tree already
                slots = inserted.clone()
            elif loaded:
                slots = self.tree.linker.private_load_indices[rid].clone()
            if loaded:
                index = self.tree.ready_to_load_host_cache()
                self._loading[rid] = index
        return (req, match, loaded, slots, index), False

    def finish(self, req) -> bool:
        """After the forward: wait for the batch's loads; True when they landed."""
        index = self._loading.pop(req.rid, None)
        if LOADS_REFUSABLE:
            return not self.tree.finish_external_linker_loads([req])
        landed = self.cache.linker.layer_done_counter.finish(index) if index is not None else True
        self.tree.check_hicache_events()  # SGLang 0.5.21 unlocks the loaded node once the tree pops the batch
        return landed

    def read_pages(self, slots) -> list[torch.Tensor]:
        return [self.layout.read_page(p) for p in (slots[:: self.page_size] // self.page_size).tolist()]


def build_stack(
    *,
    pool: str = "mha",
    size: int = 64,
    page_size: int = 4,
    host_blocks: int = 64,
    disk_blocks: int = 0,
    disk_dir=None,
    events: bool = False,
    gated: bool = False,
    gated_writer: bool = False,
    reader=None,
    min_offload_priority: int = 0,
    executor=None,
    layers: int = 2,
    dynamo_format: bool = False,
    lora_names=None,
    disable_filter: bool = True,
    identity=None,
    config: Optional[dict] = None,
    device: str = "cpu",
    dtype: Optional[torch.dtype] = None,
    heads: Optional[int] = None,
    head_dim: Optional[int] = None,
    forward_stream=None,
) -> Stack:
    """``identity`` names the server the disk tier belongs to; ``config`` sets further KvbmConfig fields.

    ``device``, ``dtype`` (of an MHA or MLA pool), ``heads`` and ``head_dim`` (the MLA pool's latent and rope
    widths) shape the pools; ``fp8_e4m3`` is the FP8 pool SGLang builds for ``--kv-cache-dtype fp8_e4m3`` on
    CUDA (float8 storage, no quantization method)."""
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool, ReqToTokenPool

    from sglang_kvbm.config import KvbmConfig
    from sglang_kvbm.integration.sglang.compat import cache_init_params, lora_name_table
    from sglang_kvbm.integration.sglang.custom import build_cache

    if pool == "mha":
        kvcache = MHATokenToKVPool(size, page_size, dtype or torch.float32, heads or 2, head_dim or 8, layers, device,
                                   False)
    elif pool == "fp8_e4m3":
        kvcache = MHATokenToKVPool(size, page_size, torch.float8_e4m3fn, heads or 2, head_dim or 64, layers, device,
                                   False)
    elif pool in QUANTIZED_POOLS:  # SGLang's quantized KV recipes (--kv-cache-dtype), built as SGLang builds them
        kvcache = MHATokenToKVPool(size, page_size, torch.bfloat16, heads or 2, head_dim or 64, layers, device, False,
                                   quant_method=quant_method(pool, layers, page_size, device=device))
    else:
        kvcache = MLATokenToKVPool(size, page_size, dtype or torch.bfloat16, heads or 16, head_dim or 8, layers,
                                   device, False)
    allocator = PagedTokenToKVPoolAllocator(size, page_size, kvcache.dtype, device, kvcache, need_sort=False)
    if gated:
        executor = GatedExecutor()
    writer = GatedLanes() if gated_writer else None
    params = cache_init_params(
        disable=False,
        req_to_token_pool=ReqToTokenPool(size=8, max_context_len=4096, device=device, enable_memory_saver=False),
        token_to_kv_pool_allocator=allocator,
        page_size=page_size,
        enable_kv_cache_events=events,
        dynamo_kv_event_format=dynamo_format,
        kv_event_lora_names=lora_names or lora_name_table(),
    )
    kvbm_config = KvbmConfig(
        cpu_cache_blocks=host_blocks or None,
        disk_cache_blocks=disk_blocks or None,
        disk_cache_dir=str(disk_dir) if disk_dir else "/tmp",
        disable_disk_offload_filter=disable_filter,
        host_offload_min_priority=min_offload_priority,
        **(config or {}),
    )
    cache = build_cache(params, kvbm_config, identity=identity, offload_executor=executor, disk_writer=writer,
                        disk_reader=reader, forward_stream=forward_stream)
    return Stack(cache, allocator, kvcache, executor, page_size, size, writer)


QUANTIZED_POOLS = ("fp8", "fp4", "nvfp4")


def quant_method(name: str, layers: int, page_size: int, native_scales: bool = False, device: str = "cpu"):
    """SGLang's KV cache quantization method: CPU FP8 (no scales), FP4 block-16 and NVFP4 (per-token scales;
    ``native_scales``: NVFP4's page-major layout for SM100's kernels)."""
    from sglang.srt.layers.quantization.fp4_kv_cache_quant_method import (
        CPUFP8KVCacheMethod,
        FP4MXBlock16KVCacheMethod,
        NVFP4KVCacheMethod,
    )

    if name == "fp8":
        return CPUFP8KVCacheMethod()
    if name == "fp4":
        return FP4MXBlock16KVCacheMethod()
    return NVFP4KVCacheMethod(layers, device, page_size=page_size, native_scale_layout=native_scales)


class RecordingSink:
    """EventSink (the core's port) that keeps what it was told, in order."""

    def __init__(self):
        self.calls = []

    def stored(self, tier, blocks):
        self.calls.append(("stored", tier, [b.block_id for b in blocks]))

    def removed(self, tier, blocks):
        self.calls.append(("removed", tier, [b.block_id for b in blocks]))

    def ids(self, kind, tier):
        return [i for k, t, ids in self.calls if k == kind and t is tier for i in ids]


def chain_links(stores) -> list:
    """``(parent, block)`` for every block of a sequence of (possibly coalesced) BlockStored events."""
    links = []
    for event in stores:
        parent = event.parent_block_hash
        for block_hash in event.block_hashes:
            links.append((parent, block_hash))
            parent = block_hash
    return links


@pytest.fixture(scope="session")
def native_hash_loaded():
    """SGLang's storage hash is a torch extension each process loads under a file lock shared by every process
    (``~/.cache/torch_extensions``): load it before a test's clock starts. Under a full parallel run the first
    copy's ``describe`` waited on that lock past a 60 s bound (test_weight_updates, once in a 44-minute run)."""
    from sglang.srt.mem_cache.cpp_utils.native_hash import _load_native_hash_module

    _load_native_hash_module()


@pytest.fixture
def stack_factory(native_hash_loaded):
    built = []

    def make(**kwargs) -> Stack:
        stack = build_stack(**kwargs)
        built.append(stack)
        return stack

    yield make
    for stack in built:
        if isinstance(stack.executor, GatedExecutor):
            stack.executor.gate.set()
        if stack.writer is not None:
            stack.writer.open()
        stack.cache.close()


def make_req(tokens, rid: str = "r", *, cache_salt: Optional[str] = None, extra_key: Optional[str] = None):
    """A real scheduler ``Req`` for ``tokens``."""
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    return Req(
        rid, "", array("q", tokens), SamplingParams(max_new_tokens=1), extra_key=extra_key, cache_salt=cache_salt
    )


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    from sglang_kvbm.ops.demo.model import TEST, make_model

    return make_model(tmp_path_factory.mktemp("model"), TEST)


# The request sequence the end-to-end tests replay: three 600-token prompts
# through a 1024-token device pool, then the first one again.
E2E_SEQUENCE = ["A", "B", "C", "A"]


def e2e_prompts():
    from sglang_kvbm.ops.demo.model import prompt_ids

    return {name: prompt_ids(seed, 600) for seed, name in enumerate("ABC")}


# Logprobs of two server processes agree to about 1e-6, not to the bit. Measured on an
# AVX-512 machine: one decode step of a kvbm host hit 1.1e-6 from stock's device hit,
# deterministically, even single-threaded, every other step bit-equal (a one-step
# difference, so not the KV; most likely a matmul summing in another order), and stock
# SGLang's own device hit 6e-6 from its cold run (another attention shape). Wrong KV
# moves every later step by orders of magnitude more, and changes the greedy ids.
LOGPROB_TOLERANCE = 1e-4


def same_output(ours, theirs):
    """Greedy ids equal, and every output logprob within LOGPROB_TOLERANCE of the reference."""
    if ours["output_ids"] != theirs["output_ids"]:
        return False
    mine = [lp for lp, _, _ in ours["meta_info"]["output_token_logprobs"]]
    reference = [lp for lp, _, _ in theirs["meta_info"]["output_token_logprobs"]]
    return len(mine) == len(reference) and all(abs(a - b) <= LOGPROB_TOLERANCE for a, b in zip(mine, reference))


def run_e2e_sequence(server, names=E2E_SEQUENCE):
    prompts = e2e_prompts()
    return [server.generate(prompts[name], max_new_tokens=8) for name in names]


@pytest.fixture(scope="session")
def stock_server(model_dir, tmp_path_factory):
    """Stock SGLang (no kvbm), a device pool large enough to keep every prompt the tests send:
    the reference, one per session (per pytest-xdist worker), up until the session ends. Its
    first requests are the end-to-end sequence's, so that sequence's "A" is a cold run."""
    from sglang_kvbm.ops.demo.server import SglangServer

    log = tmp_path_factory.mktemp("stock") / "server.log"
    with SglangServer(model_dir, max_total_tokens=8192, log_path=log) as server:
        # Keyed by position: "A" is the cold run, "A2" the repeat stock serves from its device pool
        # (the two differ in the last float bits on AVX-512 machines: another attention shape).
        server.e2e = dict(zip(["A", "B", "C", "A2"], run_e2e_sequence(server)))
        yield server


@pytest.fixture(scope="session")
def stock_results(stock_server):
    """The end-to-end sequence's reference outputs (see ``stock_server``)."""
    return stock_server.e2e


@pytest.fixture
def loads_wait_for_their_reads(monkeypatch):
    """For tests of what a load serves, not of how long it may wait: a read of a file just recreated (or a first
    read on a busy machine) can outlast the live budget (3x the read meter's estimate + 50 ms; a first G4 fetch
    0.5 s), and the load would then recompute and serve nothing. ``test_disk_lanes.py`` tests that budget."""
    monkeypatch.setattr(lookups, "WAIT_FLOOR_S", 30.0)
    monkeypatch.setattr(lookups, "FIRST_READ_WAIT_S", 30.0)


def pytest_collection_modifyitems(config, items):
    """The files whose tests start servers first, then the rest, each in its own order: under
    pytest-xdist (``--dist loadfile``) the long files start at once and the many short ones fill in
    behind them, instead of one long file starting last on an otherwise idle worker."""
    starts_servers = {item.path for item in items if item.get_closest_marker("server")}
    items.sort(key=lambda item: item.path not in starts_servers)  # stable: order within a file kept
