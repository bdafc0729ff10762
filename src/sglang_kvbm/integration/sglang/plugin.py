"""SGLang plugin entry point (group ``sglang.srt.plugins``, name ``kvbm``).

SGLang calls :func:`register` in every one of its processes. It only records a
factory under the name ``kvbm``; nothing is built, allocated or hooked until a
scheduler is started with ``--radix-cache-backend kvbm``.
"""

from __future__ import annotations

BACKEND_NAME = "kvbm"


def register() -> None:
    from sglang.srt.mem_cache.registry import (
        register_radix_cache_backend,
        registered_radix_cache_backends,
    )

    if BACKEND_NAME in registered_radix_cache_backends():
        return  # a process that loads plugins twice
    register_radix_cache_backend(BACKEND_NAME, _create)


def _create(ctx):
    # Imported here so that registering costs nothing in processes that never build a cache.
    from sglang_kvbm.integration.sglang.factory import create_kvbm_radix_cache

    return create_kvbm_radix_cache(ctx)
