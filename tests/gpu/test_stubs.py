"""The GPU pack's kernel stubs (tests/gpu/stubs) suffice for the stack it carries SGLang for, and none is called.

Runs on CPU, in the normal suite: a subprocess with the stubs first on ``PYTHONPATH`` (so they shadow the real
kernel packages installed in .venv) and the packages the GPU machine lacks hidden (``_kvbm_stub.ABSENT``) builds
SGLang's MHA, MLA and FP8 pools, its paged allocator and default tree with a KvbmLinker over a host and a disk
tier, and moves four pages store -> flush -> evict -> match -> load through each tier (``pack_drive.py``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
STUB_DIR = HERE / "stubs"
sys.path.insert(0, str(STUB_DIR))
import _kvbm_stub  # noqa: E402

sys.path.remove(str(STUB_DIR))

# The CPU suite has SGLang installed; the GPU machine has it only through the pack (`make gpu-pack`).
pytestmark = pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="needs SGLang (or the GPU pack)")


def test_the_stack_runs_on_the_stubs_and_calls_none(tmp_path):
    log, report = tmp_path / "stub.log", tmp_path / "report.json"
    # This package as installed (the suite runs against the wheel; src alone has no block index).
    env = dict(os.environ, KVBM_STUB_LOG=str(log),
               PYTHONPATH=os.pathsep.join(filter(None, [str(STUB_DIR), os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, str(HERE / "pack_drive.py"), "--hide-absent", "--report", str(report)],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    result = json.loads(report.read_text())
    assert result["pools"] == {pool: {"host": 4, "disk": 4} for pool in ("mha", "mla", "fp8")}
    # The stubs stood in for the installed packages (else this test proves nothing) ...
    assert {"sgl_kernel", "tvm_ffi", "IPython"} <= set(result["stubs_imported"])
    for name, file in result["stub_files"].items():
        assert file is None or Path(file).is_relative_to(STUB_DIR), f"{name} came from {file}, not the stub"
    # ... and no path called one.
    assert result["stubs_called"] == []
    assert not [line for line in log.read_text().splitlines() if line.startswith("call ")]


def test_a_stub_imports_any_name_and_raises_when_called():
    attr = _kvbm_stub.StubAttr("sgl_kernel.kvcacheio.transfer_kv_all_layer")
    base = _kvbm_stub.StubAttr("flashinfer.BatchPrefillWithPagedKVCacheWrapper")

    class Wrapper(base):  # subclassing a stubbed class works; making one raises
        pass

    calls = len(_kvbm_stub.CALLS)
    with pytest.raises(_kvbm_stub.StubCalled, match=r"stub: sgl_kernel\.kvcacheio\.transfer_kv_all_layer called"):
        attr(1, 2)
    with pytest.raises(_kvbm_stub.StubCalled, match="needs SGLang's real kernels"):
        Wrapper()
    assert _kvbm_stub.CALLS[calls:] == ["sgl_kernel.kvcacheio.transfer_kv_all_layer",
                                        "flashinfer.BatchPrefillWithPagedKVCacheWrapper"]
    assert repr(attr.nested.name) == "<stub sgl_kernel.kvcacheio.transfer_kv_all_layer.nested.name>"


def test_each_stub_package_is_listed_once_with_its_reason():
    packages = {p.parent.name for p in STUB_DIR.glob("*/__init__.py")}
    assert packages == set(_kvbm_stub.STUBS)
    assert not packages & set(_kvbm_stub.ABSENT)
    assert all(len(why) > 20 for why in [*_kvbm_stub.STUBS.values(), *_kvbm_stub.ABSENT.values()])
