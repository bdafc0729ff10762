"""Drive the stack a GPU pack must carry, on CPU: SGLang's pools, allocator and default tree with a KvbmLinker over
a host and a disk tier (tests/conftest.py ``build_stack``), one store -> flush -> evict -> match -> load round trip
per tier and pool kind, bytes compared.

Three users: ``tests/gpu/pack.py`` runs it to find SGLang's import closure (``--modules``), ``tests/gpu/test_stubs.py``
runs it with the kernel stubs first on the path (``tests/gpu/stubs``), and a pack is checked by running it with
``PYTHONPATH=<pack>/site:src`` in an environment that has only what the GPU machine has.

    python tests/gpu/pack_drive.py [--pools mha,mla,fp8] [--hide-absent] [--modules FILE] [--report FILE]
    python tests/gpu/pack_drive.py --imports-as-cuda --modules FILE
    python tests/gpu/pack_drive.py --hide-absent --modules FILE --run benchmarks/gpu_e2e.py --quick

Prints one JSON line (what ran, which stubs were imported, which were called) and exits 0 when every round trip
returned the bytes that were stored and no stub was called. ``--imports-as-cuda`` only imports the stack's modules
with torch claiming an H200 (SGLang picks its imports by ``is_cuda()`` when a module loads): what the GPU machine
imports beyond the CPU run, for the closure. ``--run`` runs a script (or ``-m module``) instead, on CPU, and
records what it imported (its exit status is the report's ``run_exit``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
POOLS = ("mha", "mla", "fp8")
# What the GPU tests import (tests/gpu/test_sglang_on_cuda.py, benchmarks/gpu_e2e.py): the stack's entry points.
ENTRY_MODULES = (
    "sglang.srt.mem_cache.memory_pool", "sglang.srt.mem_cache.allocator.paged", "sglang.srt.mem_cache.unified_radix_cache",
    "sglang.srt.managers.schedule_batch", "sglang.srt.sampling.sampling_params", "sglang.srt.server_args",
    "sglang.srt.runtime_context", "sglang.srt.layers.quantization.fp4_kv_cache_quant_method",
    "sglang_kvbm.integration.sglang.custom", "sglang_kvbm.integration.sglang.linker", "sglang_kvbm.tiers.disk.nixl_io",
    "nixl._api",
)


def _imports_as_cuda() -> dict:
    """Import ENTRY_MODULES with torch reporting one H200 (CUDA 13): SGLang's ``if _is_cuda:`` imports run."""
    import torch

    class Props:
        name, major, minor, multi_processor_count = "NVIDIA H200", 9, 0, 132
        total_memory, L2_cache_size, warp_size, gcnArchName, uuid = 140 << 30, 60 << 20, 32, "sm_90", "0"

    cuda = torch.cuda
    cuda.is_available, cuda.device_count, cuda.current_device = (lambda: True), (lambda: 1), (lambda: 0)
    cuda.get_device_capability = lambda *a, **k: (9, 0)
    cuda.get_device_name = lambda *a, **k: Props.name
    cuda.get_device_properties = lambda *a, **k: Props()
    cuda.mem_get_info = lambda *a, **k: (100 << 30, 140 << 30)
    torch.version.cuda = "13.0"
    failed = {}
    for name in ENTRY_MODULES:
        try:
            __import__(name)
        except Exception as e:  # noqa: BLE001 - reported: a module the GPU machine could not import either
            failed[name] = repr(e)[:300]
    try:  # what ensure_runtime_context does on CUDA (ServerArgs' checks import per device)
        from sglang.srt.runtime_context import publish
        from sglang.srt.server_args import ServerArgs

        publish(ServerArgs(model_path="dummy", device="cuda"), role="tokenizer")
    except Exception as e:  # noqa: BLE001
        failed["ServerArgs(device='cuda')"] = repr(e)[:300]
    return failed


