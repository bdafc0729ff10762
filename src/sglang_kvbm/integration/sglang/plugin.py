"""SGLang plugin entry point (group ``sglang.srt.plugins``, name ``kvbm``).

SGLang calls :func:`register` early in every one of its processes, before it
resolves the server arguments, and logs (does not raise) what a plugin raises.
So every refusal here goes through SGLang's resolution pipeline, which does
stop the launcher:

* an SGLang outside the supported range: the version is read from the package
  metadata before anything else, and a step wrapper refuses ``kvbm`` (only when
  it was asked for) with the range and the fix, touching no other SGLang
  attribute;
* otherwise the step wrapper turns ``--radix-cache-backend kvbm`` into what this
  SGLang needs (``flags``; which route is ``compat``'s), and the ``kvbm`` backend
  is registered: the tree factory on releases that build it from there, and on
  the others a factory that says the launcher skipped the translation.

Nothing is built or allocated here.
"""

from __future__ import annotations

from sglang_kvbm.integration.sglang.flags import BACKEND_NAME

_registered = False
# The first step of SGLang's resolution pipeline that is about caches (0.5.20 to 0.5.23): the
# translation runs before any handler reads the radix-cache or linker flags.
RESOLUTION_STEP = "handle_hicache_ratio_default"


def register() -> None:
    global _registered
    if _registered:
        return
    from importlib import metadata

    from sglang_kvbm.base.versions import unsupported_sglang

    problem = unsupported_sglang(metadata.version("sglang"))
    if problem is not None:
        _refuse_when_asked(problem)
    else:
        _register_supported()
    _registered = True


def _refuse_when_asked(problem: str) -> None:
    """On an SGLang outside the range, a server that does not ask for kvbm runs as if this package were absent."""
    import logging

    try:
        from sglang.srt.arg_groups.resolution_hooks import register_resolution_hook
    except ImportError:  # older than any release with the seam: SGLang itself says "kvbm" is not registered
        logging.getLogger(__name__).warning("sglang-kvbm: %s", problem)
        return

    @register_resolution_hook(RESOLUTION_STEP)
    def _kvbm_unsupported(server_args, previous):
        from sglang_kvbm.config import ConfigError

        if getattr(server_args, "radix_cache_backend", None) == BACKEND_NAME or getattr(server_args, "enable_kvbm",
                                                                                         False):
            raise ConfigError(problem)
        previous(server_args)


def _register_supported() -> None:
    from sglang.srt.arg_groups.resolution_hooks import register_resolution_hook
    from sglang.srt.mem_cache.registry import register_radix_cache_backend, registered_radix_cache_backends

    from sglang_kvbm.integration.sglang.compat import seam

    @register_resolution_hook(RESOLUTION_STEP)
    def _kvbm_as_linker(server_args, previous):
        from sglang_kvbm.integration.sglang.flags import translate

        translate(server_args)
        previous(server_args)

    if BACKEND_NAME not in registered_radix_cache_backends():
        register_radix_cache_backend(BACKEND_NAME, _untranslated if seam().linker_config_flag else _build_tree)


def _build_tree(ctx):
    from sglang_kvbm.integration.sglang.factory import build_tree

    return build_tree(ctx)


def _untranslated(ctx):
    from sglang_kvbm.config import ConfigError

    raise ConfigError(
        "--radix-cache-backend kvbm reached the scheduler untranslated: the launcher did not load the kvbm plugin "
        "(is SGLANG_PLUGINS set without 'kvbm'?). Load it, or pass SGLang's linker flags yourself: "
        "python -c 'from sglang_kvbm.integration.sglang.flags import describe; print(describe())'"
    )
