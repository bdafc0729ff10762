"""What naming a model by its content costs at start-up (``core.content_digest``), against reading its files.

A local model directory of ``--gb`` GiB of weights (``--shards`` files of random bytes) is
identified three times in one run:

* **read**: every file read once into a buffer (the disk's and page cache's limit; the baseline);
* **first start**: ``fingerprint.model_identity`` with an empty digest cache (SHA-256 of every file,
  files in parallel);
* **restart**: the same with the cache the first start wrote (reads nothing);
* **second host**: a copy of the directory at another path with other mtimes (reads it again, as
  a second host would, and must give the same identity).

The page cache is warm for all of them after the first (this machine has no way to drop it
unprivileged): the first-start figure is the hashing cost, not a cold disk's.

    ../.venv/bin/python identity_digest.py --gb 4 --shards 2
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

from common import scratch_dir, table, verdict
from sglang_kvbm.core.content_digest import DigestCache
from sglang_kvbm.integration.sglang.fingerprint import model_identity

CHUNK = 8 << 20


def make_model(root: Path, gib: float, shards: int) -> Path:
    model = root / "model"
    model.mkdir(parents=True)
    (model / "config.json").write_text('{"model_type": "llama"}')
    per_shard = int(gib * (1 << 30) / shards)
    block = os.urandom(CHUNK)
    for i in range(shards):
        with open(model / f"model-{i + 1:05d}-of-{shards:05d}.safetensors", "wb") as f:
            left = per_shard
            while left > 0:
                n = min(left, CHUNK)
                f.write(block[:n])
                left -= n
                block = block[1:] + block[:1]  # not one repeated chunk
    return model


def read_all(model: Path) -> int:
    buffer = bytearray(CHUNK)
    total = 0
    for path in sorted(model.iterdir()):
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buffer):
                total += n
    return total


def timed(fn):
    started = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=2.0, help="GiB of weights (default 2)")
    parser.add_argument("--shards", type=int, default=2, help="weight files (default 2)")
    args = parser.parse_args()
    root = Path(scratch_dir("kvbm-identity-"))
    model = make_model(root, args.gb, args.shards)
    size = sum(p.stat().st_size for p in model.iterdir())
    _, read_s = timed(lambda: read_all(model))
    cache = DigestCache(root / "digests.json")
    first, first_s = timed(lambda: model_identity(str(model), cache=DigestCache(cache.path)))
    again, again_s = timed(lambda: model_identity(str(model), cache=DigestCache(cache.path)))
    copy = root / "host-b" / "weights"
    shutil.copytree(model, copy)
    for path in copy.iterdir():
        os.utime(path, ns=(10**18, 10**18))
    other, other_s = timed(lambda: model_identity(str(copy), cache=DigestCache(root / "host-b.json")))
    gib = size / (1 << 30)
    rows = [
        ["read every file (baseline)", f"{read_s:.2f}", f"{gib / read_s:.2f}", "1.00"],
        ["first start (SHA-256)", f"{first_s:.2f}", f"{gib / first_s:.2f}", f"{first_s / read_s:.2f}"],
        ["restart (cached)", f"{again_s:.4f}", "-", f"{again_s / read_s:.4f}"],
        ["second host (its own copy)", f"{other_s:.2f}", f"{gib / other_s:.2f}", f"{other_s / read_s:.2f}"],
    ]
    print(f"model: {gib:.2f} GiB in {args.shards} weight files, {os.cpu_count()} CPUs")
    print(table(["identity", "seconds", "GiB/s", "vs read"], rows))
    same = first["content"] == again["content"] == other["content"]
    print(f"same identity on restart and on the second host: {same}")
    print(f"restart reads nothing: {verdict(again_s / read_s, 0.01)}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
