"""SGLang's HiCache (the default tree with its own host tier) on ``gpu_e2e.py``'s device, beside this library's.

HiCache's host <-> device copies, with ``--hicache-io-backend direct
--hicache-mem-layout layer_first``, are one op: ``sgl_kernel.kvcacheio.transfer_kv_direct``
(sgl-kernel ``csrc/kvcacheio/transfer.cu``). It has no kernel of its own: it
takes the indices to the host, merges runs of consecutive source *and*
destination token indices, and per run and layer calls
``dst[d:d+n].copy_(src[s:s+n], non_blocking=True)`` on the current stream
(``cudaMemcpyAsync``). Where ``sgl_kernel`` is a stub (the GPU pack), calling it
raises, so :func:`transfer_kv_direct` below is that same loop in Python, put in
its place: the same copies in the same order, Python's per-run overhead instead
of C++'s. Nothing else HiCache runs on CUDA needs SGLang's kernels: its host pool
is pinned with ``cudaHostRegister`` (``torch.cuda.cudart``), its streams and
events are torch's, and its JIT-kernel probes (``can_use_hicache_jit_kernel``)
fail under the stub and fall back, with a warning. On CPU it also takes
``hicache_inproc.patch_for_cpu``'s patches (no page-locking, no-op CPU stream
sync, no pinned dummy page).
"""

from __future__ import annotations

import dataclasses
import time
from array import array

import torch

NEEDS = ("HiCache (--hicache-io-backend direct, layer_first) calls one SGLang kernel op on CUDA: "
         "sgl_kernel.kvcacheio.transfer_kv_direct, a C++ loop of per-run tensor copies; this benchmark runs the "
         "same copies from Python in its place (gpu_hicache.transfer_kv_direct). Its default backend, 'kernel', "
         "needs sgl_kernel's transfer_kv_per_layer / transfer_kv_all_layer or SGLang's JIT HiCache kernels "
         "(tvm_ffi), which are not replaced here.")


_RUNS = {"key": None, "runs": [], "last": 0}  # one load's run decomposition, reused by its other layers


def transfer_kv_direct(src_layers, dst_layers, src_indices, dst_indices, page_size=None, **_):
    """``sgl_kernel.kvcacheio.transfer_kv_direct`` in torch: per run of consecutive indices (both sides), per
    layer, one non-blocking copy on the current stream. The runs of one load are computed once (a load calls this
    per layer with the same indices; the C++ op walks them per call, ~a microsecond per thousand)."""
    src, dst = src_indices.cpu(), dst_indices.cpu()  # the C++ op does the same
    count = src.numel()
    if count == 0:
        return
    key = _RUNS["key"]
    if key is None or key[0].shape != src.shape or key[0].dtype != src.dtype or key[1].dtype != dst.dtype or not (
            torch.equal(key[0], src) and torch.equal(key[1], dst)):
        breaks = ((src[1:] - src[:-1]) != 1) | ((dst[1:] - dst[:-1]) != 1)
        starts = torch.cat([torch.zeros(1, dtype=torch.long), breaks.nonzero().flatten() + 1])
        lengths = torch.diff(starts, append=torch.tensor([count]))
        _RUNS["runs"] = list(zip(src[starts].tolist(), dst[starts].tolist(), lengths.tolist()))
        _RUNS["key"] = (src.clone(), dst.clone())
    _RUNS["last"] = len(_RUNS["runs"])
    for s, d, n in _RUNS["runs"]:
        for src_layer, dst_layer in zip(src_layers, dst_layers):
            dst_layer[d : d + n].copy_(src_layer[s : s + n], non_blocking=True)


def build(params, pool_tokens: int, host_tokens: int, device: str):
    """HiCache on ``params`` (its own pool): ``UnifiedRadixCache.init_hicache`` with its direct I/O backend."""
    import sglang.srt.mem_cache.pool_host.mha as mha
    from sglang.srt.mem_cache.unified_cache.components import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
    from sglang.srt.runtime_context import publish
    from sglang.srt.server_args import ServerArgs

    if device == "cpu":
        import hicache_inproc

        hicache_inproc.patch_for_cpu()
    mha.transfer_kv_direct = transfer_kv_direct
    server_args = ServerArgs(model_path="dummy", device=device, enable_hierarchical_cache=True,
                             hicache_io_backend="direct", hicache_mem_layout="layer_first",
                             hicache_write_policy="write_through", hicache_ratio=host_tokens / pool_tokens)
    publish(server_args, role="scheduler")  # init_hicache and the host pool read it
    params.tree_components = (ComponentType.FULL,)
    tree = UnifiedRadixCache(params)
    tree.init_hicache(server_args, params)
    params.token_to_kv_pool_allocator.get_kvcache().register_layer_transfer_counter(
        tree.cache_controller.layer_done_counter)  # the forward's reads wait on it, per layer
    return tree


