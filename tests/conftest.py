"""Shared fixtures: a real SGLang cache stack on CPU, and a locally generated model."""

from __future__ import annotations

import dataclasses
import threading
from array import array
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import pytest
import torch

from sglang_kvbm.kv_layout import PagedKvLayout


@dataclasses.dataclass
class Stack:
    """A KvbmRadixCache over real SGLang pools on CPU, as the scheduler builds them."""

    cache: object
    allocator: object
    kvcache: object
    layout: PagedKvLayout
    manager: object
    executor: Optional[ThreadPoolExecutor]
    page_size: int
    size: int

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


def build_stack(
    *,
    pool: str = "mha",
    size: int = 64,
    page_size: int = 4,
    host_blocks: int = 64,
    events: bool = False,
    gated: bool = False,
    min_offload_priority: int = 0,
    executor=None,
) -> Stack:
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool, ReqToTokenPool

    from sglang_kvbm.backends.local.manager import LocalBlockManager
    from sglang_kvbm.core.connector import KvbmConnector
    from sglang_kvbm.integration.sglang.events import SglangEventSink
    from sglang_kvbm.integration.sglang.kv_pool import paged_layout
    from sglang_kvbm.integration.sglang.radix_cache import KvbmRadixCache

    if pool == "mha":
        kvcache = MHATokenToKVPool(size, page_size, torch.float32, 2, 8, 2, "cpu", False)
    else:
        kvcache = MLATokenToKVPool(size, page_size, torch.bfloat16, 16, 8, 2, "cpu", False)
    allocator = PagedTokenToKVPoolAllocator(size, page_size, kvcache.dtype, "cpu", kvcache, need_sort=False)
    layout = paged_layout(kvcache, page_size)
    if gated:
        executor = GatedExecutor()
    manager = LocalBlockManager(layout, host_blocks, executor=executor)
    sink = SglangEventSink()
    connector = KvbmConnector(manager, sink, min_offload_priority=min_offload_priority)
    params = CacheInitParams(
        disable=False,
        req_to_token_pool=ReqToTokenPool(size=8, max_context_len=4096, device="cpu", enable_memory_saver=False),
        token_to_kv_pool_allocator=allocator,
        page_size=page_size,
        enable_kv_cache_events=events,
    )
    cache = KvbmRadixCache(params, connector, sink)
    return Stack(cache, allocator, kvcache, layout, manager, executor, page_size, size)


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


@pytest.fixture
def stack_factory():
    built = []

    def make(**kwargs) -> Stack:
        stack = build_stack(**kwargs)
        built.append(stack)
        return stack

    yield make
    for stack in built:
        if isinstance(stack.executor, GatedExecutor):
            stack.executor.gate.set()
        stack.cache.connector.close()


def make_req(tokens, rid: str = "r", *, cache_salt: Optional[str] = None, extra_key: Optional[str] = None):
    """A real scheduler ``Req`` for ``tokens``."""
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    return Req(
        rid, "", array("q", tokens), SamplingParams(max_new_tokens=1), extra_key=extra_key, cache_salt=cache_salt
    )


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    from sglang_kvbm.testing.model import TEST, make_model

    return make_model(tmp_path_factory.mktemp("model"), TEST)


# The request sequence the end-to-end tests replay: three 600-token prompts
# through a 1024-token device pool, then the first one again.
E2E_SEQUENCE = ["A", "B", "C", "A"]


def e2e_prompts():
    from sglang_kvbm.testing.model import prompt_ids

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
def stock_results(model_dir, tmp_path_factory):
    """Stock SGLang, a device pool large enough to keep every prompt: the reference outputs."""
    from sglang_kvbm.testing.server import SglangServer

    log = tmp_path_factory.mktemp("stock") / "server.log"
    with SglangServer(model_dir, max_total_tokens=8192, log_path=log) as server:
        results = run_e2e_sequence(server)
    # Keyed by position: "A" is the cold run, "A2" the repeat stock serves from its device pool
    # (the two differ in the last float bits on AVX-512 machines: another attention shape).
    return dict(zip(["A", "B", "C", "A2"], results))
