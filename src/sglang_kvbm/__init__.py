"""sglang-kvbm: NVIDIA Dynamo KVBM's GPU -> host -> disk KV tiers and KV events for SGLang.

The package is built in floors (``tests/ops/test_layering.py``), each importing only
those below it: ``base``, ``core`` (no engine, no torch), ``transfer``, ``tiers``,
``config``, ``manager``, ``observe``, ``integration`` (the one door to SGLang and
Dynamo), ``ops``. SGLang reaches it through the ``kvbm`` radix-cache backend
(``--radix-cache-backend kvbm``).
"""

from sglang_kvbm.base.versions import VERSION as __version__
from sglang_kvbm.config import ConfigError, KvbmConfig

__all__ = ["ConfigError", "KvbmConfig", "__version__"]
