"""Patch modules right after their first import, for runtime patches a ``sitecustomize`` installs.

The tests' ``layer_hold`` and the benchmarks' ``hicache_cpu`` put a ``sitecustomize`` on a server's
``PYTHONPATH``; it calls :func:`patch_on_import` before SGLang (or this library) is imported, so
each patch runs in every process of that server as its module loads, and nowhere else.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from types import ModuleType
from typing import Callable, Mapping


def patch_on_import(patches: Mapping[str, Callable[[ModuleType], None]]) -> None:
    """Call ``patches[name](module)`` once module ``name`` has executed, on its first import."""

    class _Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            patch = patches.get(name)
            if patch is None:
                return None
            sys.meta_path.remove(self)  # find the real spec without finding ourselves again
            try:
                spec = importlib.util.find_spec(name)
            finally:
                sys.meta_path.insert(0, self)
            original = spec.loader.exec_module

            def exec_module(module):
                original(module)
                patch(module)

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _Finder())
