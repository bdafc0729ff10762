"""The core imports neither SGLang, kvbm nor zmq (nor torch): only the adapters do."""

import subprocess
import sys


def test_core_imports_no_engine():
    code = (
        "import sys\n"
        "import sglang_kvbm.core.connector, sglang_kvbm.core.identity, sglang_kvbm.core.lifecycle\n"
        "import sglang_kvbm.core.offload_filter, sglang_kvbm.core.onboard_policy, sglang_kvbm.config\n"
        "bad = [m for m in ('sglang', 'kvbm', 'zmq', 'torch', 'nixl') if m in sys.modules]\n"
        "print(bad)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_plugin_registration_imports_nothing_heavy():
    code = (
        "import sys\n"
        "import sglang_kvbm.integration.sglang.plugin\n"
        "print([m for m in ('torch', 'zmq', 'nixl', 'sglang_kvbm.integration.sglang.radix_cache') if m in sys.modules])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_the_gpu_path_imports_torch_and_this_package_only():
    """tests/gpu runs on machines with PyTorch and nothing else: the copy engine, the loader and the layer
    counter must not pull SGLang, NIXL or any other dependency in."""
    code = (
        "import sys\n"
        "import torch\n"
        "before = set(sys.modules)\n"
        "import sglang_kvbm.backends.local.manager, sglang_kvbm.backends.local.layer_loader\n"
        "import sglang_kvbm.layer_counter, sglang_kvbm.cuda_copies, sglang_kvbm.kv_layout\n"
        "print(sorted({m.split('.')[0] for m in set(sys.modules) - before} - {'sglang_kvbm'}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
