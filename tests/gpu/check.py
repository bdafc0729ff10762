"""``make gpu-check``'s steps on a GPU machine, and the one table they end in.

Run from the repository root after ``make native`` (the block index built in
place for this Python), with SGLang from ``make gpu-pack``'s folder on the path
(``. .gpu-pack/env.sh``). Each step's whole output goes to ``--out`` (the device
tool's ``$OUT``, or ``build/gpu-check``); the table is printed last:

1. ``tests/gpu`` plainly: the CUDA data path (``test_cuda_local.py``) and
   SGLang's pools, tree and linker driven as the scheduler drives them
   (``test_sglang_on_cuda.py``), CPU twins included;
2. the same under ``TORCH_CUDA_SANITIZER=1``, on the small shapes (page 16 and
   the torch-level tests: the sanitizer slows every kernel launch);
3. ``benchmarks/gpu_e2e.py``: TTFT of an 8B-shaped model, recompute, device,
   host and disk hits, and a pinned memcpy of the same KV bytes.

    python tests/gpu/check.py [--out DIR] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
SANITIZED = "not test_scheduler_round_trip or 16"  # -k: the torch-level tests, and page 16 of the SGLang ones


def run(name: str, cmd: list[str], out: Path, env: dict) -> tuple[int, float]:
    started = time.monotonic()
    with open(out / f"{name}.log", "w") as log:
        print(f"== {name}: {' '.join(cmd)}", flush=True)
        code = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    seconds = time.monotonic() - started
    print(f"   exit {code} after {seconds:.0f} s (log: {out / (name + '.log')})", flush=True)
    return code, seconds


def pytest_counts(xml: Path) -> str:
    if not xml.exists():
        return "no report"
    suite = ET.parse(xml).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    tests, skipped = int(suite.get("tests", 0)), int(suite.get("skipped", 0))
    failed = int(suite.get("failures", 0)) + int(suite.get("errors", 0))
    return f"{tests - skipped - failed} passed, {failed} failed, {skipped} skipped"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "build" / "gpu-check"))
    parser.add_argument("--quick", action="store_true", help="the benchmark's --quick (2 runs, S = 2048 only)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    py = sys.executable
    # test_stubs.py checks the pack's stubs on CPU (CI runs it); here any call of a stub raises anyway.
    pytest = [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", "tests/gpu", "--ignore=tests/gpu/test_stubs.py"]
    rows = []
    code, secs = run("tests", pytest + [f"--junitxml={out / 'tests.xml'}"], out, env)
    rows.append(["tests/gpu", pytest_counts(out / "tests.xml"), f"{secs:.0f}"])
    failed = code != 0
    if torch.cuda.is_available():  # the sanitizer initializes CUDA when torch is imported
        code, secs = run("sanitizer", pytest + ["-k", SANITIZED, f"--junitxml={out / 'sanitizer.xml'}"], out,
                         dict(env, TORCH_CUDA_SANITIZER="1"))
        rows.append(["tests/gpu, TORCH_CUDA_SANITIZER=1 (small shapes)", pytest_counts(out / "sanitizer.xml"),
                     f"{secs:.0f}"])
        failed |= code != 0
    else:
        rows.append(["tests/gpu, TORCH_CUDA_SANITIZER=1", "not run: no CUDA", ""])
    figures = out / "gpu_e2e.json"
    bench = [py, "benchmarks/gpu_e2e.py", "--json", str(figures)] + (["--quick"] if args.quick else [])
    code, secs = run("gpu_e2e", bench, out, env)
    failed |= code != 0
    if figures.exists():
        data = json.loads(figures.read_text())
        rows.append([f"gpu_e2e ({data['shape']}, {data['device']}, page {data['page_size']})",
                     "; ".join(data["failed"]) or "every check passed", f"{secs:.0f}"])
        for r in data["rows"]:
            rows.append([f"  P={r['prefix']} S={r['suffix']}", summary(r), ""])
    else:
        rows.append(["gpu_e2e", f"no figures (exit {code})", f"{secs:.0f}"])
    width = max(len(r[0]) for r in rows)
    print(f"\n{'step':<{width}}  {'result':<60}  s")
    for name, result, secs in rows:
        print(f"{name:<{width}}  {result:<60}  {secs}")
    print("\nFAILED" if failed else "\nOK")
    return 1 if failed else 0


def summary(r: dict) -> str:
    """A benchmark row in one line: TTFT medians (ms) and the ratios the issue sets targets for."""
    med = {name: value * 1e3 for name, value in r.get("medians_s", {}).items() if isinstance(value, (int, float))}
    parts = [f"{name} {med[name]:.2f}" for name in ("recompute", "device", "host", "disk", "hicache", "memcpy")
             if name in med]
    ratios = []
    if {"host", "device", "memcpy"} <= med.keys():
        ratios.append(f"host/max(device,memcpy) {med['host'] / max(med['device'], med['memcpy']):.3f}")
    for name in ("host", "disk"):
        if {name, "recompute"} <= med.keys():
            ratios.append(f"{name}/recompute {med[name] / med['recompute']:.3f}")
    equal = f"logits host==device {r.get('host_logits_equal_device')}"
    return "ms: " + ", ".join(parts) + " | " + ", ".join(ratios) + " | " + equal


if __name__ == "__main__":
    sys.exit(main())
