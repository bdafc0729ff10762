"""The chaos soak's passes: the stock reference, a replay of the same prompts, and the pass under faults.

Every request of a wave is sent at once (a thread each); a completed request's
greedy ids are compared with the reference's for its prompt. A request not
answered within ``hang_s`` is a hang; any other failure is an error.
"""

from __future__ import annotations

import dataclasses
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional

import requests

import chaos_faults as faults
from chaos_workload import ANSWER, INSIDE_WAVE, Request, Schedule


@dataclasses.dataclass
class Tally:
    name: str
    completed: int = 0
    prompt_tokens: int = 0
    hits: dict = dataclasses.field(default_factory=lambda: {"device": 0, "host": 0, "storage": 0})
    wrong: list = dataclasses.field(default_factory=list)
    hangs: list = dataclasses.field(default_factory=list)
    errors: list = dataclasses.field(default_factory=list)
    latency: list = dataclasses.field(default_factory=list)
    slowest: list = dataclasses.field(default_factory=list)  # (seconds, request, server, cached tokens by tier)
    serve_s: float = 0.0  # inside waves
    max_logprob_diff: float = 0.0
    faults: dict = dataclasses.field(default_factory=dict)  # kind -> [applied, skipped (nothing to damage)]
    fault_log: list = dataclasses.field(default_factory=list)
    leaks: list = dataclasses.field(default_factory=list)
    idle_checks: int = 0
    restarts: list = dataclasses.field(default_factory=list)  # seconds to healthy
    crashes: list = dataclasses.field(default_factory=list)
    lower: dict = dataclasses.field(default_factory=dict)  # summed over incarnations: what the tiers rejected

    @property
    def cached(self) -> int:
        return sum(self.hits.values())

    def failed(self) -> bool:
        return bool(self.wrong or self.hangs or self.errors or self.leaks or self.crashes)


def generate(url: str, prompt: list, timeout: float) -> dict:
    body = {"input_ids": prompt, "return_logprob": True,
            "sampling_params": {"max_new_tokens": ANSWER, "temperature": 0.0, "ignore_eos": True}}
    response = requests.post(f"{url}/generate", json=body, timeout=timeout)
    response.raise_for_status()
    return response.json()


class Replay:
    """Sends waves and scores them. ``reference`` None: this pass *is* the reference (it records the answers)."""

    def __init__(self, sched: Schedule, tally: Tally, reference: Optional[dict], hang_s: float,
                 concurrency: int) -> None:
        self.sched, self.tally, self.reference, self.hang_s = sched, tally, reference, hang_s
        self.pool = ThreadPoolExecutor(max_workers=concurrency + 3, thread_name_prefix="chaos")
        self.lock = threading.Lock()
        self.answers: dict = {}  # (conv, turn) -> (ids, logprobs), when this pass is the reference

    def one(self, url: str, req: Request, note: str = "") -> None:
        prompt = self.sched.prompt(req.conv, req.turn)
        started = time.monotonic()
        try:
            out = generate(url, prompt, self.hang_s)
        except requests.Timeout:
            with self.lock:
                self.tally.hangs.append(f"request {req.index} (conv {req.conv} turn {req.turn}) {note}")
            return
        except (requests.RequestException, ValueError) as exc:
            with self.lock:
                self.tally.errors.append(f"request {req.index} {note}: {type(exc).__name__}: {str(exc)[:200]}")
            return
        meta = out["meta_info"]
        ids, logprobs = out["output_ids"], [lp for lp, _, _ in meta["output_token_logprobs"]]
        with self.lock:
            t = self.tally
            t.latency.append(time.monotonic() - started)
            t.slowest = sorted(t.slowest + [(round(t.latency[-1], 3), req.index, url, meta.get("cached_tokens_details"))],
                               reverse=True)[:5]
            t.completed += 1
            t.prompt_tokens += len(prompt)
            for kind, n in (meta.get("cached_tokens_details") or {"device": meta.get("cached_tokens", 0)}).items():
                if kind in t.hits:
                    t.hits[kind] += n
            key = (req.conv, req.turn)
            want = self.reference.get(key) if self.reference is not None else self.answers.get(key)
            if want is None:  # the reference pass, first time this prompt is asked
                self.answers[key] = (ids, logprobs)
                self.sched.answers[key] = ids
                return
            if ids != want[0]:
                first = next(i for i, (a, b) in enumerate(zip(ids + [None], want[0])) if a != b)
                t.wrong.append(f"request {req.index} conv {req.conv} turn {req.turn} ({len(prompt)} tokens, "
                               f"cached {meta.get('cached_tokens_details')}) {note}: first differs at {first}: "
                               f"{ids} != {want[0]}")
            else:
                t.max_logprob_diff = max([t.max_logprob_diff, *(abs(a - b) for a, b in zip(logprobs, want[1]))])

    def wave(self, wave: list, url_of: Callable[[Request], str], extra: list = ()) -> None:
        started = time.monotonic()
        jobs = [self.pool.submit(self.one, url_of(r), r) for r in wave] + [self.pool.submit(f) for f in extra]
        for job in jobs:
            job.result()
        self.tally.serve_s += time.monotonic() - started


