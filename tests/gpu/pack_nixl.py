"""NIXL cut down to what its POSIX backend needs (tests/gpu/pack.py; recipe: docs/gpu-pack.md).

The nixl-cu13 wheel is ~110 MB unpacked: the core (``.nixl_cu13.mesonpy.libs``), ten backend plugins, and in
``nixl_cu13.libs`` UCX, gRPC, etcd, protobuf, Abseil, the AWS and Azure SDKs, libcurl, ldap, ... that the plugins
and the core's etcd metadata exchange link. The disk tier loads the core and ``libplugin_POSIX.so`` only. So:

1. Start from the Python extensions (``nixl_cu13/_bindings``, ``_utils``) and the POSIX plugin, follow each ELF
   file's ``DT_NEEDED`` through its ``RPATH``/``RUNPATH`` (``$ORIGIN``) inside the wheel, and keep what is reached;
   a library the wheel does not hold is the system's (libc, libstdc++, ...).
2. Do not follow :data:`CUT`: ``libnixl.so`` links gRPC and etcd for the etcd metadata exchange (used only when
   ``NIXL_ETCD_ENDPOINTS`` is set), 30+ MB with their dependencies. Each is replaced by a *shim*: a small library
   with the same soname that defines every symbol the kept libraries take from it (Python loads extensions with
   RTLD_NOW, so each must resolve) as a function that prints its name and aborts.
3. Delete everything else under the two library folders (the other plugins, UCX, the SDKs).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

LIB_DIRS = (".nixl_cu13.mesonpy.libs", "nixl_cu13.libs")
ROOTS = ("nixl_cu13/_bindings*.so", "nixl_cu13/_utils*.so", ".nixl_cu13.mesonpy.libs/plugins/libplugin_POSIX.so")
CUT = {
    "libgrpc-": "gRPC, linked by libnixl.so for the etcd client (19 MB, plus Abseil, re2, upb)",
    "libetcd-cpp-api-core-": "etcd's C++ client: NIXL's metadata exchange, only with NIXL_ETCD_ENDPOINTS set",
}
SYSTEM_LIBS = ("libstdc++.so.6", "libc.so.6", "libm.so.6", "libgcc_s.so.1")


def _dynamic(path: Path) -> tuple[list[str], list[str]]:
    """(DT_NEEDED, search dirs from RPATH/RUNPATH with $ORIGIN resolved) of an ELF file."""
    out = subprocess.run(["readelf", "-d", str(path)], check=True, capture_output=True, text=True).stdout
    needed = re.findall(r"\(NEEDED\)\s+Shared library: \[(.+?)\]", out)
    dirs = []
    for spec in re.findall(r"\((?:RPATH|RUNPATH)\)\s+Library r(?:un)?path: \[(.+?)\]", out):
        dirs += [Path(d.replace("$ORIGIN", str(path.parent))).resolve() for d in spec.split(":") if d]
    return needed, dirs


def _symbols(path, defined: bool) -> set[str]:
    flag = "--defined-only" if defined else "--undefined-only"
    out = subprocess.run(["nm", "-D", flag, str(path)], check=True, capture_output=True, text=True).stdout
    return {line.split()[-1].split("@")[0] for line in out.splitlines() if line.strip()}


def _system_lib(name: str) -> Path:
    found = subprocess.run(["cc", f"-print-file-name={name}"], check=True, capture_output=True, text=True)
    return Path(found.stdout.strip())


def _shim(cut_lib: Path, users: list[Path], out: Path) -> int:
    """A library named like ``cut_lib`` defining, as aborting functions, what ``users`` take from it."""
    wanted = set().union(*(_symbols(u, defined=False) for u in users)) & _symbols(cut_lib, defined=True)
    for lib in SYSTEM_LIBS:  # what the system defines resolves there (e.g. std::string members)
        wanted -= _symbols(_system_lib(lib), defined=True)
    src = ["#include <stdio.h>", "#include <stdlib.h>",
           "static void cut(const char *s) { fprintf(stderr, \"sglang-kvbm GPU pack: %s called, but "
           f"{cut_lib.name} was cut from NIXL (tests/gpu/pack_nixl.py)\\n\", s); abort(); }}"]
    src += [f'void {sym}(void) {{ cut("{sym}"); }}' for sym in sorted(wanted)]
    c_file = out.with_suffix(".shim.c")
    c_file.write_text("\n".join(src) + "\n")
    subprocess.run(["cc", "-shared", "-fPIC", "-O1", f"-Wl,-soname,{out.name}", "-o", str(out), str(c_file)],
                   check=True)
    c_file.unlink()
    return len(wanted)


def trim(site: Path) -> dict:
    """Cut the unpacked nixl-cu13 wheel in ``site`` down to the POSIX backend; returns what was kept and cut."""
    todo = [p for pattern in ROOTS for p in site.glob(pattern)]
    if len(todo) != len(ROOTS):
        raise SystemExit(f"nixl-cu13's layout changed: expected {ROOTS} under {site}, found {todo}")
    keep, cut_users = set(todo), {}
    while todo:
        lib = todo.pop()
        needed, dirs = _dynamic(lib)
        for name in needed:
            found = next((d / name for d in dirs if (d / name).is_file()), None)
            if found is None:
                continue  # the system's
            if name.startswith(tuple(CUT)):
                cut_users.setdefault(found, []).append(lib)
            elif found not in keep:
                keep.add(found)
                todo.append(found)
    shims = {}
    for cut_lib, users in cut_users.items():
        shim = cut_lib.with_name(cut_lib.name + ".shim")
        shims[cut_lib.name] = _shim(cut_lib, users, shim)
        keep.add(cut_lib)
        cut_lib.unlink()
        shim.rename(cut_lib)
    removed = 0
    for lib_dir in LIB_DIRS:
        for path in sorted((site / lib_dir).rglob("*"), reverse=True):
            if path.is_file() and path.resolve() not in {k.resolve() for k in keep}:
                path.unlink()
                removed += 1
            elif path.is_dir() and not any(path.iterdir()):
                path.rmdir()
    for extra in (*site.glob("nixl_cu13.scripts"), *site.glob("nixl_ep*")):  # NIXL's expert-parallel library
        shutil.rmtree(extra)
    return {"kept": sorted(str(p.relative_to(site)) for p in keep), "shims": shims, "removed_files": removed}


def check_loads(site: Path) -> None:
    """dlopen (RTLD_NOW) the kept core and the POSIX plugin: every symbol resolves, shims included. Python-version
    independent, so it checks a pack for another Python too."""
    import ctypes

    for lib in ("libnixl.so", "plugins/libplugin_POSIX.so"):
        ctypes.CDLL(str(site / ".nixl_cu13.mesonpy.libs" / lib), mode=ctypes.RTLD_GLOBAL | os.RTLD_NOW)


if __name__ == "__main__":  # python pack_nixl.py <pack>/site: check_loads in a process of its own
    check_loads(Path(sys.argv[1]))
