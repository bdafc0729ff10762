"""The block index's scheduler-path calls: two builds of ``sglang_kvbm._blocks`` compared in one run.

Per radix node the scheduler asks a tier's ``BlockIndex`` about a batch of block ids (64-char hex
sha256, SGLang's storage hashes): a node of ``--tokens`` tokens is ``tokens / page`` ids (1024, 64
and 16 at ``--page-sizes 1,16,64``). Timed, in ns per call (one call = one node's batch):

* ``held_by``: ``held_by(ids, [host, disk])``, host holding the first half of each node, disk all of it;
* ``run`` on a full hit; ``touch``; ``pin+unpin`` (a pin and the unpin that undoes it, as one pair);
* ``reserve`` and ``commit`` (timed apart) into free slots: the index has 4x the nodes' blocks of room,
  the batch is removed again between iterations (untimed);
* ``reserve (evict)``: the index full, each reserve evicts one node's blocks (least recently used);
* ``lookup+load+offload``: what the scheduler asks host of a node it finds there, in order: the lookup
  (``held_by(ids, [host], touch=True)``), the load's ``pin`` and ``unpin_slots``, and the offload's
  ``reserve_missing`` of that node (all held: nothing reserved), the load and the offload handed equal ids
  as other str objects (as SGLang's tree hands them); a build without those calls shows none.

BASE is built from ``--base REV`` (default ``HEAD~1``: its ``csrc/`` and ``CMakeLists.txt``), NEW from the
working tree's, each with cmake into ``build/bench-index/<name>/``, rebuilt only when the sources' hash
changes (needs cmake, and nanobind in this Python: ``.venv/bin/pip install nanobind``); ``--base-so`` /
``--new-so`` take prebuilt ``.so`` files instead. Every measurement is a fresh child process that loads
one ``.so`` as ``sglang_kvbm._blocks``; the builds alternate (base, new, new, base, ...: each first in every other round) for ``--rounds``
rounds, so drift hits both. A call's ns are the median over rounds of each child's best of ``--repeats``
loops of ~``--target-ms``; its new/base is the median over rounds of the ratio of that round's two
children (run back to back, so the machine's slow spells cancel). Met: every new/base <= 1.03. The loops run on
warm caches; ``--cold`` times each call alone after overwriting 64 MiB, as a scheduler's call after a forward finds
them (at page 1 most of a call's time is then its cache misses).

    .venv/bin/python benchmarks/index_calls.py                       # from the repo root, ~30 s on 2 cores
    .venv/bin/python benchmarks/index_calls.py --base HEAD --quick   # smoke run (one short round)
    .venv/bin/python benchmarks/index_calls.py --base 87fe354 --cold --page-sizes 1,16   # cold caches, ~2 min

Saves ``bench-out/index_calls.json`` (``KVBM_BENCH_OUT`` overrides), except with ``--quick``.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import itertools
import json
import math
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import out_dir, table

ROOT = Path(__file__).resolve().parents[1]
BUILD = ROOT / "build" / "bench-index"
CALLS = ("held_by", "run", "pin+unpin", "touch", "reserve", "commit", "reserve (evict)", "lookup+load+offload")
LIMIT = 1.03
COLD_BYTES = 64 << 20  # ``--cold``: written over between calls, several times this VM's last-level cache


def _run(cmd: list[str], what: str) -> str:
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if p.returncode:
        sys.exit(f"{what} failed ({' '.join(cmd)}):\n{(p.stdout + p.stderr)[-4000:]}")
    return p.stdout


# -- building -------------------------------------------------------------------------------------------


def _sources_hash(src: Path) -> str:
    h = hashlib.sha256(f"{sys.executable}\0{sys.version}\0".encode())
    for f in [src / "CMakeLists.txt", *sorted((src / "csrc").rglob("*"))]:
        if f.is_file():
            h.update(f"{f.relative_to(src)}\0".encode() + f.read_bytes() + b"\0")
    return h.hexdigest()


def build(name: str, fill) -> Path:
    """``fill(dir)`` writes csrc/ and CMakeLists.txt into dir; built in build/bench-index/<name>/ if they changed."""
    where = BUILD / name
    src, fresh, out, stamp = where / "src", where / "src.new", where / "out", where / "sources.sha256"
    shutil.rmtree(fresh, ignore_errors=True)
    fresh.mkdir(parents=True)
    fill(fresh)
    digest = _sources_hash(fresh)
    if list(out.glob("_blocks*.so")) and stamp.exists() and stamp.read_text() == digest:
        shutil.rmtree(fresh)
        return next(out.glob("_blocks*.so"))
    if shutil.which("cmake") is None:
        sys.exit("cmake is not on PATH: apt-get install cmake (or pip install cmake), or pass --base-so/--new-so")
    nb = subprocess.run([sys.executable, "-m", "nanobind", "--cmake_dir"], capture_output=True, text=True)
    if nb.returncode:
        sys.exit(f"nanobind is not installed in {sys.executable} (a build requirement only). Run\n"
                 f"  {sys.executable} -m pip install nanobind\nor pass prebuilt builds with --base-so/--new-so")
    shutil.rmtree(src, ignore_errors=True)
    fresh.rename(src)
    stamp.unlink(missing_ok=True)
    print(f"building {name} in {where} ...", flush=True)
    _run(["cmake", "-S", str(src), "-B", str(out), "-DCMAKE_BUILD_TYPE=Release",
          f"-DPython_EXECUTABLE={sys.executable}", f"-Dnanobind_DIR={nb.stdout.strip()}"], f"cmake ({name})")
    _run(["cmake", "--build", str(out), "--parallel"], f"building {name} (a prebuilt .so: --new-so/--base-so)")
    stamp.write_text(digest)
    return next(out.glob("_blocks*.so"))


def build_base(rev: str) -> tuple[str, Path]:
    sha = _run(["git", "rev-parse", "--verify", f"{rev}^{{commit}}"], f"git rev-parse {rev}").strip()
    export = f"git archive {sha} csrc CMakeLists.txt | tar -x -C {{}}"
    fill = lambda d: _run(["bash", "-o", "pipefail", "-c", export.format(shlex.quote(str(d)))], rev)  # noqa: E731
    return f"{rev} ({sha[:10]})", build(f"base-{sha[:12]}", fill)


def build_new() -> Path:
    return build("new", lambda d: (shutil.copytree(ROOT / "csrc", d / "csrc"), shutil.copy(ROOT / "CMakeLists.txt", d)))


# -- the child: one build, one page size -----------------------------------------------------------------


def child(a) -> dict[str, float]:
    import importlib.util

    import sglang_kvbm  # noqa: F401  (the parent package of the module loaded next)
    from sglang_kvbm.core.identity import chain_hashes

    spec = importlib.util.spec_from_file_location("sglang_kvbm._blocks", a.so)
    blocks = sys.modules["sglang_kvbm._blocks"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(blocks)
    k = a.nodes
    n = a.tokens // a.page_size  # ids per node
    ids = chain_hashes(range(7, 7 + (2 * k + 1) * a.tokens), a.page_size)
    nodes = [ids[i * n:(i + 1) * n] for i in range(k)]  # registered in every index but `full`
    fresh = [ids[(k + i) * n:(k + i + 1) * n] for i in range(k + 1)]  # another chain: `full`'s, and reserve's
    payloads = [object() for _ in range(n)]

    def filled(capacity: int, batches, part=slice(None)):
        idx = blocks.BlockIndex(capacity)
        for b in batches:
            idx.commit(idx.reserve(b[part])[0], payloads[part])
        return idx

    host, disk, spare = (filled(4 * n * k, nodes, part) for part in (slice(0, n // 2 or 1), slice(None), slice(None)))
    full, probe = filled(n * k, fresh[:k]), filled(n * k, fresh[:k])
    tiers, clock = [host, disk], time.perf_counter_ns
    assert len(blocks.held_by(nodes[0], tiers)) == n and disk.run(nodes[0]) == n, "every node held"
    assert len(probe.reserve(fresh[k])[1]) == n, "a reserve into the full index evicts one node"

    def held(seq, f=blocks.held_by):
        for b in seq:
            f(b, tiers)

    def run(seq, f=disk.run):
        for b in seq:
            f(b)

    def pin(seq, f=disk.pin, g=disk.unpin):
        for b in seq:
            f(b)
            g(b)

    def touch(seq, f=disk.touch):
        for b in seq:
            f(b)

    def reserve_commit(seq, idx=spare):  # -> (reserve, commit) ns, timed apart
        r = c = 0
        for i in range(len(seq)):
            b = fresh[i % k]
            t0 = clock()
            got = idx.reserve(b)
            t1 = clock()
            idx.commit(got[0], payloads)
            c += clock() - t1
            r += t1 - t0
            del got
            idx.remove(b)
        return r, c

    def reserve_evict(seq, idx=full, turn=itertools.cycle(fresh[k:] + fresh[:k])):  # k + 1 batches, room for k
        r = 0
        for _ in seq:
            b = next(turn)
            t0 = clock()
            got = idx.reserve(b)
            r += clock() - t0
            idx.commit(got[0], payloads)
            del got
        return (r,)

    copies = [[(i + " ")[:-1] for i in b] for b in nodes]  # equal ids, other objects
    nodes_of = {id(b): c for b, c in zip(nodes, copies)}

    def lookup_load_offload(seq, f=blocks.held_by, idx=disk):
        for b in seq:
            f(b, [idx], True)
            again = nodes_of[id(b)]
            idx.unpin_slots(idx.pin(again))
            idx.reserve_missing(again)

    junk, sink = bytearray(COLD_BYTES), bytearray(COLD_BYTES)

    def loop(body, iters: int) -> tuple[float, ...]:  # ns per call
        seq = [nodes[i % k] for i in range(iters)]
        if a.cold:  # each call timed alone, after the caches were overwritten (untimed)
            sums = None
            for b in seq:
                sink[:] = junk
                t0 = clock()
                timed = body([b]) or (clock() - t0,)
                sums = timed if sums is None else tuple(x + y for x, y in zip(sums, timed))
            return tuple(x / iters for x in sums)
        t0 = clock()
        timed = body(seq)
        total = clock() - t0
        return tuple(x / iters for x in timed) if timed else (total / iters,)

    bodies = {"held_by": held, "run": run, "pin+unpin": pin, "touch": touch,
              "reserve": reserve_commit, "reserve (evict)": reserve_evict}
    if hasattr(blocks.BlockIndex, "reserve_missing") and hasattr(blocks.BlockIndex, "unpin_slots"):
        bodies["lookup+load+offload"] = lookup_load_offload
    gc.disable()
    iters = {name: 2 * k if a.cold else max(k, int(a.target_ms * 1e6 / sum(loop(body, 2 * k))))  # (and warm up)
             for name, body in bodies.items()}
    result: dict[str, float] = {}
    for _ in range(a.repeats):  # a call's loops spread over the child's life: a slow spell misses some
        for name, body in bodies.items():
            for call, ns in zip(("reserve", "commit") if name == "reserve" else (name,), loop(body, iters[name])):
                result[call] = min(ns, result.get(call, ns))
    return result


# -- the parent ------------------------------------------------------------------------------------------


def measure(so: Path, page_size: int, a) -> dict[str, float]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--so", str(so), "--page-size", str(page_size),
           "--tokens", str(a.tokens), "--nodes", str(a.nodes), "--target-ms", str(a.target_ms),
           "--repeats", str(a.repeats)] + (["--cold"] if a.cold else [])
    return json.loads(_run(cmd, f"the child for {so} at page {page_size}").strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base", default="HEAD~1", help="git revision of the base build (default HEAD~1)")
    p.add_argument("--base-so", help="a prebuilt base _blocks*.so (instead of building --base)")
    p.add_argument("--new-so", help="a prebuilt new _blocks*.so (instead of building the working tree's csrc/)")
    p.add_argument("--page-sizes", default="1,16,64")
    p.add_argument("--tokens", type=int, default=1024, help="tokens per radix node (default 1024)")
    p.add_argument("--nodes", type=int, default=8, help="nodes held in each index (default 8)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--repeats", type=int, default=5, help="timed loops per call in each child; the best counts")
    p.add_argument("--target-ms", type=float, default=8.0, help="length of one timed loop (default 8)")
    p.add_argument("--cold", action="store_true",
                   help="each call alone on cold caches (64 MiB written over before it), as a scheduler's call after a "
                   "forward finds them; 2 x --nodes calls a loop")
    p.add_argument("--quick", action="store_true", help="smoke run: 1 round of short loops, nothing saved")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--so", help=argparse.SUPPRESS)
    p.add_argument("--page-size", type=int, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print(json.dumps(child(a)))
        return
    if a.quick:
        a.rounds, a.repeats, a.target_ms = 1, 1, 2.0
    base_name, base_so = (a.base_so, Path(a.base_so)) if a.base_so else build_base(a.base)
    new_name, new_so = (a.new_so, Path(a.new_so)) if a.new_so else ("working tree", build_new())
    sizes = [int(s) for s in a.page_sizes.split(",")]
    print(f"base: {base_name}\nnew:  {new_name}\n{a.rounds} rounds, page sizes {sizes}, {a.tokens} tokens a node",
          flush=True)
    runs = {(b, ps): [] for b in ("base", "new") for ps in sizes}
    t0 = time.time()
    for r in range(a.rounds):
        for ps in sizes:
            pair = (("base", base_so), ("new", new_so))
            for b, so in pair if r % 2 == 0 else pair[::-1]:  # each build first in every other round
                runs[b, ps].append(measure(so, ps, a))
        print(f"  round {r + 1}/{a.rounds} ({time.time() - t0:.0f} s)", flush=True)
    rows, ratios, slower, saved = [], [], [], []
    for ps in sizes:
        for call in CALLS:
            if any(call not in x for b in ("base", "new") for x in runs[b, ps]):  # a build without its calls
                continue
            base, new = ([x[call] for x in runs[b, ps]] for b in ("base", "new"))
            each = [y / x for x, y in zip(base, new)]  # a round's two children ran back to back: drift cancels
            ratio = statistics.median(each)
            ratios.append(ratio)
            if ratio > LIMIT:
                slower.append(f"{call} at page {ps} ({ratio:.3f})")
            rows.append([ps, a.tokens // ps, call, statistics.median(base), statistics.median(new), ratio,
                         f"{min(each):.2f}-{max(each):.2f}"])
            saved.append(dict(page_size=ps, call=call, base_ns=base, new_ns=new, ratio=ratio))
    geo = math.exp(statistics.fmean(math.log(x) for x in ratios))
    print(table(["page", "ids", "call", "base ns", "new ns", "new/base", "rounds' ratios"], rows))
    print(f"geometric mean new/base: {geo:.3f}")
    print(f"new <= base: MISSED, slower: {', '.join(slower)}" if slower else f"new <= base: met (all <= {LIMIT})")
    if not a.quick:
        path = out_dir() / "index_calls.json"
        path.write_text(json.dumps(dict(base=str(base_name), new=str(new_name), rounds=a.rounds, tokens=a.tokens,
                                        nodes=a.nodes, geomean=geo, calls=saved), indent=1))
        print(f"saved {path}")


if __name__ == "__main__":
    main()
