"""sglang-kvbm: NVIDIA Dynamo KVBM's GPU -> host -> disk KV tiers and KV events for SGLang.

The core (``sglang_kvbm.core``) imports neither SGLang, kvbm nor zmq; the SGLang
adapter lives in ``sglang_kvbm.integration.sglang`` and is reached through the
``kvbm`` radix-cache backend (``--radix-cache-backend kvbm``).
"""

from sglang_kvbm.config import ConfigError, KvbmConfig

__version__ = "0.1.0"
__all__ = ["ConfigError", "KvbmConfig", "__version__"]