@dataclasses.dataclass
class Hit:
    indices: torch.Tensor
    device_tokens: int
    loaded_tokens: int
    consumer: int  # the load's index on HiCache's layer counter (-1: none)
    locks: list
    enqueue_s: float = 0.0  # ready_to_load_host_cache: HiCache enqueues every layer's copies on this thread
    runs: int = 0  # copies per layer and K or V (runs of consecutive slots)


class HiCache:
    """HiCache driven as SGLang's scheduler drives it, for one request at a time."""

    def __init__(self, params, pool_tokens: int, host_tokens: int, device: str) -> None:
        self.device, self.pool_tokens = device, pool_tokens
        self.tree = build(params, pool_tokens, host_tokens, device)
        self.counter = self.tree.cache_controller.layer_done_counter

    def settle(self) -> None:
        """Every copy done, and acknowledged by the tree (write-through backups, loads: their nodes unlock)."""
        if self.device == "cuda":
            torch.cuda.synchronize()
        self.tree.check_hicache_events()

    def insert(self, tokens, slots: torch.Tensor) -> None:
        """A prefill's pages cached; write-through backs them up to HiCache's host pool."""
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        self.tree.insert(InsertParams(key=RadixKey(array("q", tokens)), value=slots.to(torch.int64)))
        self.tree.flush_pending_backups()  # the scheduler submits write-through after a batch
        self.settle()

    def evict_all(self) -> None:
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        self.settle()
        self.tree.evict(EvictParams(num_tokens=self.pool_tokens))

    def prefix(self, tokens, rid: str) -> Hit:
        """Admission: match, load back from host (layer-wise, started), lock; as ``hicache_inproc.steps``."""
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams, MatchPrefixParams
        from sglang.srt.mem_cache.radix_cache import RadixKey
        from sglang.srt.sampling.sampling_params import SamplingParams

        tree = self.tree
        req = Req(rid, "", array("q", tokens), SamplingParams(max_new_tokens=1))
        match = tree.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens), limit=len(tokens) - 1), req=req))
        node, device = match.last_device_node, match.device_prefix_len
        locks = [(node, tree.inc_lock_ref(node).to_dec_params())]
        loaded, consumer, enqueue_s = 0, -1, 0.0
        if match.host_hit_length:
            req.last_node = node
            loaded, new_node = tree.init_load_back(InitLoadBackParams(
                best_match_node=match.best_match_node, host_hit_length=match.host_hit_length, req=req))
            if loaded:
                started = time.perf_counter()
                consumer = tree.ready_to_load_host_cache()
                enqueue_s = time.perf_counter() - started
                locks.append((new_node, tree.inc_lock_ref(new_node).to_dec_params()))
                node = new_node
        indices = tree.path_device_indices(node)[: device + loaded]
        return Hit(indices, device, loaded, consumer, locks, enqueue_s, _RUNS["last"] if loaded else 0)

    def release(self, hit: Hit) -> None:
        self.settle()  # the load acknowledged: the tree lets go of its own lock
        for node, lock in reversed(hit.locks):
            self.tree.dec_lock_ref(node, lock)

    def close(self) -> None:
        import atexit

        try:
            self.settle()
            self.tree.shutdown()
            self.tree.release_host_resources()
            atexit.unregister(self.tree.shutdown)
        finally:
            plain_context(self.device)


def plain_context(device: str) -> None:
    """Publish a plain runtime context again: the next stacks are this library's, built without HiCache."""
    from sglang.srt.runtime_context import publish
    from sglang.srt.server_args import ServerArgs

    publish(ServerArgs(model_path="dummy", device=device), role="tokenizer")
