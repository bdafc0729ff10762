"""What a part of sglang-kvbm needs beyond the base install, and the one line that says how to get it.

The base install (``pip install sglang-kvbm``) brings torch, numpy, packaging, msgspec,
prometheus-client and xxhash; the rest comes with an extra: SGLang and what it
brings (``[sglang]``), NIXL (``[disk]``), Mooncake's client and pyzmq
(``[mooncake]``). A command checks what it needs with :func:`require` before it
imports anything of it; the command line turns :class:`MissingPackage` into its
message on stderr and exit status 2, never a traceback.

This module imports nothing outside the standard library, so anything may use it.
"""

from __future__ import annotations

import importlib.util

DISTRIBUTION = "sglang-kvbm"

# Import name -> what a person installs (the names the messages use).
WHAT = {
    "sglang": "SGLang",
    "zmq": "pyzmq",
    "nixl": "NIXL",
    "mooncake": "Mooncake's client",
    "requests": "requests",
    "transformers": "transformers",
    "tokenizers": "tokenizers",
    "torch": "PyTorch",
    "numpy": "numpy",
}


class MissingPackage(Exception):
    """A package a command needs is not installed; ``str()`` is one line naming it and the ``pip install`` to run."""


def pip_install(extra: str) -> str:
    """The command that installs sglang-kvbm with ``extra``, e.g. ``pip install 'sglang-kvbm[disk]'``."""
    return f"pip install '{DISTRIBUTION}[{extra}]'"


def installed(module: str) -> bool:
    """Whether ``module`` can be found, without importing it (a package's parent is imported for a dotted name)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing; a module put in sys.modules without a spec
        return False


def missing(*modules: str) -> list[str]:
    """The names of ``modules`` that are not installed, in the order given."""
    return [module for module in modules if not installed(module)]


def require(command: str, extra: str, *modules: str) -> None:
    """Raise :class:`MissingPackage` unless every one of ``modules`` is installed.

    ``command`` is what the person ran (``"events"``: the message says ``sglang-kvbm events``), ``extra`` the
    extra that brings the modules.
    """
    absent = missing(*modules)
    if absent:
        names = ", ".join(dict.fromkeys(WHAT.get(module.partition(".")[0], module) for module in absent))
        raise MissingPackage(f"{DISTRIBUTION} {command} needs {names}: {pip_install(extra)}")
