#!/usr/bin/env python3
"""Lay out SGLang's released source as its git checkout would be, and apply this project's patch.

SGLang 0.5.23 publishes no sdist; its wheel holds the ``sglang`` package exactly
as ``python/sglang`` at tag v0.5.23. This script downloads that wheel from the
package index, unpacks it into ``DEST/python/sglang``, commits it to a fresh git
repository (so the patch is reviewable with ``git diff``), and applies
``sglang-v<VERSION>-kvbm.patch`` with ``git apply`` (or the ``--patch`` files given, in order:
``sglang-v0.5.23-linker-one-rank.patch`` is an upstream fix, see the README).

    python patches/checkout_sglang.py --dest /tmp/sglang-kvbm
    PYTHONPATH=/tmp/sglang-kvbm/python python -m sglang.launch_server ... --enable-kvbm

Run the patched tree either like that (the installed SGLang's dependencies are
reused) or ``pip install -e /tmp/sglang-kvbm/python``-style from a real checkout.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run(*cmd: str, cwd: Path) -> None:
    subprocess.run(cmd, cwd=cwd, check=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dest", required=True, type=Path, help="directory to create (must not exist)")
    parser.add_argument("--version", default="0.5.23")
    parser.add_argument("--patch", type=Path, action="append",
                        help="a patch to apply, in order (repeatable); default: patches/sglang-v<version>-kvbm.patch")
    parser.add_argument("--no-apply", action="store_true", help="lay out the pristine source only")
    args = parser.parse_args(argv)
    patches = [p.resolve() for p in (args.patch or [HERE / f"sglang-v{args.version}-kvbm.patch"])]
    dest = args.dest.resolve()
    if dest.exists():
        parser.error(f"{dest} exists")

    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary", ":all:",
             f"sglang=={args.version}", "--dest", tmp],
            check=True,
        )
        (wheel,) = Path(tmp).glob("sglang-*.whl")
        with zipfile.ZipFile(wheel) as zf:
            members = [m for m in zf.namelist() if m.startswith("sglang/")]
            zf.extractall(dest / "python", members)
    run("git", "init", "-q", cwd=dest)
    run("git", "add", "-A", cwd=dest)
    run("git", "-c", "user.name=sglang-kvbm", "-c", "user.email=sglang-kvbm@localhost",
        "commit", "-q", "-m", f"sglang {args.version} (from its wheel)", cwd=dest)
    if not args.no_apply:
        for patch in patches:
            run("git", "apply", "--index", str(patch), cwd=dest)
            print(f"applied {patch.name} to {dest}")
        subprocess.run(["git", "diff", "--cached", "--stat"], cwd=dest, check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
