"""``make gpu-pack``: SGLang and what it needs, cut to the stack the GPU tests run, in a folder that travels.

The GPU machine has PyTorch but no SGLang, no NIXL and no registry; only this repository's working tree and a few
ignored folders (64 MiB in all) reach it. This script fills ``<out>/site`` (a ``PYTHONPATH`` entry) with:

* SGLang, only the modules the stack imports (``pack_closure.py``): traced here with ``pack_drive.py`` (the CPU
  stack's round trips; an import pass with torch claiming an H200, so ``if _is_cuda:`` imports count; the GPU
  tests' CPU twins and ``benchmarks/gpu_e2e.py`` on CPU), plus, statically, every module-level import of those
  modules (in ``if``/``try`` blocks too; in functions too for the pools, trees and ServerArgs), and the data files
  beside them; less SGLang's Rust TreeCore (:data:`DROP`);
* NIXL cut down to its POSIX backend (``pack_nixl.py``);
* the other distributions in :data:`PACKAGES` that the closure imports and the GPU machine lacks;
* the kernel stubs (``tests/gpu/stubs``, list and reasons in ``_kvbm_stub.STUBS``);

and ``<out>/native`` with the OpenSSL headers SGLang's hash extension (compiled on first use by torch) includes.
``<out>/env.sh`` sets the paths; ``<out>/MANIFEST.json`` says what went in. Wheels are cached in
``build/gpu-pack/wheels-cpXY``, the traced closure in ``build/gpu-pack/closure-*.json``. Run with .venv's Python
(``pack_check.py`` checks a 3.11 pack here):

    .venv/bin/python tests/gpu/pack.py [--out .gpu-pack] [--python-version 3.12] [--limit-mib 56]
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pack_nixl
from pack_closure import BUILD, ROOT, STUBS, module_of, static_closure, trace

PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in (34, 31, 28, 27, 24, 17)] + ["manylinux2014_x86_64"]
# Distribution -> (how it is kept, why it is needed). "closure": only the modules the stack imports; "nixl": the
# POSIX recipe; "whole": all of it. Versions: sglang and nixl as pyproject.toml pins them, the rest as .venv has them.
PACKAGES = {
    "sglang": ("closure", "the host application: pools, allocator, default tree, Req, ServerArgs"),
    "nixl": ("whole", "the disk tier's I/O (picks nixl_cu13 by torch's CUDA major)"),
    "nixl-cu13": ("nixl", "NIXL's core and POSIX plugin for CUDA 13"),
    "msgspec": ("whole", "this library's event and disk header formats; SGLang's platform interface"),
    "pydantic": ("whole", "SGLang's OpenAI protocol models (schedule_batch imports them)"),
    "pydantic-core": ("whole", "pydantic"),
    "annotated-types": ("whole", "pydantic"),
    "typing-inspection": ("whole", "pydantic"),
    "openai": ("closure", "openai.types.responses, fields of SGLang's protocol models"),
    "distro": ("whole", "openai"),
    "jiter": ("whole", "openai"),
    "sniffio": ("whole", "openai"),
    "orjson": ("whole", "sglang.srt.utils.common imports it"),
    "pybase64": ("whole", "sglang.srt.utils.common imports it"),
    "pyzmq": ("whole", "SGLang's KV-event publisher and IPC modules import zmq"),
    "setproctitle": ("whole", "sglang.srt.managers.scheduler imports it"),
    "dill": ("whole", "sglang.srt.sampling.custom_logit_processor imports it"),
    "partial-json-parser": ("whole", "SGLang's function-call parsers (schedule_batch imports them)"),
    "fastapi": ("whole", "scheduler -> disaggregation.encoder.receiver imports it"),
    "starlette": ("whole", "fastapi; sglang.srt.utils.common"),
    "uvicorn": ("whole", "scheduler -> disaggregation.encoder.receiver imports it"),
    "python-multipart": ("whole", "fastapi's form parsing, imported with it"),
    "compressed-tensors": ("whole", "SGLang's quantization registry (memory_pool -> fp4_kv_cache_quant_method)"),
    "loguru": ("whole", "compressed-tensors"),
    "gguf": ("whole", "SGLang's quantization registry imports it"),
}
WHEEL_DATA_KEEP = ("purelib", "platlib")
# sglang.kernels.jit.utils.compile.paths, at import, wants these beside sglang.kernels.jit: the headers are kept, the
# CUDA sources (4.6 MB, compiled only through tvm_ffi, a stub here) leave a placeholder.
KEEP_FOLDERS = ("sglang/kernels/jit/include",)
# Dropped from the pack: SGLang's Rust TreeCore is built against its pinned torch (2.14.1); on the GPU machine's
# torch 2.11 it loads but panics on dtypes ("UnknownKind(16)", "Unsupported TypeMeta"). Without it SGLang's tree
# takes its Python TreeCore ("this installation contains neither the Rust TreeCore extension nor its sources");
# env.sh also asks for it by name.
DROP = ("sglang/srt/mem_cache/rust_tree_core/mem_cache.*.so",)
PLACEHOLDER_FOLDERS = ("sglang/kernels/jit/csrc",)


def pinned(dist: str) -> str:
    """sglang and nixl(-cu13) as pyproject.toml pins them (the test and disk extras); others as .venv has them."""
    text = (ROOT / "pyproject.toml").read_text()
    base = "nixl" if dist.startswith("nixl") else dist
    found = re.search(rf'"{re.escape(base)}(?:\[[^\]]*\])?==([^"]+)"', text)
    return found.group(1) if found else md.version(dist)


def fetch(dists: dict[str, str], py: str, cache: Path) -> dict[str, Path]:
    """Each ``dist==version`` wheel for CPython ``py`` on x86-64 Linux, from ``cache`` or PyPI (pip download)."""
    cache.mkdir(parents=True, exist_ok=True)
    tag = "cp" + py.replace(".", "")

    def cached(dist, version):
        stem = re.sub(r"[-_.]+", "_", dist).lower() + "-" + version + "-"
        return [w for w in cache.glob("*.whl") if w.name.lower().startswith(stem) and (tag in w.name or "py3" in w.name)]

    missing = [f"{d}=={v}" for d, v in dists.items() if not cached(d, v)]
    if missing:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
               py, "--implementation", "cp", "--abi", tag, "--abi", "abi3", "--abi", "none", "-d", str(cache)]
        cmd += [arg for p in PLATFORMS for arg in ("--platform", p)] + ["--platform", "any"] + missing
        subprocess.run(cmd, check=True)
    return {d: cached(d, v)[0] for d, v in dists.items()}


def unpack(wheel: Path, site: Path) -> list[str]:
    """Extract ``wheel`` into ``site`` (its .data purelib/platlib too, nothing else of .data); top-level names."""
    tops = set()
    with zipfile.ZipFile(wheel) as zf:
        for info in zf.infolist():
            parts = info.filename.split("/")
            if parts[0].endswith(".data"):
                if len(parts) < 3 or parts[1] not in WHEEL_DATA_KEEP:
                    continue
                parts = parts[2:]
            if info.is_dir() or not parts[-1]:
                continue
            target = site.joinpath(*parts)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(zf.read(info))
            if not parts[0].endswith(".dist-info"):
                tops.add(parts[0].removesuffix(".py"))
    return sorted(tops)


def prune(site: Path, top: str, keep: set[str]) -> None:
    """Keep the modules in ``keep`` and the data files in their packages' folders; drop the rest of ``top``."""
    kept_dirs = {site.joinpath(*m.split(".")) for m in keep} | {site.joinpath(*m.split(".")[:-1]) for m in keep}
    kept_trees = [site / f for f in KEEP_FOLDERS if f.startswith(top + "/")]
    for path in sorted((site / top).rglob("*"), reverse=True):
        if any(path.is_relative_to(tree) for tree in kept_trees):
            continue
        if path.is_dir():
            if not any(path.iterdir()):
                path.rmdir()
            continue
        module = module_of(path, site)
        if module is not None and path.suffix in (".py", ".so"):
            if module not in keep:
                path.unlink()
        elif path.parent not in kept_dirs or path.suffix in (".pyc", ".pyi", ".cu", ".cuh", ".hip"):
            path.unlink()
    for folder in PLACEHOLDER_FOLDERS:
        if folder.startswith(top + "/") and (site / folder).parent.is_dir():
            (site / folder).mkdir(exist_ok=True)
            (site / folder / "PLACEHOLDER").write_text("Emptied by tests/gpu/pack.py: SGLang checks that this "
                                                       "folder exists; its JIT kernels are not in the GPU pack.\n")


