"""The build of ``sglang_kvbm._blocks`` the tests in ``tests/index`` run against (import it before the index),
and what those tests share.

These tests load the index and nothing else (no torch, no SGLang), so they also run where the interpreter has
AddressSanitizer preloaded (``make asan``: pytest with ``--confcutdir=tests/index``, which leaves
``tests/conftest.py`` and its torch out). ``KVBM_BLOCKS_SO`` names a build to test instead of the installed
one: the sanitized build, or a parent commit's build to show a test fails there. (Not a conftest.py: the
other tests import ``tests/conftest.py`` as the module ``conftest``.)

The fuzz test's Hypothesis settings: ``KVBM_FUZZ=ci`` (the default: ~10 000 steps, the same ones every run)
or ``KVBM_FUZZ=long`` (random, ~30 times as many).
"""

import importlib.util
import os
import sys

from hypothesis import HealthCheck, settings

SO = os.environ.get("KVBM_BLOCKS_SO")
if SO and getattr(sys.modules.get("sglang_kvbm._blocks"), "__file__", None) != os.path.abspath(SO):
    if "sglang_kvbm._blocks" in sys.modules:
        raise RuntimeError(f"KVBM_BLOCKS_SO: another sglang_kvbm._blocks was imported first "
                           f"({sys.modules['sglang_kvbm._blocks'].__file__})")
    import sglang_kvbm

    _spec = importlib.util.spec_from_file_location("sglang_kvbm._blocks", os.path.abspath(SO))
    _blocks = importlib.util.module_from_spec(_spec)
    sys.modules["sglang_kvbm._blocks"] = _blocks
    _spec.loader.exec_module(_blocks)
    sglang_kvbm._blocks = _blocks

from sglang_kvbm._blocks import BlockIndex  # noqa: E402 - the build chosen above
from sglang_kvbm.core.identity import chain_hashes  # noqa: E402

IDS = chain_hashes(list(range(4096)), 1)  # real ids: SGLang's page hash chain at page size 1


def index_with(n: int, capacity: int = 8) -> BlockIndex:
    """An index holding IDS[:n], registered in order with the first most recent; payloads are ``m<i>``."""
    index = BlockIndex(capacity)
    slots, _ = index.reserve(IDS[:n])
    index.commit(slots, [f"m{i}" for i in range(n)])
    return index


_common = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
FUZZ = {
    "ci": settings(max_examples=200, stateful_step_count=50, derandomize=True, print_blob=True, **_common),
    "long": settings(max_examples=3000, stateful_step_count=100, **_common),
}[os.environ.get("KVBM_FUZZ", "ci")]
