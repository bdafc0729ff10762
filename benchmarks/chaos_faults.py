"""The chaos soak's faults on its workers (``chaos_worker.Worker``) and on Mooncake.

The faults damage what a worker keeps on disk (segment data and headers,
truncation, a deleted segment, the index snapshot and journal) or in Mooncake
(objects overwritten with other bytes of the same size), kill it with SIGKILL
and start it again on the same directory, reload its weights from disk, flush
its cache, and kill and restart the Mooncake master. Each returns a short
description of what it did ("" when there was nothing to damage).
"""

from __future__ import annotations

import os
import random
import time
from pathlib import Path
from typing import Optional

import requests

from chaos_worker import Worker

HEADER_BYTES = 4096  # a slot's header row at page 16 (tiers.format.header_bytes_for)


# -- disk damage ----------------------------------------------------------------------------------


def _live_dir(worker: Worker) -> Optional[Path]:
    """The identity directory the server writes now (a weight update moves it: the last one written to)."""
    def written(d: Path) -> float:
        return max((p.stat().st_mtime for p in d.iterdir() if p.is_file()), default=0.0)

    dirs = worker.tier_dirs()
    return max(dirs, key=written) if dirs else None


def _segments(worker: Worker) -> list[Path]:
    live = _live_dir(worker)
    return sorted(live.glob("seg-*.kv")) if live else []


def _flip(path: Path, offsets, rng: random.Random) -> int:
    """XOR a random non-zero byte into ``path`` at each offset inside it; how many were flipped."""
    size = path.stat().st_size
    flipped = 0
    with open(path, "r+b") as f:
        for offset in offsets:
            if 0 <= offset < size:
                f.seek(offset)
                byte = f.read(1)
                f.seek(offset)
                f.write(bytes([byte[0] ^ rng.randrange(1, 256)]))
                flipped += 1
    return flipped


def _used_slots(worker: Worker, path: Path, rng: random.Random, count: int, slot_bytes: int) -> list[int]:
    """Slots of ``path`` that hold a block now (a magic at the slot's start), else any slots."""
    slots = path.stat().st_size // slot_bytes
    used = []
    with open(path, "rb") as f:
        for k in range(slots):
            f.seek(k * slot_bytes)
            if f.read(6) == b"SGKVBM":
                used.append(k)
    pool = used or list(range(slots))
    return rng.sample(pool, min(count, len(pool)))


def disk_flip(worker: Worker, rng: random.Random, slot_bytes: int, *, header: bool, count: int = 6) -> str:
    segments = _segments(worker)
    if not segments:
        return ""
    path = rng.choice(segments)
    slots = _used_slots(worker, path, rng, count, slot_bytes)
    if header:  # inside the header's used part: magic, length, checksum, the msgpack payload
        offsets = [k * slot_bytes + rng.randrange(0, 160) for k in slots]
    else:
        offsets = [k * slot_bytes + HEADER_BYTES + rng.randrange(slot_bytes - HEADER_BYTES) for k in slots]
    n = _flip(path, offsets, rng)
    return f"{n} {'header' if header else 'data'} bytes in {path.name} slots {sorted(slots)}" if n else ""


