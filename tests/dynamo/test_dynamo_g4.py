"""Inside Dynamo with G4: Dynamo's router scores a prefix held only in Mooncake as a shared hit, and it is served from G4.

A real ``mooncake_master`` with a standalone lender, this library's events relay
beside it (``sglang-kvbm mooncake-events``: the PyPI master publishes no KV
events), ``dynamo.frontend --router-mode kv --shared-cache-type hicache``, and
two ``dynamo.sglang`` workers running this library with a small host tier and
G4 on. Each worker registers its G4 objects' names with the router
(``sglang_hicache_mooncake``, as ``dynamo.sglang`` does for SGLang's HiCache).

A prefix is computed on worker A (written through to G4), then pushed off A's
device pool and host tier by pinned fillers: Mooncake is the only place that
holds it. Sent through the router, Dynamo's shared-cache lookup finds its pages
(``router_shared_cache_hit_rate``, computed by Dynamo from the request's tokens
and the relay's events), and whichever worker it picks serves it from G4 with
the cold run's greedy tokens. A prompt nobody computed scores 0.
"""

from __future__ import annotations

import re
import time

import msgspec
import pytest
import requests
import zmq

from conftest import CPU_PAGED_ALLOC_ENV, LOGPROB_TOLERANCE
from harness.dynamo import DynamoFrontend, DynamoWorker, dynamo_python
from harness.mooncake import MooncakeCluster
from sglang_kvbm.ops.demo.model import prompt_ids
from sglang_kvbm.tiers.mooncake.events import announced, list_keys

pytestmark = pytest.mark.server

MODEL = "gpt2-test"
PAGE = 4
POOL = 1024  # device KV pool per worker, tokens
PROMPT = 400
HOST_BLOCKS = 150  # 600 tokens: a prefix leaves the host tier after two fillers
CACHEABLE = (PROMPT - 1) // PAGE * PAGE  # SGLang matches at most len - 1 tokens, whole pages
PREFIX, FRESH = prompt_ids(8001, PROMPT), prompt_ids(8002, PROMPT)


def _histogram(text: str, name: str) -> tuple[float, float]:
    """(sum, count) of a Prometheus histogram, over every label set."""
    total = {"sum": 0.0, "count": 0.0}
    for line in text.splitlines():
        found = re.match(rf"^\w*{name}_(sum|count)(?:{{[^}}]*}})? ([0-9.eE+-]+)$", line)
        if found:
            total[found.group(1)] += float(found.group(2))
    return total["sum"], total["count"]


class Deployment:
    def __init__(self, model_dir, tmp, cluster):
        discovery = tmp / "discovery"
        discovery.mkdir()
        self.cluster = cluster
        env = {
            "DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": str(HOST_BLOCKS),
            "SGLANG_KVBM_MOONCAKE_MASTER": cluster.master_address,
            "SGLANG_KVBM_MOONCAKE_METADATA": cluster.metadata_url,
            "MC_TCP_BIND_ADDRESS": "127.0.0.1",
            "DYN_MOONCAKE_KV_EVENTS_ENDPOINT": cluster.events_endpoint,
        }
        self.frontend = DynamoFrontend(discovery, log_path=tmp / "frontend.log",
                                       extra_args=["--shared-cache-type", "hicache", "--shared-cache-multiplier", "1.0"])
        self.workers = [DynamoWorker(discovery, model_dir, served_model_name=MODEL, page_size=PAGE, max_total_tokens=POOL,
                                     kvbm_env=env, log_path=tmp / f"worker{i}.log", label=f"w{i}",
                                     env=CPU_PAGED_ALLOC_ENV) for i in (1, 2)]

    def start(self):
        for process in (self.frontend, *self.workers):
            process.start()
        for worker in self.workers:
            worker.wait_ready(timeout=600)
        self.frontend.wait_ready(MODEL, [w.instance_id for w in self.workers], timeout=600)
        for worker in self.workers:
            self.complete(prompt_ids(99, 8), 1, worker=worker)
        return self

    def stop(self):
        for process in (self.frontend, *self.workers):
            process.stop()

    def complete(self, prompt, max_tokens=8, worker=None):
        return self.frontend.complete(MODEL, prompt, max_tokens, worker=worker.instance_id if worker else None)

    def shared_hit_rate(self, prompt):
        """Send ``prompt`` through the router: (its completion, the shared-cache hit rate Dynamo's router computed)."""
        before = _histogram(requests.get(f"{self.frontend.url}/metrics", timeout=10).text, "router_shared_cache_hit_rate")
        done = self.complete(prompt)
        after = _histogram(requests.get(f"{self.frontend.url}/metrics", timeout=10).text, "router_shared_cache_hit_rate")
        assert after[1] == before[1] + 1, (before, after)  # one lookup: this request's
        return done, after[0] - before[0]


