"""What of SGLang (and openai) the GPU pack keeps: the modules the stack imports, traced, then closed over
statically. Used by tests/gpu/pack.py; docs/gpu-pack.md says how and why."""

from __future__ import annotations

import ast
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STUBS = ROOT / "tests" / "gpu" / "stubs"
BUILD = ROOT / "build" / "gpu-pack"
# The GPU machine runs SGLang's Python TreeCore (pack.py DROP says why): so does the trace.
TREE_CORE_ENV = {"SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND": "python"}
# Modules whose imports inside functions count too (the paths the GPU tests call run there, some only on CUDA, which
# the CPU trace does not see): the KV pools, allocators and trees, the FP8/FP4 KV methods, Req, ServerArgs.
DEEP = ("sglang.srt.mem_cache", "sglang.srt.layers.quantization.fp4_kv_cache_quant_method", "sglang.srt.server_args",
        "sglang.srt.runtime_context", "sglang.srt.managers.schedule_batch", "sglang.srt.sampling")


# What the GPU machine runs, each traced here on CPU (pack_drive.py --run): the GPU tests' CPU twins and the GPU
# benchmark's CPU mode. One that fails is reported; the modules it imported until then still count.
TRACE_RUNS = (
    ("-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "tests/gpu/test_sglang_on_cuda.py"),
    ("benchmarks/gpu_e2e.py", "--quick", "--json", str(BUILD / "gpu_e2e.json")),
)


def trace(sglang_version: str) -> set[str]:
    """Every module the stack imports here (pack_drive.py: the CPU round trips, the CUDA import pass, TRACE_RUNS),
    with the kernel stubs first on the path and the packages the GPU machine lacks hidden. Cached by the inputs."""
    inputs = sorted([*(ROOT / "src").rglob("*.py"), *(ROOT / "tests" / "gpu").rglob("*.py"),
                     ROOT / "tests" / "conftest.py", *(ROOT / "benchmarks").glob("*.py")])
    key = hashlib.sha256(b"".join(p.read_bytes() for p in inputs) + sglang_version.encode()).hexdigest()[:16]
    cached = BUILD / f"closure-{key}.json"
    if cached.exists():
        return set(json.loads(cached.read_text()))
    # This package as the running interpreter has it installed (editable: this tree's src; or the wheel `make test`
    # installs): src alone has no block index.
    env = dict(os.environ, PYTHONPATH=str(STUBS), **TREE_CORE_ENV)
    names, out = set(), BUILD / "modules.json"
    (BUILD / "trace.log").write_text("")
    drive = [sys.executable, str(ROOT / "tests" / "gpu" / "pack_drive.py"), "--hide-absent", "--modules", str(out)]
    for extra in ([], ["--imports-as-cuda"], *(["--run", *run] for run in TRACE_RUNS)):
        if extra[:1] == ["--run"] and not (ROOT / extra[-1 if extra[1] == "-m" else 1]).exists():
            print(f"gpu-pack: {extra[1:]}: not in this tree, not traced", file=sys.stderr)
            continue
        out.unlink(missing_ok=True)
        with open(BUILD / "trace.log", "a") as log:
            log.write(f"\n== {' '.join(drive + extra)}\n")
            log.flush()
            done = subprocess.run(drive + extra, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        if done.returncode and (extra[:1] != ["--run"] or not out.exists()):
            raise SystemExit(f"gpu-pack: {' '.join(drive + extra)} failed; see {BUILD / 'trace.log'}")
        if done.returncode:
            print(f"gpu-pack: warning: {' '.join(extra[1:])} failed on CPU (see {BUILD / 'trace.log'}); "
                  "what it imported until then counts", file=sys.stderr)
        names |= set(json.loads(out.read_text()))
    cached.write_text(json.dumps(sorted(names)))
    return names


def module_of(path: Path, site: Path):
    rel = path.relative_to(site)
    name = rel.name.split(".")[0]
    if rel.suffix == ".py" or (rel.suffix == ".so" and "." in rel.name[: -len(".so")]):
        parts = list(rel.parent.parts) + ([] if name == "__init__" else [name])
        return ".".join(parts)
    return None


def static_closure(site: Path, top: str, seeds: set[str]) -> set[str]:
    """``seeds`` (modules under ``top``) and every module they import at module level (``if``/``try`` included,
    functions not; in functions too for the seeds in :data:`DEEP`), transitively, as far as ``top`` holds it."""
    files = {module_of(p, site): p for p in (site / top).rglob("*") if p.suffix in (".py", ".so")}
    keep, todo = set(), [m for m in seeds if m in files]

    def add(name):
        for i in range(1, name.count(".") + 2):
            part = ".".join(name.split(".")[:i])
            if part in files and part not in keep:
                keep.add(part)
                todo.append(part)

    for seed in list(todo):
        add(seed)
    while todo:
        name = todo.pop()
        path = files[name]
        if path.suffix != ".py":
            continue
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        tree = ast.parse(path.read_bytes())
        nodes = list(ast.walk(tree)) if name in seeds and name.startswith(DEEP) else list(tree.body)
        while nodes:
            node = nodes.pop()
            if isinstance(node, ast.Import):
                for alias in node.names:
                    add(alias.name)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                add(base)
                for alias in node.names:
                    add(f"{base}.{alias.name}")
            elif isinstance(node, (ast.If, ast.Try, ast.With, ast.ClassDef)):  # not into functions
                typing_only = isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
                fields = ("orelse",) if typing_only else ("body", "orelse", "finalbody")
                nodes += [n for f in fields for n in getattr(node, f, [])]
                nodes += [n for h in getattr(node, "handlers", []) for n in h.body]
    return keep
