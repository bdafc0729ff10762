"""Test-only: SGLang 0.5.21's paged allocator on CPU, for servers at --page-size > 1 (never shipped in the library).

SGLang 0.5.21's ``PagedTokenToKVPoolAllocator`` launches two Triton kernels unconditionally
(``alloc_extend_kernel``, ``alloc_decode_kernel``; 0.5.22 on falls back to torch where Triton cannot
run), so a stock 0.5.21 server at ``--page-size 8`` dies on a CPU machine with "0 active drivers".
On a GPU this module is never needed. With this directory on ``PYTHONPATH`` and
``KVBM_TEST_CPU_PAGED_ALLOC=1``, both kernels are replaced, in every SGLang process, by plain
loops computing the same slots: a request's new tokens first fill the page its prefix ends in,
then take whole pages from the free list in order, each request after the pages of those before
it. The tests that use it say so; stock and kvbm servers alike run with it.
"""

import os

if os.environ.get("KVBM_TEST_CPU_PAGED_ALLOC") == "1":
    import sys

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # tests/: the harness
    from harness.import_patch import patch_on_import  # noqa: E402

    def _extend(prefix_lens, seq_lens, last_loc, free_pages, out_indices, _bs_pow2, page_size):
        taken, free, slots = 0, free_pages.tolist(), []
        for prefix, seq, last in zip(prefix_lens.tolist(), seq_lens.tolist(), last_loc.tolist()):
            for pos in range(prefix, seq):
                if pos % page_size and pos == prefix:  # the page the prefix ends in, after its last slot
                    slot = last + 1
                elif pos % page_size:
                    slot = slots[-1] + 1
                else:
                    slot, taken = free[taken] * page_size, taken + 1
                slots.append(slot)
        out_indices.copy_(out_indices.new_tensor(slots))

    def _decode(seq_lens, last_loc, free_pages, out_indices, _bs_pow2, page_size):
        taken, free, slots = 0, free_pages.tolist(), []
        for seq, last in zip(seq_lens.tolist(), last_loc.tolist()):
            if (seq - 1) % page_size == 0:
                slots.append(free[taken] * page_size)
                taken += 1
            else:
                slots.append(last + 1)
        out_indices.copy_(out_indices.new_tensor(slots))

    class _Grid:
        def __init__(self, fn):
            self._fn = fn

        def __getitem__(self, _grid):
            return self._fn

    def _patch(module) -> None:
        allocator = getattr(module, "PagedTokenToKVPoolAllocator", None)
        if "use_triton_kernels" in getattr(allocator.__init__, "__code__", None).co_names:  # a CPU path (0.5.22 on)
            return
        module.alloc_extend_kernel = _Grid(_extend)
        module.alloc_decode_kernel = _Grid(_decode)

    patch_on_import({"sglang.srt.mem_cache.allocator.paged": _patch})
