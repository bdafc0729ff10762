"""sglang-kvbm: NVIDIA Dynamo KVBM's GPU -> host -> disk KV tiers and KV events for SGLang.

The core (``sglang_kvbm.core``) imports neither SGLang, kvbm nor zmq; the SGLang
adapter lives in ``sglang_kvbm.integration.sglang`` and is reached through the
``kvbm`` radix-cache backend (``--radix-cache-backend kvbm``).
"""

from importlib import metadata as _metadata

from sglang_kvbm.config import ConfigError, KvbmConfig

try:  # one version source: pyproject.toml's, through the installed metadata
    __version__ = _metadata.version("sglang-kvbm")
except _metadata.PackageNotFoundError:  # a source tree on PYTHONPATH, never installed
    __version__ = "0+unknown"
__all__ = ["ConfigError", "KvbmConfig", "__version__"]