def _round_trips(pool: str, disk_dir: str) -> dict:
    import torch

    from conftest import build_stack
    from sglang_kvbm.integration.sglang.compat import device_prefix_len

    stack = build_stack(pool=pool, size=128, page_size=4, host_blocks=8, disk_blocks=64, disk_dir=disk_dir,
                        events=True)
    done = {}
    try:
        for tier, base in (("host", 0), ("disk", 10_000)):
            tokens = [base + i for i in range(16)]  # four pages
            written = stack.insert(tokens, seed=base + 1)
            assert stack.cache.flush(timeout=60), "copies still running after 60 s"
            if tier == "disk":  # as many unrelated pages as the host holds: ours leave it, stay on disk
                junk = [1_000_000 + base + i for i in range(stack.manager.host.capacity * stack.page_size)]
                stack.insert(junk, seed=7)
                assert stack.cache.flush(timeout=60)
            stack.evict_all()
            stack.scramble_pool()  # a load that did nothing cannot pass for one that worked
            pages = len(tokens) // stack.page_size
            got = stack.linker.connector.peek(stack.block_ids(tokens))  # (on host, on disk)
            assert got[0] == pages if tier == "host" else got == (0, pages), f"{pool}/{tier}: (host, disk) {got}"
            req, match, loaded, slots, _ = stack.admit(tokens + [1], f"{pool}-{tier}")
            assert (device_prefix_len(match), loaded) == (0, len(tokens)), (pool, tier, loaded)
            assert stack.finish(req), f"{pool}/{tier}: the load did not land"
            for got_page, want_page in zip(stack.read_pages(slots), written, strict=True):
                assert torch.equal(got_page, want_page), f"{pool}/{tier}: bytes differ"
            stack.allocator.free(slots)
            done[tier] = pages
    finally:
        stack.cache.close()
    return done


def _sglang_objects() -> None:
    """What the GPU tests build beside the stack: a scheduler request and server arguments for CUDA."""
    from sglang.srt.server_args import ServerArgs

    from conftest import make_req

    make_req([1, 2, 3, 4, 5], "objects")
    ServerArgs(model_path="dummy", device="cpu")


def _run(command: list[str]) -> int:
    """Run ``command`` (``SCRIPT ARGS...`` or ``-m MODULE ARGS...``) in this process; its exit status."""
    import runpy

    module = command[0] == "-m"
    target, rest = (command[1], command[2:]) if module else (command[0], command[1:])
    sys.argv = [target, *rest]
    if not module:
        sys.path.insert(0, str(Path(target).resolve().parent))
    try:
        runpy.run_module(target, run_name="__main__") if module else runpy.run_path(target, run_name="__main__")
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except Exception:  # noqa: BLE001 - reported; what it imported still counts
        import traceback

        traceback.print_exc()
        return 1
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pools", default=",".join(POOLS))
    parser.add_argument("--modules", help="write every imported module and its file here (JSON)")
    parser.add_argument("--report", help="write the JSON report here too")
    parser.add_argument("--hide-absent", action="store_true",
                        help="hide the packages the GPU machine lacks (tests/gpu/stubs/_kvbm_stub.py ABSENT)")
    parser.add_argument("--imports-as-cuda", action="store_true", help="only import, as on CUDA (see above)")
    parser.add_argument("--run", nargs=argparse.REMAINDER, help="SCRIPT ARGS... or -m MODULE ARGS...: run that")
    args = parser.parse_args(argv)
    if args.hide_absent:
        import _kvbm_stub

        _kvbm_stub.hide_absent()

    sys.path.insert(0, str(TESTS))  # conftest: the stack as the CPU suite builds it
    report = {"python": sys.version.split()[0], "pools": {}}
    if args.imports_as_cuda:
        report["import_failures"] = _imports_as_cuda()
    elif args.run:
        report["run_exit"] = _run(args.run)
    else:
        from sglang_kvbm.manager import lookups

        lookups.WAIT_FLOOR_S = lookups.FIRST_READ_WAIT_S = 30.0  # what a load serves, not how long it may wait
        with tempfile.TemporaryDirectory(prefix="kvbm-pack-drive-") as tmp:
            for pool in args.pools.split(","):
                disk_dir = os.path.join(tmp, pool)
                os.makedirs(disk_dir)
                report["pools"][pool] = _round_trips(pool, disk_dir)
        _sglang_objects()

    stubs = sys.modules.get("_kvbm_stub")
    report["stubs_imported"] = sorted(set(stubs.IMPORTED)) if stubs else []
    report["stubs_called"] = list(stubs.CALLS) if stubs else []
    report["stub_files"] = {n: getattr(sys.modules.get(n), "__file__", None) for n in (stubs.STUBS if stubs else ())}
    import sglang

    report["sglang"] = getattr(sglang, "__version__", "?")
    report["sglang_file"] = sglang.__file__
    if args.modules:
        files = {name: getattr(mod, "__file__", None) for name, mod in list(sys.modules.items())}
        Path(args.modules).write_text(json.dumps(files, indent=0, sort_keys=True))
    line = json.dumps(report, sort_keys=True)
    print(line)
    if args.report:
        Path(args.report).write_text(line + "\n")
    return 1 if report["stubs_called"] or report.get("import_failures") or report.get("run_exit") else 0


if __name__ == "__main__":
    sys.exit(main())