def openssl_headers(native: Path) -> int:
    """The headers ``#include <openssl/sha.h>`` pulls in here, and a ``libcrypto.so`` linker script naming the
    machine's libcrypto.so.3: SGLang's hash extension builds where libssl-dev is not installed."""
    deps = subprocess.run(["cc", "-M", "-x", "c", "-"], input="#include <openssl/sha.h>\n", check=True,
                          capture_output=True, text=True).stdout.replace("\\\n", " ").split()
    headers = [Path(d) for d in deps if "/openssl/" in d]
    for header in headers:
        target = native / "include" / "openssl" / header.name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(header, target)
    (native / "lib").mkdir(parents=True, exist_ok=True)
    (native / "lib" / "libcrypto.so").write_text("INPUT(libcrypto.so.3)\n")
    return len(headers)


# Libraries a packed extension may take from outside the pack: the base system, and torch's (loaded before SGLang's
# tree core, whose RUNPATH names torch/lib beside it).
OUTSIDE = re.compile(r"^(ld-linux-x86-64|lib(c|m|dl|rt|pthread|util|z|stdc\+\+|gcc_s|torch\w*|c10\w*))\.so")


def unresolved(site: Path) -> list[str]:
    """``NEEDED`` entries of the pack's ELF files found neither in the pack (``RPATH``/``RUNPATH``) nor OUTSIDE."""
    missing = []
    for lib in site.rglob("*.so*"):
        if not lib.is_file() or lib.read_bytes()[:4] != b"\x7fELF":
            continue
        needed, dirs = pack_nixl._dynamic(lib)
        for name in needed:
            if not OUTSIDE.match(name) and not any((d / name).is_file() for d in [*dirs, lib.parent]):
                missing.append(f"{lib.relative_to(site)}: {name}")
    return missing


