"""Run every benchmark with its small defaults, one after the other (about 25 minutes on 2 CPU cores)."""

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
BENCHMARKS = ["tier_io.py", "critical_path.py", "break_even.py", "miss_path.py", "e2e_multiturn.py", "gpu_e2e.py"]

if __name__ == "__main__":
    failed = []
    for name in BENCHMARKS:
        print(f"\n======== {name}", flush=True)
        if subprocess.run([sys.executable, str(HERE / name)], cwd=HERE).returncode:
            failed.append(name)
    sys.exit(1 if failed else 0)
