"""The identity under which disk blocks may be reused: same model, same KV bytes, same rank."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from sglang_kvbm.backends.local.disk_format import FORMAT_VERSION
from sglang_kvbm.kv_layout import PagedKvLayout

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def server_fingerprint(
    model_path: str,
    layout: PagedKvLayout,
    kvcache: Any,
    *,
    revision: Any = None,
    tp_rank: int = 0,
    tp_size: int = 1,
) -> tuple[bytes, dict]:
    """16 bytes naming what a block's bytes depend on, and the readable description behind them.

    The model is identified by its path and the size and mtime of its config and
    weight files, so weights replaced in place are a different model.
    """
    files = []
    directory = Path(model_path)
    if directory.is_dir():
        for path in sorted(directory.iterdir()):
            if path.name == "config.json" or path.suffix in _WEIGHT_SUFFIXES:
                stat = path.stat()
                files.append([path.name, stat.st_size, stat.st_mtime_ns])
    description = {
        "format": FORMAT_VERSION,
        "model_path": os.path.abspath(model_path) if model_path else "",
        "model_files": files,
        "revision": revision,
        "pool": type(kvcache).__name__,
        "dtype": str(getattr(kvcache, "dtype", "")),
        "layout": getattr(kvcache, "kv_cache_layout", "nhd"),
        "page_size": layout.page_size,
        "buffer_page_bytes": list(layout.buffer_page_bytes),
        "tp": [tp_rank, tp_size],
    }
    digest = hashlib.sha256(json.dumps(description, sort_keys=True).encode()).digest()[:16]
    return digest, description
