"""Stand-ins for SGLang's kernel packages, for the GPU pack (tests/gpu/pack.py) and its CPU test (test_stubs.py).

SGLang's modules import these packages when they are imported, but the paths the GPU pack carries SGLang for (its
KV pools, paged allocator, default tree, scheduler request and server arguments, with this library's linker) never
call into them. A stub imports, and hands out a callable for any name (``from sgl_kernel import foo`` works, as do
submodules, subclassing and ``X | None``); *calling* one records the call in :data:`CALLS` (and in the file named by
``KVBM_STUB_LOG``) and raises :class:`StubCalled`. A test that ends with :data:`CALLS` empty ran on SGLang's own
code only.

The one list of stubs is :data:`STUBS`, each with why it is needed; ``tests/gpu/stubs/<name>/__init__.py`` is the
same two lines for each. :data:`ABSENT` lists packages the import closure touches that stay *absent* on the GPU
machine (SGLang imports each under ``try``/an availability check and falls back), which the CPU test hides so that
.venv, where they are installed, takes the GPU machine's paths.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import threading
import types

STUBS = {
    "sgl_kernel": "SGLang's CUDA kernels (sglang-kernel, 1.2 GB): imported at module level under `if _is_cuda:` by "
                  "the layers the pools import (quantization, activation, rotary, sampling); the pools, allocator "
                  "and tree copy with torch/Triton ops",
    "tvm_ffi": "apache-tvm-ffi, the loader of SGLang's JIT kernels (sglang.kernels.*): `from tvm_ffi.module import "
               "Module` at module level in every sglang.kernels.ops module that memory_pool's imports reach",
    "deep_gemm": "sgl-deep-gemm's FP8 GEMMs: imported at module level under `if ENABLE_JIT_DEEPGEMM` (true on "
                 "Hopper+) by sglang.srt.layers.deep_gemm_wrapper, which the quantization layers import",
    "IPython": "notebook display helpers: `from IPython.display import HTML, display` at the top of sglang.utils, "
               "which `import sglang` runs; IPython and its dependencies are 10+ MB",
}

ABSENT = {
    "flashinfer": "every import is under try or `if is_flashinfer_available()` (find_spec + CUDA): absent, "
                  "SGLang takes its Triton/torch paths; a stub would make it look available",
    "xgrammar": "imported under try by the grammar backend; absent, grammar-constrained decoding is off",
    "torch_memory_saver": "imported under try by SGLang's memory-saver adapter; absent, the no-op adapter is used",
    "torchcodec": "video decoding, imported under try",
    "deep_ep": "expert-parallel dispatch, imported under try",
    "triton_kernels": "MoE Triton kernels, imported under try or for type checking only",
    "cudnn": "cudnn-frontend, imported by flashinfer only",
    "cutile_cache": "cuda-tile, imported by flashinfer only",
    "soundfile": "transformers' audio helpers check for it first",
    "opentelemetry": "tracing, imported under try",
    "zstandard": "httpx's decoders check for it first",
    "nvidia_cutlass_dsl": "CuTe DSL, imported by flashinfer and SGLang's Blackwell kernels only",
}

IMPORTED: list[str] = []
CALLS: list[str] = []
_lock = threading.Lock()


class StubCalled(RuntimeError):
    """A stubbed kernel was called: the path under test needs SGLang's real kernels."""


def _record(kind: str, qualname: str) -> None:
    with _lock:
        (CALLS if kind == "call" else IMPORTED).append(qualname)
    log = os.environ.get("KVBM_STUB_LOG")
    if log:
        with open(log, "a") as f:
            f.write(f"{kind} {qualname}\n")


def _raise(qualname: str):
    _record("call", qualname)
    raise StubCalled(f"stub: {qualname} called — this path needs SGLang's real kernels "
                     f"(tests/gpu/stubs stands in for {qualname.split('.')[0]})")


class StubAttr:
    """Any name of a stubbed package: calling it (or instantiating a class built on it) raises."""

    __slots__ = ("_qualname",)

    def __init__(self, qualname: str) -> None:
        object.__setattr__(self, "_qualname", qualname)

    def __call__(self, *args, **kwargs):
        _raise(self._qualname)

    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return StubAttr(f"{self._qualname}.{name}")

    def __mro_entries__(self, bases):  # class Foo(stubbed.Base): ... at module level
        return (stub_class(self._qualname),)

    def __getitem__(self, item):  # stubbed.Type[...] in an annotation evaluated at import
        return self

    def __or__(self, other):  # stubbed.Type | None
        return self

    __ror__ = __or__

    def __repr__(self) -> str:
        return f"<stub {self._qualname}>"


def stub_class(qualname: str) -> type:
    def __init__(self, *args, **kwargs):
        _raise(qualname)

    return type(qualname.rpartition(".")[2] or qualname, (), {"__init__": __init__, "__module__": "_kvbm_stub"})


class _StubLoader(importlib.abc.Loader):
    def create_module(self, spec):
        return None

    def exec_module(self, module) -> None:
        stub_package(module.__name__, module)


class _StubFinder(importlib.abc.MetaPathFinder):
    """Submodules of a stubbed package (``from sgl_kernel.scalar_type import ...``)."""

    def find_spec(self, fullname, path=None, target=None):
        root = fullname.partition(".")[0]
        if root in STUBS and "." in fullname and getattr(sys.modules.get(root), "__kvbm_stub__", False):
            return importlib.machinery.ModuleSpec(fullname, _StubLoader(), is_package=True)
        return None


def stub_package(name: str, module: types.ModuleType | None = None) -> None:
    """Make ``name`` (being imported) a stub: any attribute is a :class:`StubAttr`, any submodule a stub too."""
    module = module if module is not None else sys.modules[name]
    module.__path__ = []  # a package: submodules come from _StubFinder
    module.__kvbm_stub__ = True
    module.__getattr__ = lambda attr: _module_getattr(name, attr)
    if not any(isinstance(f, _StubFinder) for f in sys.meta_path):
        sys.meta_path.append(_StubFinder())
    _record("import", name)


def _module_getattr(module: str, attr: str):
    if attr.startswith("__") and attr.endswith("__"):
        raise AttributeError(f"stub module {module!r} has no attribute {attr!r}")
    return StubAttr(f"{module}.{attr}")


def hide_absent() -> None:
    """As on the GPU machine: every package in :data:`ABSENT` fails to import and ``find_spec`` finds none."""
    for name in ABSENT:
        sys.modules.setdefault(name, None)
