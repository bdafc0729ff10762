"""Shared by the benchmarks: ratio tables, percentiles, plots, output directory."""

from __future__ import annotations

import atexit
import os
import shutil
import statistics
import tempfile
from pathlib import Path
from typing import Sequence

OUT = Path(os.environ.get("KVBM_BENCH_OUT", "bench-out"))


def out_dir() -> Path:
    OUT.mkdir(parents=True, exist_ok=True)
    return OUT


def scratch_dir(prefix: str) -> str:
    """A temporary directory removed when the benchmark exits (disk tiers and HiCache's L3 preallocate GBs)."""
    path = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def pct(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def mean(values: Sequence[float]) -> float:
    return statistics.fmean(values) if values else float("nan")


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[str(h) for h in headers]] + [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for n, row in enumerate(cells):
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)


def verdict(value: float, target: float, lower_is_better: bool = True) -> str:
    ok = value <= target if lower_is_better else value >= target
    return f"{'met' if ok else 'MISSED'} ({'<=' if lower_is_better else '>='} {target})"


def save_plot(name: str, draw) -> str:
    """``draw(ax)`` on a fresh figure, saved as a PNG in the output directory; returns where.

    The tables need nothing beyond the test install; the plots need matplotlib
    (the ``bench`` extra), and are skipped with a word when it is missing.
    """
    try:
        import matplotlib
    except ImportError:
        return "skipped (no matplotlib: pip install -e '.[bench]', or run make bench)"

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    draw(ax)
    fig.tight_layout()
    path = out_dir() / f"{name}.png"
    fig.savefig(path)
    plt.close(fig)
    return str(path)