def disk_truncate(worker: Worker, rng: random.Random) -> str:
    segments = [p for p in _segments(worker) if p.stat().st_size]
    if not segments:
        return ""
    path = rng.choice(segments)
    size = path.stat().st_size
    keep = rng.randrange(size // 8, size // 2)
    os.truncate(path, keep)
    return f"{path.name} {size} -> {keep} bytes"


def disk_delete(worker: Worker, rng: random.Random) -> str:
    segments = _segments(worker)
    if not segments:
        return ""
    path = rng.choice(segments)
    path.unlink()
    return f"deleted {path.name}"


def index_flip(worker: Worker, rng: random.Random, name: str) -> str:
    """Flip 4 bytes of ``index.msgpack`` or of the journal's first half (a record with good ones after it)."""
    live = _live_dir(worker)
    for d in [live] if live else []:
        path = d / name
        if path.exists() and path.stat().st_size > 16:
            size = path.stat().st_size
            end = size if name == "index.msgpack" else max(17, size // 2)
            start = rng.randrange(0, end - 4)
            n = _flip(path, range(start, start + 4), rng)
            return f"{n} bytes at {start} of {name} ({size} bytes)"
    return ""


# -- whole-server faults ---------------------------------------------------------------------------


def flush(worker: Worker, bound: float) -> tuple[bool, int]:
    """``/flush_cache``, retried while SGLang refuses it (400: not idle); (done, tries)."""
    deadline = time.monotonic() + bound
    tries = 0
    while time.monotonic() < deadline:
        tries += 1
        if requests.post(f"{worker.url}/flush_cache", timeout=60).status_code == 200:
            return True, tries
        time.sleep(0.2)
    return False, tries


def weight_update(worker: Worker, rng: random.Random) -> str:
    """``/update_weights_from_disk`` with the files it serves (with or without SGLang's flush)."""
    flush_cache = rng.random() < 0.5
    response = requests.post(f"{worker.url}/update_weights_from_disk",
                             json={"model_path": str(worker.model), "flush_cache": flush_cache}, timeout=600)
    body = response.json()
    if not body.get("success"):
        raise RuntimeError(f"update_weights_from_disk failed: {response.status_code} {body}")
    return f"flush_cache={flush_cache}"


def abort_stream(url: str, prompt: list, *, after_first: bool) -> None:
    """A streaming request the client closes: before any token (mid-prefill or mid-load), or after the first."""
    body = {"input_ids": prompt, "stream": True,
            "sampling_params": {"max_new_tokens": 64, "temperature": 0.0, "ignore_eos": True}}
    response = requests.post(f"{url}/generate", json=body, stream=True, timeout=120)
    try:
        if after_first:
            next(response.iter_lines(), None)
    finally:
        response.close()


# -- Mooncake ------------------------------------------------------------------------------------


def g4_damage(cluster, rng: random.Random, log: Path) -> str:
    """Overwrite 5% of this library's objects in Mooncake (4 to 64) with other bytes of the same size:
    one byte of the block flipped, all of it random, or a byte of the header changed. Done by a Mooncake
    client in a process of its own (it lends nothing; its log goes to ``log``, not into the report)."""
    import json
    import subprocess
    import sys

    with open(log, "ab") as err:
        out = subprocess.run([sys.executable, __file__, "g4-damage", cluster.master_address, cluster.metadata_url,
                              f"http://127.0.0.1:{cluster.admin_port}", str(rng.randrange(1 << 30))],
                             stdout=subprocess.PIPE, stderr=err, timeout=120,
                             env={**os.environ, "MC_TCP_BIND_ADDRESS": "127.0.0.1"})
    done = json.loads(out.stdout or b"[]") if out.returncode == 0 else []
    if out.returncode:
        raise RuntimeError(f"the G4 damage client exited with {out.returncode} (see {log})")
    kinds = {how: done.count(how) for how in sorted(set(done))}
    return f"{len(done)} objects ({', '.join(f'{n} {how}' for how, n in kinds.items())})" if done else ""


def _g4_damage_main(master: str, metadata: str, admin: str, seed: str) -> None:
    import json

    from mooncake.store import MooncakeDistributedStore

    from sglang_kvbm.tiers.mooncake.events import list_keys

    rng = random.Random(int(seed))
    keys = sorted(k for k in list_keys(admin) if k.startswith("kvbm-"))
    done = []
    if keys:
        client = MooncakeDistributedStore()
        if client.setup("127.0.0.1", metadata, 0, 16 << 20, "tcp", "", master) != 0:
            raise SystemExit(2)
        for key in rng.sample(keys, min(max(4, len(keys) // 20), 64, len(keys))):
            data = client.get(key)
            if not data:
                continue
            data = bytearray(data)
            how = rng.choice(["flip", "random", "header"])
            if how == "flip":
                at = rng.randrange(HEADER_BYTES, len(data))
                data[at] ^= rng.randrange(1, 256)
            elif how == "random":
                data[HEADER_BYTES:] = os.urandom(len(data) - HEADER_BYTES)
            else:
                at = rng.randrange(8, 160)
                data[at] ^= rng.randrange(1, 256)
            if client.upsert(key, bytes(data)) != 0 and (client.remove(key, True) != 0 or client.put(key, bytes(data))):
                continue
            if client.get(key) == bytes(data):
                done.append(how)
        client.close()
    print(json.dumps(done))


def master_restart(cluster, serve_meanwhile) -> str:
    """SIGKILL the master (every object's metadata is gone with it), serve a wave without it, start it again."""
    cluster.kill_master()
    serve_meanwhile()
    cluster.start_master()
    deadline = time.monotonic() + 60
    while cluster.capacity() == 0 and time.monotonic() < deadline:  # the lender mounts its memory again
        time.sleep(0.2)
    return f"lender capacity {cluster.capacity()} bytes after restart"


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == ["g4-damage"]:
        _g4_damage_main(*sys.argv[2:6])
