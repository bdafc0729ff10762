"""Make a directory unwritable even for root (which ignores permission bits), and writable again."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path


def make_unwritable(path: Path) -> None:
    if os.geteuid() == 0:  # root ignores permission bits; the immutable attribute stops it
        subprocess.run(["chattr", "+i", str(path)], check=True)
    else:
        path.chmod(0o500)


def make_writable(path: Path) -> None:
    if os.geteuid() == 0:
        subprocess.run(["chattr", "-i", str(path)], check=True)
    else:
        path.chmod(0o700)
