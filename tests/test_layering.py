"""The core imports neither SGLang, kvbm nor zmq (nor torch): only the adapters do."""

import subprocess
import sys


def printed_by(*lines: str) -> str:
    """What a fresh interpreter prints running ``lines`` (imports measured in a process of their own)."""
    out = subprocess.run([sys.executable, "-c", "\n".join(("import sys", *lines))], capture_output=True, text=True,
                         check=True)
    return out.stdout.strip()


def test_core_imports_no_engine():
    assert printed_by(
        "import sglang_kvbm.core.connector, sglang_kvbm.core.identity, sglang_kvbm.core.lifecycle",
        "import sglang_kvbm.core.offload_filter, sglang_kvbm.core.onboard_policy, sglang_kvbm.config",
        "print([m for m in ('sglang', 'kvbm', 'zmq', 'torch', 'nixl') if m in sys.modules])",
    ) == "[]"


def test_plugin_registration_imports_nothing_heavy():
    assert printed_by(
        "import sglang_kvbm.integration.sglang.plugin",
        "print([m for m in ('torch', 'zmq', 'nixl', 'sglang_kvbm.integration.sglang.radix_cache') if m in sys.modules])",
    ) == "[]"


def test_the_gpu_path_imports_torch_and_this_package_only():
    """tests/gpu runs on machines with PyTorch and nothing else: the copy engine, the loader and the layer
    counter must not pull SGLang, NIXL or any other dependency in."""
    assert printed_by(
        "import torch",
        "before = set(sys.modules)",
        "import sglang_kvbm.backends.local.manager, sglang_kvbm.backends.local.layer_loader",
        "import sglang_kvbm.layer_counter, sglang_kvbm.cuda_copies, sglang_kvbm.kv_layout",
        "print(sorted({m.split('.')[0] for m in set(sys.modules) - before} - {'sglang_kvbm'}))",
    ) == "[]"
