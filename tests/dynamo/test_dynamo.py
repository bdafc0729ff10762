"""Inside Dynamo: Dynamo's own frontend and KV router over two ``python -m dynamo.sglang`` workers running this library.

One deployment for the module, as ``examples/dynamo/`` runs it (file discovery, TCP request
plane, ZMQ event plane, all on 127.0.0.1), every process from Dynamo's environment
(``.venv-dynamo``; the tests themselves run from ``.venv``): ``dynamo.frontend --router-mode kv``
and two workers with the generated GPT-2, a 1024-token device pool each, a host tier and a
disk tier. Requests go through the frontend's OpenAI API (``/v1/completions`` with token-id
prompts); ``nvext.worker_id`` says which worker the router picked, ``nvext.backend_instance_id``
pins the filler requests that push a prefix down the tiers of one worker.

* a prefix pushed off a worker's device pool but held in its host tier is routed back to that
  worker by Dynamo's router and served from host memory (the worker's onboard counter and
  ``usage.prompt_tokens_details.cached_tokens``), with the cold run's greedy tokens and logprobs,
  although the other worker holds the prefix's first pages on its device (a decoy that a router
  blind to lower tiers follows: checked with a second router whose host and disk weights are 0);
* the same from the disk tier, once the host tier has let the prefix go;
* the router's per-tier view of each worker (a second ``KvRouter`` on the same event stream,
  ``sglang_kvbm.integration.dynamo.router_view``) equals each worker's own ``/tiers`` answer.
"""

from __future__ import annotations

import time

import pytest

from conftest import CPU_PAGED_ALLOC_ENV, LOGPROB_TOLERANCE
from harness.dynamo import DynamoFrontend, DynamoWorker, dynamo_python
from harness.router_view import RouterView
from sglang_kvbm.ops.demo.model import prompt_ids

pytestmark = pytest.mark.server

MODEL = "gpt2-test"
PAGE = 4
POOL = 1024  # device KV pool per worker, tokens
PROMPT = 400  # tokens per prompt: two fill 80% of a device pool
HOST_BLOCKS = 600  # 2400 tokens: holds a prefix through four fillers, lets it go after seven
TIER_ENV = {
    "DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": str(HOST_BLOCKS),
    "DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS": "4096",
    # Every host block goes to disk at once: the prefix pushed out of the host tier is on disk
    # without first having to be reused (KVBM's frequency filter would want a second use).
    "DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER": "true",
}
HOST_PREFIX, DISK_PREFIX = prompt_ids(7001, PROMPT), prompt_ids(7002, PROMPT)
CACHEABLE = (PROMPT - 1) // PAGE * PAGE  # SGLang matches at most len - 1 tokens, whole pages
# Tokens of the prefix the other worker holds on its device: 10 blocks, against the holder's 100 in
# host memory (credited 0.75 each by the router's default host_cache_hit_weight) or on disk (0.25).
DECOY = 40


