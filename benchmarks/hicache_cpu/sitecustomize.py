"""Benchmark-only: lets SGLang's own hierarchical cache (HiCache) run on a CPU-only machine.

SGLang 0.5.23's HiCache does not start without CUDA: its host pool page-locks its
memory ("Found no NVIDIA driver") and its transfer kernels come from sgl-kernel's
CUDA build. With this directory on PYTHONPATH and ``KVBM_BENCH_HICACHE_CPU=1`` in
a server's environment, four runtime patches are applied in each SGLang process,
as each module is imported, and nowhere else:

1. ``mem_cache.pool_host.common._cuda_host_register``: a no-op (nothing to page-lock);
2. ``mem_cache.pool_host.mha.transfer_kv_direct``: a pure-torch copy, one
   ``index_select``/``index_copy_`` per layer buffer (what the CUDA kernel does);
3. ``torch.cpu.Stream.synchronize``: a no-op (CPU work is already synchronous);
4. ``MHATokenToKVPoolHost.get_dummy_flat_data_page``: built without ``pin_memory``.

Run HiCache with ``--enable-hierarchical-cache --hicache-io-backend direct
--hicache-mem-layout layer_first`` (the ``kernel`` io backend and page-first
layouts need CUDA), and ``--hicache-storage-backend file`` for its L3.
"""

import os

if os.environ.get("KVBM_BENCH_HICACHE_CPU") == "1":
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', '..', 'tests'))  # the harness
    from harness.import_patch import patch_on_import  # noqa: E402

    def _transfer_kv_direct(src_layers, dst_layers, src_indices, dst_indices, page_size=None, **_):
        src_indices = src_indices.to(device="cpu", dtype=__import__("torch").int64)
        dst_indices = dst_indices.to(device="cpu", dtype=src_indices.dtype)
        for src, dst in zip(src_layers, dst_layers):
            dst.index_copy_(0, dst_indices, src.index_select(0, src_indices))

    def _patch_common(module):
        module._cuda_host_register = lambda *args, **kwargs: None

    def _patch_mha(module):
        import torch

        module.transfer_kv_direct = _transfer_kv_direct
        torch.cpu.Stream.synchronize = lambda self: None

        def dummy_page(self):
            return torch.zeros((2, self.layer_num, self.page_size, self.head_num, self.head_dim),
                               dtype=self.dtype, device=self.device).flatten()

        module.MHATokenToKVPoolHost.get_dummy_flat_data_page = dummy_page

    _PATCHES = {
        "sglang.srt.mem_cache.pool_host.common": _patch_common,
        "sglang.srt.mem_cache.pool_host.mha": _patch_mha,
    }

    patch_on_import(_PATCHES)