def reference_pass(sched: Schedule, url: str, tally: Tally, hang_s: float, concurrency: int) -> dict:
    """Every wave on a stock server; fills ``sched.answers``; a repeat that differs from its first answer is
    counted wrong (stock against itself: a device hit against the cold run)."""
    replay = Replay(sched, tally, None, hang_s, concurrency)
    for wave in sched.waves:
        replay.wave(wave, lambda r: url)
    replay.pool.shutdown()
    return replay.answers


def replay_pass(sched: Schedule, url: str, tally: Tally, reference: dict, hang_s: float, concurrency: int) -> None:
    """The same prompts on another server (the self-check), no faults."""
    replay = Replay(sched, tally, reference, hang_s, concurrency)
    for wave in sched.waves:
        replay.wave(wave, lambda r: url)
    replay.pool.shutdown()


class ChaosPass:
    """The prompts again on kvbm workers, with the schedule's faults; leaks checked at idle after each."""

    def __init__(self, sched: Schedule, workers: list, tally: Tally, reference: dict, args, cluster=None) -> None:
        self.sched, self.workers, self.tally, self.args, self.cluster = sched, workers, tally, args, cluster
        self.replay = Replay(sched, tally, reference, args.hang_seconds, args.concurrency)
        self.rng = random.Random(args.seed + 1)
        self.done: list = []  # (conv, turn) already asked: prompts for aborts and for serving without a master
        self.last_stats: dict = {}  # worker name -> its last idle /stats (this incarnation)

    def url_of(self, req: Request) -> str:
        return self.workers[1 if req.second and len(self.workers) > 1 else 0].url

    def run(self) -> None:
        for w, wave in enumerate(self.sched.waves):
            kinds = self.sched.faults.get(w, [])
            extra = [self._abort(k, wave) for k in kinds if k in INSIDE_WAVE]
            self.replay.wave(wave, self.url_of, extra)
            self.done += [(r.conv, r.turn) for r in wave]
            self._check_alive(f"after wave {w}")
            between = [k for k in kinds if k not in INSIDE_WAVE]
            for kind in between:
                try:
                    self._fault(kind, w)
                except Exception as exc:  # noqa: BLE001 - a fault that fails is a finding, not the end of the run
                    self.tally.errors.append(f"wave {w}: {kind} failed: {type(exc).__name__}: {str(exc)[:300]}")
                    self._check_alive(f"after a failed {kind} (wave {w})")
            if between:
                self._idle_checks(f"after wave {w} ({', '.join(between)})")
        self._idle_checks("at the end")
        for worker in self.workers:
            self._keep_books(worker)
        self.replay.pool.shutdown()

    # -- faults -----------------------------------------------------------------------------------

    def _count(self, kind: str, applied: bool, what: str, wave: int) -> None:
        with self.replay.lock:  # aborts count from the wave's threads
            slot = self.tally.faults.setdefault(kind, [0, 0])
            slot[0 if applied else 1] += 1
            self.tally.fault_log.append(f"wave {wave}: {kind}: {what or 'nothing to do'}")

    def _abort(self, kind: str, wave: list) -> Callable[[], None]:
        pool = [(r.conv, r.turn) for r in wave] + self.done[-50:]
        conv, turn = self.rng.choice(pool)
        worker = self.rng.choice(self.workers)
        after_first = kind == "abort_decode"

        def abort() -> None:
            try:
                faults.abort_stream(worker.url, self.sched.prompt(conv, turn), after_first=after_first)
                self._count(kind, True, f"{worker.name} conv {conv} turn {turn}", -1)
            except requests.RequestException as exc:
                with self.replay.lock:
                    self.tally.errors.append(f"{kind} on {worker.name}: {exc}")

        return abort

    def _fault(self, kind: str, wave: int) -> None:
        rng = self.rng
        worker = rng.choice(self.workers)
        # a disk slot: the block and its header row (/stats reads block_bytes.disk 0 while the disk tier is empty)
        slot_bytes = (self.last_stats.get(worker.name) or worker.stats())["block_bytes"]["host"] + faults.HEADER_BYTES
        what = ""
        if kind == "flush":
            ok, tries = faults.flush(worker, self.args.hang_seconds)
            what = f"{worker.name} after {tries} tries"
            if not ok:
                self.tally.hangs.append(f"wave {wave}: /flush_cache on {worker.name} refused for {self.args.hang_seconds} s")
        elif kind in ("disk_data_flip", "disk_header_flip"):
            what = faults.disk_flip(worker, rng, slot_bytes, header=kind == "disk_header_flip")
        elif kind == "disk_truncate":
            what = faults.disk_truncate(worker, rng)
        elif kind == "disk_delete_segment":
            what = faults.disk_delete(worker, rng)
        elif kind.startswith("kill9"):
            self._keep_books(worker)
            worker.kill9()
            if kind == "kill9_index_flip":
                what = faults.index_flip(worker, rng, "index.msgpack")
            elif kind == "kill9_journal_flip":
                what = faults.index_flip(worker, rng, "journal")
            else:
                what = "plain"
            self.tally.restarts.append(worker.start())
            what = f"{worker.name}: {what or 'no file to flip'}; healthy again in {self.tally.restarts[-1]:.1f} s"
        elif kind == "weight_update":
            what = f"{worker.name}: " + faults.weight_update(worker, rng)
        elif kind == "g4_object_damage":
            what = faults.g4_damage(self.cluster, rng, self.workers[0].logs / "g4-damage.log")
        elif kind == "master_restart":
            what = faults.master_restart(self.cluster, self._serve_without_master)
        self._count(kind, bool(what), what, wave)
        self._check_alive(f"after {kind} (wave {wave})")

    def _serve_without_master(self) -> None:
        reqs = [Request(-1, conv, turn, True, i % 2 == 1) for i, (conv, turn) in
                enumerate(self.rng.sample(self.done, min(4, len(self.done))))]
        self.replay.wave(reqs, self.url_of)

    # -- checks -----------------------------------------------------------------------------------

    def _check_alive(self, when: str) -> None:
        for worker in self.workers:
            if not worker.alive():
                self.tally.crashes.append(f"{worker.name} (incarnation {worker.incarnation}) died {when}; "
                                          f"log {worker.log_path}")
                worker.stop()
                self.tally.restarts.append(worker.start())

    def _idle_checks(self, when: str) -> None:
        for worker in self.workers:
            problem, stats = worker.idle_check(self.args.idle_seconds)
            self.tally.idle_checks += 1
            if stats:
                self.last_stats[worker.name] = stats
            if problem:
                self.tally.leaks.append(f"{worker.name} {when}: {problem}")

    def _keep_books(self, worker) -> None:
        """What this incarnation's tiers rejected and served (its counters end with it)."""
        try:
            stats = worker.stats()
        except requests.RequestException:
            stats = self.last_stats.get(worker.name, {})
        books = self.tally.lower
        for reason, n in ((stats.get("disk") or {}).get("invalidated") or {}).items():
            books[f"disk invalidated: {reason}"] = books.get(f"disk invalidated: {reason}", 0) + n
        connector = stats.get("connector") or {}
        for tier, n in (connector.get("onboard_blocks") or {}).items():  # per tier by name: host, disk, mooncake
            books[f"onboard {tier}"] = books.get(f"onboard {tier}", 0) + n
        books["failed_loads"] = books.get("failed_loads", 0) + connector.get("failed_loads", 0)
        shared = stats.get("mooncake") or {}
        for key in ("staged", "rejected", "misses", "down", "write_through", "rewritten"):
            if key in shared:
                books[f"mooncake {key}"] = books.get(f"mooncake {key}", 0) + shared[key]
        self.last_stats.pop(worker.name, None)