class Deployment:
    def __init__(self, model_dir, tmp):
        discovery = tmp / "discovery"
        discovery.mkdir()
        self.frontend = DynamoFrontend(discovery, log_path=tmp / "frontend.log")
        self.workers = [
            DynamoWorker(discovery, model_dir, served_model_name=MODEL, page_size=PAGE, max_total_tokens=POOL,
                         kvbm_env={**TIER_ENV, "DYN_KVBM_DISK_CACHE_DIR": str(tmp / f"disk{i}")},
                         log_path=tmp / f"worker{i}.log", label=f"w{i}", env=CPU_PAGED_ALLOC_ENV)
            for i in (1, 2)
        ]
        self.view = RouterView(discovery, PAGE, log_path=tmp / "router_view.log")
        self.fillers = 0

    def start(self):
        started = time.monotonic()
        for process in (self.frontend, *self.workers):  # in parallel: each takes ~30 s on 2 cores
            process.start()
        for worker in self.workers:
            worker.wait_ready(timeout=600)
        self.frontend.wait_ready(MODEL, [w.instance_id for w in self.workers], timeout=600)
        self.view.start()
        for worker in self.workers:  # the first request of a worker pays one-off costs (JIT)
            self.complete(prompt_ids(99, 8), 1, worker=worker)
        self.started_in = time.monotonic() - started
        return self

    def stop(self):
        self.view.stop()
        for process in (self.frontend, *self.workers):
            process.stop()

    def complete(self, prompt, max_tokens=8, worker=None):
        return self.frontend.complete(MODEL, prompt, max_tokens,
                                      worker=worker.instance_id if worker is not None else None)

    def worker(self, instance_id) -> DynamoWorker:
        return next(w for w in self.workers if w.instance_id == instance_id)

    def other(self, worker) -> DynamoWorker:
        return next(w for w in self.workers if w is not worker)

    def settle(self):
        """Every worker stepped and no copy in flight: each tier change is in the event stream."""
        quiet = 0
        for _ in range(100):
            for w in self.workers:
                self.complete(prompt_ids(77_000, 8), 1, worker=w)  # one step: completions drained, events out
            quiet = quiet + 1 if all(w.stats()["in_flight"] == 0 for w in self.workers) else 0
            if quiet >= 2:
                return
        raise AssertionError("copies still in flight")

    def push_down(self, worker, prefix, until, limit=12):
        """Pinned filler prompts to ``worker`` until its tiers for ``prefix`` satisfy ``until``."""
        for _ in range(limit):
            self.settle()
            tiers = worker.tiers(prefix)
            if until(tiers):
                return tiers
            self.fillers += 1
            self.complete(prompt_ids(50_000 + self.fillers, PROMPT), 1, worker=worker)
        raise AssertionError(f"{prefix[:3]}...: tiers {worker.tiers(prefix)} after {limit} fillers")

    def router_sees(self, prefix, want: dict, timeout=120.0) -> dict:
        """The router view's tiers for ``prefix``, once they equal ``want`` ({instance id: tiers}) or time is up."""
        deadline = time.monotonic() + timeout
        while True:
            seen = self.view.tiers(prefix)
            seen = {w.instance_id: seen.get(w.instance_id, {"device": 0, "host": 0, "disk": 0}) for w in self.workers}
            if seen == want or time.monotonic() > deadline:
                return seen
            time.sleep(0.25)  # the router applies events on its own threads: nothing to wait on but time


@pytest.fixture(scope="module")
def deployment(model_dir, tmp_path_factory):
    if not dynamo_python().exists():
        pytest.fail(f"{dynamo_python()} not found: `make test` builds .venv-dynamo (or set DYNAMO_PYTHON)")
    d = Deployment(model_dir, tmp_path_factory.mktemp("dynamo"))
    try:
        d.start()
        print(f"\ndynamo deployment (frontend, 2 workers, router view) up in {d.started_in:.1f}s")
        yield d
    finally:
        d.stop()


def same_tokens(ours, cold):
    return ours.tokens == cold.tokens and len(ours.logprobs) == len(cold.logprobs) and all(
        abs(a - b) <= LOGPROB_TOLERANCE for a, b in zip(ours.logprobs, cold.logprobs))


def published(worker, counter):
    """A counter as of now: ``/stats`` is a snapshot the worker's scheduler publishes between steps,
    so wait for one taken after this call."""
    asked, deadline = time.time(), time.monotonic() + 120
    while (stats := worker.stats())["published_at"] <= asked:
        assert time.monotonic() < deadline, f"{worker.name} published no /stats snapshot in 120 s"
        time.sleep(0.01)
    return stats["connector"][counter]