def size_mib(path: Path) -> float:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 2**20


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / ".gpu-pack")
    parser.add_argument("--python-version", default="3.12", help="the GPU machine's Python (3.12.3 there)")
    parser.add_argument("--limit-mib", type=float, default=56.0, help="fail above this (the tree travels too)")
    args = parser.parse_args(argv)
    py_tag = "cp" + args.python_version.replace(".", "")
    BUILD.mkdir(parents=True, exist_ok=True)

    closure = trace(pinned("sglang"))
    versions = {dist: pinned(dist) for dist in PACKAGES}
    wheels = fetch(versions, args.python_version, BUILD / f"wheels-{py_tag}")
    out, site = args.out.resolve(), args.out.resolve() / "site"
    if out.exists() and any(out.iterdir()) and not (out / "MANIFEST.json").exists():
        raise SystemExit(f"gpu-pack: {out} exists and is not a pack; not replacing it")
    shutil.rmtree(out, ignore_errors=True)
    site.mkdir(parents=True)
    manifest = {"python": args.python_version, "packages": {}, "stubs": {}}
    for dist, (how, why) in PACKAGES.items():
        before = size_mib(site)
        tops = unpack(wheels[dist], site)
        if how == "closure":
            for top in tops:
                seeds = {m for m in closure if m == top or m.startswith(top + ".")}
                prune(site, top, static_closure(site, top, seeds))
            for pattern in DROP:
                for path in site.glob(pattern):
                    path.unlink()
        elif how == "nixl":
            manifest["nixl"] = pack_nixl.trim(site)
        for record in site.glob("*.dist-info/RECORD"):
            record.unlink()  # lists files the pack no longer has
        manifest["packages"][dist] = {"version": versions[dist], "kept": how, "why": why,
                                      "mib": round(size_mib(site) - before, 2)}
    sys.path.insert(0, str(STUBS))
    import _kvbm_stub

    for name, why in _kvbm_stub.STUBS.items():
        shutil.copytree(STUBS / name, site / name, ignore=shutil.ignore_patterns("__pycache__"))
        manifest["stubs"][name] = why
    shutil.copyfile(STUBS / "_kvbm_stub.py", site / "_kvbm_stub.py")
    manifest["openssl_headers"] = openssl_headers(out / "native")
    here = os.path.relpath(out, ROOT) if out.is_relative_to(ROOT) else None
    (out / "env.sh").write_text(ENV_SH.replace("@PACK@", f'$(pwd)/{here}' if here else str(out)))
    subprocess.run([sys.executable, str(Path(pack_nixl.__file__)), str(site)], check=True)  # dlopen, RTLD_NOW
    missing = unresolved(site)
    if missing:
        raise SystemExit("gpu-pack: libraries the pack needs but lacks:\n  " + "\n  ".join(missing))
    manifest["mib"] = round(size_mib(out), 2)
    (out / "MANIFEST.json").write_text(json.dumps(manifest, indent=1) + "\n")
    for dist, info in sorted(manifest["packages"].items(), key=lambda kv: -kv[1]["mib"]):
        print(f"  {info['mib']:7.2f} MiB  {dist}=={info['version']} ({info['kept']})")
    print(f"gpu-pack: {out} {manifest['mib']:.1f} MiB for CPython {args.python_version} (limit {args.limit_mib} MiB)")
    if manifest["mib"] > args.limit_mib:
        print(f"gpu-pack: over the limit by {manifest['mib'] - args.limit_mib:.1f} MiB", file=sys.stderr)
        return 1
    return 0


ENV_SH = """# . .gpu-pack/env.sh, from the repository root (any sh): SGLang and its needs from the pack, this package from src
_pack="@PACK@"
[ -d "$_pack/site" ] || echo "env.sh: no $_pack/site: source it from the repository root" >&2
export PYTHONPATH="$_pack/site:$(pwd)/src${PYTHONPATH:+:$PYTHONPATH}"
export CPATH="${CPATH:+$CPATH:}$_pack/native/include" LIBRARY_PATH="${LIBRARY_PATH:+$LIBRARY_PATH:}$_pack/native/lib"
export SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=python  # the Rust TreeCore needs SGLang's torch (tests/gpu/pack.py)
"""

if __name__ == "__main__":
    sys.exit(main())