def announced_all(endpoint, keys: set[str], timeout=120.0):
    """Subscribe to the relay (late subscribers are told everything held) until it announced all of ``keys``."""
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    held: set[str] = set()
    try:
        deadline = time.monotonic() + timeout
        while not keys <= held:
            assert time.monotonic() < deadline, f"the relay announced {len(keys & held)} of {len(keys)} objects"
            if sub.poll(200):
                _topic, _sequence, payload = sub.recv_multipart()
                for event in msgspec.msgpack.decode(payload)[1]:
                    (held.add if event["event_type"] == "stored" else held.discard)(event["object_key"])
    finally:
        sub.close(0)
        context.term()


def g4(worker):
    return worker.stats()["mooncake"]


def wait(what, timeout=60.0, step=None):
    deadline = time.monotonic() + timeout
    while not (result := what()):
        assert time.monotonic() < deadline, "timed out"
        if step:
            step()
        time.sleep(0.2)
    return result


@pytest.fixture(scope="module")
def deployment(model_dir, tmp_path_factory):
    if not dynamo_python().exists():
        pytest.fail(f"{dynamo_python()} not found: `make test` builds .venv-dynamo (or set DYNAMO_PYTHON)")
    tmp = tmp_path_factory.mktemp("dynamo_g4")
    with MooncakeCluster(tmp) as cluster:
        cluster.start_relay()
        d = Deployment(model_dir, tmp, cluster)
        try:
            yield d.start()
        finally:
            d.stop()


def test_a_prefix_only_in_g4_is_a_shared_hit_for_the_router_and_served_from_g4(deployment):
    d = deployment
    a = d.workers[0]
    cold = d.complete(PREFIX, worker=a)
    assert cold.cached_tokens == 0
    pages = CACHEABLE // PAGE
    wait(lambda: g4(a)["write_through"] >= pages, step=lambda: d.complete(prompt_ids(77_000, 8), 1, worker=a))
    for i in range(6):  # pinned fillers: the prefix leaves A's device pool and host tier
        if a.tiers(PREFIX)["host"] == 0:
            break
        d.complete(prompt_ids(50_000 + i, PROMPT), 1, worker=a)
    only_g4 = {"device": 0, "host": 0, "disk": 0, "mooncake": PROMPT}  # POST /tiers: nowhere but Mooncake
    assert a.tiers(PREFIX) == only_g4 and d.workers[1].tiers(PREFIX) == only_g4, (a.tiers(PREFIX),
                                                                                  d.workers[1].tiers(PREFIX))
    # The relay polls the master every 0.2 s and publishes to the router; wait until a subscriber of our
    # own has been told of every object the master holds (each block with its V twin), then give the
    # router, subscribed since it started, a moment to apply them on its own thread.
    keys = {name for key in list_keys(f"http://127.0.0.1:{d.cluster.admin_port}") for name in announced(key)}
    announced_all(d.cluster.events_endpoint, keys)
    time.sleep(1.0)

    fresh, fresh_rate = d.shared_hit_rate(FRESH)
    assert fresh_rate == 0.0 and fresh.cached_tokens == 0

    staged = {w.instance_id: g4(w)["staged"] for w in d.workers}
    again, rate = d.shared_hit_rate(PREFIX)
    server = next(w for w in d.workers if w.instance_id == again.worker_id)
    print(f"G4-only prefix: router shared-cache hit rate {rate:.3f}, routed to "
          f"{'A' if server is a else 'B'}, cached_tokens {again.cached_tokens}, "
          f"G4 blocks staged +{g4(server)['staged'] - staged[server.instance_id]}")
    assert rate >= (CACHEABLE // PAGE) / (PROMPT // PAGE) - 1e-6, rate  # every page the store holds
    assert again.cached_tokens >= CACHEABLE, again.raw["usage"]
    assert g4(server)["staged"] - staged[server.instance_id] >= pages
    assert again.tokens == cold.tokens and all(
        abs(x - y) <= LOGPROB_TOLERANCE for x, y in zip(again.logprobs, cold.logprobs))