def _routed_back(d, prefix, *, tier: str, until, counter: str):
    cold = d.complete(prefix)
    assert cold.cached_tokens == 0, cold.raw
    holder = d.worker(cold.worker_id)
    other = d.other(holder)
    pushed = d.push_down(holder, prefix, until)
    # The decoy: the other worker gets the prefix's first DECOY tokens on its device. A router that
    # saw device pools only would now pick the other worker (some device overlap against none).
    d.complete(prefix[:DECOY] + prompt_ids(60_000 + len(prefix), 60), 1, worker=other)
    d.settle()
    decoy = {"device": DECOY, "host": DECOY, "disk": DECOY}
    assert other.tiers(prefix) == decoy, other.tiers(prefix)
    assert holder.tiers(prefix) == pushed, holder.tiers(prefix)
    seen = d.router_sees(prefix, {holder.instance_id: pushed, other.instance_id: decoy})
    assert seen == {holder.instance_id: pushed, other.instance_id: decoy}, seen  # the router knows, per tier
    # The decoy decides for a router blind to lower tiers; Dynamo's default weights pick the holder.
    assert d.view.best_worker(prefix, device_only=True) == other.instance_id
    assert d.view.best_worker(prefix) == holder.instance_id

    before = published(holder, counter)
    again = d.complete(prefix)
    loaded = published(holder, counter) - before
    print(f"{tier} hit: holder {pushed}, other worker {decoy}, router agrees; routed to "
          f"{'the holder' if again.worker_id == holder.instance_id else 'the OTHER worker'}, cached_tokens "
          f"{again.cached_tokens}, {counter} +{loaded}; cold TTFT {cold.ttft_s:.3f}s, hit {again.ttft_s:.3f}s")
    assert again.worker_id == holder.instance_id, "the router sent the prefix elsewhere"
    assert again.cached_tokens >= CACHEABLE, again.raw["usage"]
    assert loaded * PAGE >= CACHEABLE, f"{counter} +{loaded}"
    assert same_tokens(again, cold), (again.tokens, again.logprobs, cold.tokens, cold.logprobs)


def test_host_tier_prefix_is_routed_back(deployment):
    """Off the device pool, in host memory: the router picks that worker and the prefix is onboarded."""
    _routed_back(deployment, HOST_PREFIX, tier="host", counter="onboard_blocks_h2d",
                 until=lambda t: t["device"] == 0 and t["host"] == PROMPT)


def test_disk_tier_prefix_is_routed_back(deployment):
    """Off the device pool and the host tier, on disk: routed back and onboarded from disk."""
    _routed_back(deployment, DISK_PREFIX, tier="disk", counter="onboard_blocks_d2d",
                 until=lambda t: t["host"] == 0 and t["disk"] == PROMPT)


def test_router_view_matches_every_worker(deployment):
    """What Dynamo's router holds per worker and tier equals what each worker says it holds."""
    d = deployment
    for seed in range(4):  # a few more prompts wherever the router puts them: device pools overflow
        d.complete(prompt_ids(8000 + seed, PROMPT) + [1, 2, 3])
    d.settle()
    probes = [HOST_PREFIX, DISK_PREFIX, HOST_PREFIX[:200], DISK_PREFIX[: PROMPT // 2 + 2]]
    probes += [prompt_ids(8000 + seed, PROMPT) for seed in range(4)]
    probes += [prompt_ids(50_000 + n, PROMPT) for n in range(1, d.fillers + 1)]
    probes += [prompt_ids(123_456, 100)]  # nowhere
    deadline = time.monotonic() + 120
    while True:
        mismatches, tiers_seen = [], set()
        for prompt in probes:
            seen = d.view.tiers(prompt)
            for w in d.workers:
                truth = w.tiers(prompt)
                got = seen.get(w.instance_id, {"device": 0, "host": 0, "disk": 0})
                if got != truth:
                    mismatches.append((w.name, len(prompt), truth, got))
                tiers_seen |= {tier for tier, low in (("host", "device"), ("disk", "host")) if truth[tier] > truth[low]}
        if not mismatches or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    print(f"router view vs workers: {len(probes)} probes x 2 workers, {len(mismatches)} mismatches; "
          f"tiers beyond the device seen: {sorted(tiers_seen)}")
    assert not mismatches, mismatches[:5]
    assert "host" in tiers_seen, "no probe held beyond a device pool: the comparison exercised nothing"
