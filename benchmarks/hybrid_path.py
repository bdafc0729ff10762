"""Hybrid models' tier hits: cache calls and the load per token restored, per model kind, against dense.

Sliding-window and Mamba hybrids and draft KV cannot be trusted in a real CPU
server (see ``tests/sglang/test_hybrid_swa.py``), so this measures in process what a
tier hit costs the scheduler thread on SGLang's own pools and default tree
(``harness.hybrid``): each round computes and inserts a fresh
prompt (its write-through offload included, timed as ``insert``), evicts the
device cache, and brings the prompt back from the host tier: ``match``
(``match_prefix`` with the linker's lookup), ``load`` (``init_load_back`` and
the start of the layer-wise load) and ``wait`` (``finish_external_linker_loads``:
with no forward to overlap, the whole copy). The baseline is a dense MHA model
with as many layers (four) and the same page size, measured in the same run.
Target: each kind <= 1.5x dense per token restored (match + load + wait).

    python benchmarks/hybrid_path.py                 # ~1 minute
    python benchmarks/hybrid_path.py --rounds 200 --pages 32 --page-size 16
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import warnings
from pathlib import Path

import torch

import checkout  # noqa: F401  (tests/harness on sys.path)

KINDS = ("dense", "swa", "mamba", "draft")
STEPS = ("match", "load", "wait", "insert")
TARGET = 1.5


def run(kind: str, rounds: int, pages: int, page_size: int, workdir: Path) -> tuple[dict, int, int]:
    from harness.hybrid import admit, build

    h = build(kind, workdir / kind, page_size=page_size, window=2 * page_size + 1, host_blocks=4 * pages + 64,
              requests=2 * rounds + 8)
    timings: dict = {}
    restored = 0
    for r in range(2 + rounds):  # two warm-up rounds, not counted
        tokens = list(range(100_000 * (r + 1), 100_000 * (r + 1) + pages * page_size + 2))
        into = timings if r >= 2 else None
        admit(h, tokens, timings=into)
        h.evict_device()
        back = admit(h, tokens, compute=False, timings=into)
        assert back.loaded_tokens and not back.failed, f"{kind}: no tier hit in round {r}"
        restored += back.loaded_tokens if r >= 2 else 0
    row_bytes = h.linker.layout.block_bytes + sum(m.layout.block_bytes for m in h.linker.sidecars.managers.values())
    h.linker.close()
    return timings, restored, row_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--pages", type=int, default=16, help="pages per prompt")
    parser.add_argument("--page-size", type=int, default=4)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in KINDS:
            rows[kind] = run(kind, args.rounds, args.pages, args.page_size, Path(tmp))
    base_t, base_n, _ = rows["dense"]
    base = sum(base_t[s] for s in ("match", "load", "wait")) / base_n
    print(f"\n{args.rounds} rounds, {args.pages} pages of {args.page_size} tokens restored from the host tier per round")
    print(f"{'kind':<7}{'block B':>9}" + "".join(f"{s + ' us/tok':>15}" for s in STEPS) + f"{'restore vs dense':>18}")
    worst = 0.0
    for kind, (timings, restored, row_bytes) in rows.items():
        per = {s: timings.get(s, 0.0) / restored * 1e6 for s in STEPS}
        ratio = sum(timings[s] for s in ("match", "load", "wait")) / restored / base
        print(f"{kind:<7}{row_bytes:>9}" + "".join(f"{per[s]:>15.2f}" for s in STEPS) + f"{ratio:>17.2f}x")
        worst = max(worst, ratio)
    print(f"target: every kind <= {TARGET}x dense per token restored: {'met' if worst <= TARGET else 'MISSED'}")


if __name__ == "__main__":
    main()
