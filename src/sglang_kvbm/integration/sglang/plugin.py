"""SGLang plugin entry point (group ``sglang.srt.plugins``, name ``kvbm``).

SGLang calls :func:`register` early in every one of its processes, before it
resolves the server arguments. It registers one step wrapper in SGLang's
resolution pipeline that turns ``--radix-cache-backend kvbm`` into SGLang's
external-cache linker flags (see ``flags``), and the ``kvbm`` name itself, so
a process that somehow skipped the translation fails with a message rather
than SGLang's "not registered". Nothing is built or allocated here.
"""

from __future__ import annotations

from sglang_kvbm.integration.sglang.flags import BACKEND_NAME

_registered = False
# The first step of SGLang's resolution pipeline that is about caches: the
# translation runs before any handler reads the radix-cache or linker flags.
RESOLUTION_STEP = "handle_hicache_ratio_default"


def register() -> None:
    global _registered
    if _registered:
        return
    from sglang.srt.arg_groups.resolution_hooks import register_resolution_hook
    from sglang.srt.mem_cache.registry import register_radix_cache_backend, registered_radix_cache_backends

    @register_resolution_hook(RESOLUTION_STEP)
    def _kvbm_as_linker(server_args, previous):
        from sglang_kvbm.integration.sglang.flags import translate

        translate(server_args)
        previous(server_args)

    if BACKEND_NAME not in registered_radix_cache_backends():
        register_radix_cache_backend(BACKEND_NAME, _untranslated)
    _registered = True


def _untranslated(ctx):
    from sglang_kvbm.config import ConfigError

    raise ConfigError(
        "--radix-cache-backend kvbm reached the scheduler untranslated: the launcher did not load the kvbm plugin "
        "(is SGLANG_PLUGINS set without 'kvbm'?). Load it, or pass SGLang's linker flags yourself: "
        "python -c 'from sglang_kvbm.integration.sglang.flags import describe; print(describe())'"
    )
