"""A deployment across hosts, as ``docs/fleet.md`` lays it out: Dynamo's frontend and KV router, two
``dynamo.sglang`` workers with this library (host, disk and Mooncake G4), the Mooncake master with its
lender and this library's events relay, and the client, each on a host of its own (``harness.fleet``:
network namespaces on a bridge, each with its own address, hostname and an ``/etc/hosts`` that maps
the hostname to 127.0.1.1, as Debian's does). SGLang 0.5.21 and Dynamo 1.6.1, as Dynamo ships them.

Every process is given only what ``docs/fleet.md`` gives it (its host's address for what it binds and
Dynamo advertises; the master's address); nothing sets Mooncake's local hostname: the library must
find the address its peers reach it at. The scenarios run in order on one deployment:

1. routing across hosts: documents routed back to the worker whose host or disk tier holds them;
2. nothing advertised or reached through loopback across hosts;
3. a worker cut off (its link down) with requests in flight, then restored;
4. the master's host cut off: G4 marked down within seconds, requests never wait for it, writes counted;
5. G4 across hosts: a document one worker computed is served from G4 by the other, which keeps it in
   host (``SGLANG_KVBM_KEEP_READS``): once both devices evicted it, the router sends the return visit to
   the reader (its host copy outranks the first worker's disk copy) and it is a host hit.

Each asserts 0 wrong outputs (greedy tokens equal to the first pass) and 0 hung requests (every client
call has a bounded timeout), and prints its figures. Needs root (CI runs as root); skips otherwise.
"""

from __future__ import annotations

import os
import re
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import CPU_PAGED_ALLOC_ENV
from harness.dynamo import DynamoFrontend, DynamoWorker, dynamo_python
from harness.fleet import Fleet, skip_reason, wait_for
from harness.mooncake import MooncakeCluster
from sglang_kvbm.ops.demo.model import prompt_ids

pytestmark = [pytest.mark.server, pytest.mark.skipif(skip_reason() is not None, reason=str(skip_reason()))]

MODEL = "gpt2-test"
PAGE = 4
POOL = 1024  # device KV pool per worker, tokens (256 pages)
PROMPT = 400  # 100 pages
HOST_BLOCKS = 480  # a document and three fillers stay in host; a document and four do not
DISK_BLOCKS = 800  # nothing leaves disk in these scenarios
CACHEABLE = (PROMPT - 1) // PAGE * PAGE  # SGLang matches at most len - 1 tokens, whole pages
PAGES = CACHEABLE // PAGE
DOCS = [prompt_ids(9100 + i, PROMPT) for i in range(3)]
# A G4 hit counts this much of a device hit in the router; below its disk weight (0.25 by default) a worker's own
# disk or host copy outranks a read from G4 (docs/fleet.md, "The router and G4").
SHARED = os.environ.get("KVBM_FLEET_SHARED_MULTIPLIER", "0.2")  # another value: to measure it
TIMEOUT = 90.0  # every client call: a request past it is a hung one


def filler(n: int) -> list[int]:
    return prompt_ids(70_000 + n, PROMPT)


class Deployment:
    def __init__(self, fleet: Fleet, model_dir, tmp):
        self.fleet, self.tmp = fleet, tmp
        discovery = tmp / "discovery"
        discovery.mkdir()
        self.discovery = discovery
        self.cluster = MooncakeCluster(tmp, on_host=fleet["store"])
        self.frontend = DynamoFrontend(discovery, log_path=tmp / "frontend.log", on_host=fleet["router"],
                                       extra_args=["--shared-cache-type", "hicache", "--shared-cache-multiplier", SHARED])
        self.workers = []
        self.kvbm_env = []  # per worker: what it was given of this library's variables
        self.first: dict[tuple, list] = {}  # prompt -> greedy tokens of its first pass
        self._fillers = iter(range(10_000))
        self.model_dir = model_dir

    def start(self):
        with self.fleet.inside(self.fleet["client"]):
            self.cluster.start_master()
            self.cluster.start_lender()
            self.cluster.start_relay()
        for i in (1, 2):
            env = {
                "DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": str(HOST_BLOCKS),
                "DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS": str(DISK_BLOCKS),
                "DYN_KVBM_DISK_CACHE_DIR": str(self.tmp / f"disk{i}"),
                "DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER": "true",
                "SGLANG_KVBM_MOONCAKE_MASTER": self.cluster.master_address,
                "SGLANG_KVBM_MOONCAKE_METADATA": self.cluster.metadata_url,
                "DYN_MOONCAKE_KV_EVENTS_ENDPOINT": self.cluster.events_endpoint,
            }
            self.kvbm_env.append(env)
            (self.tmp / f"disk{i}").mkdir()
            self.workers.append(DynamoWorker(self.discovery, self.model_dir, served_model_name=MODEL, page_size=PAGE,
                                             max_total_tokens=POOL, kvbm_env=env, log_path=self.tmp / f"worker{i}.log",
                                             label=f"w{i}", on_host=self.fleet[f"w{i}"],
                                             # SGLang's own advertised address (its disaggregation bootstrap host,
                                             # which dynamo.sglang registers): else gethostbyname(hostname)
                                             env={**CPU_PAGED_ALLOC_ENV, "SGLANG_HOST_IP": self.fleet[f"w{i}"].address}))
        for process in (self.frontend, *self.workers):
            process.start()
        with self.fleet.inside(self.fleet["client"]):
            for worker in self.workers:
                worker.wait_ready(timeout=600)
            self.frontend.wait_ready(MODEL, [w.instance_id for w in self.workers], timeout=600)
        return self

    def stop(self):
        for process in (self.frontend, *self.workers):
            process.stop()
        self.cluster.stop()

    def complete(self, prompt, worker=None, max_tokens=8):
        """Through the frontend (the router's pick, or ``worker``): checked against the prompt's first pass."""
        done = self.frontend.complete(MODEL, prompt, max_tokens, worker=worker.instance_id if worker else None,
                                      timeout=TIMEOUT)
        first = self.first.setdefault((tuple(prompt), max_tokens), done.tokens)
        assert done.tokens == first, f"wrong output: {done.tokens} != {first}"
        return done

    def fill(self, worker, n):
        """``n`` unrelated prompts straight to ``worker``: its device pool (and host, and disk) move on."""
        for _ in range(n):
            self.complete(filler(next(self._fillers)), worker, max_tokens=1)

    def worker(self, instance_id) -> DynamoWorker:
        return next(w for w in self.workers if w.instance_id == instance_id)

    def other(self, worker) -> DynamoWorker:
        return next(w for w in self.workers if w is not worker)

    def settle(self):
        """Until every worker's copies drained (a request's KV goes down after it ends): its /stats says no copy is in
        flight three times running (published every 50 ms)."""
        for worker in self.workers:
            idle = [0]  # consecutive answers with nothing in flight

            def drained(worker=worker, idle=idle) -> bool:
                idle[0] = idle[0] + 1 if worker.stats()["in_flight"] == 0 else 0
                return idle[0] >= 3

            wait_for(drained, timeout=60, step=0.1, message=f"{worker.host}: copies still in flight")


def onboarded(worker) -> dict:
    """Blocks this worker's loads brought from each of its tiers, since it started."""
    onboard = worker.stats()["connector"]["onboard_blocks"]
    return {tier: onboard.get(tier, 0) for tier in ("host", "disk", "mooncake")}


def delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before[k] for k in after}


@pytest.fixture(scope="module")
def deployment(model_dir, tmp_path_factory):
    if not dynamo_python().exists():
        pytest.fail(f"{dynamo_python()} not found: `make test` builds .venv-dynamo (or set DYNAMO_PYTHON)")
    tmp = tmp_path_factory.mktemp("fleet")
    with Fleet(["router", "w1", "w2", "store", "client"]) as fleet:
        d = Deployment(fleet, model_dir, tmp)
        try:
            d.start()
            with fleet.inside(fleet["client"]):
                yield d
        finally:
            d.stop()


def test_documents_are_routed_back_to_the_host_whose_tiers_hold_them(deployment):
    d = deployment
    owners = [d.complete(doc).worker_id for doc in DOCS]
    for worker in d.workers:  # off every device, the oldest pages off host: the documents are in host and disk now
        d.fill(worker, 4)
    d.settle()
    before = {w.instance_id: onboarded(w) for w in d.workers}
    again = [d.complete(doc) for doc in DOCS]
    back = sum(a.worker_id == owner for a, owner in zip(again, owners))
    served = {"host": 0, "disk": 0, "mooncake": 0}
    for w in d.workers:
        for tier, n in delta(onboarded(w), before[w.instance_id]).items():
            served[tier] += n
    print(f"routing across hosts: {back}/{len(DOCS)} documents back to their worker; blocks served by tier "
          f"{served}; cached tokens {[a.cached_tokens for a in again]}")
    assert back == len(DOCS)
    assert all(a.cached_tokens >= CACHEABLE for a in again)
    assert served["host"] + served["disk"] >= len(DOCS) * PAGES and served["mooncake"] == 0


LOOPBACK = re.compile(r"\b127\.\d+\.\d+\.\d+\b|\blocalhost\b|\[::1\]")


def test_nothing_is_advertised_or_reached_through_loopback_across_hosts(deployment):
    d = deployment
    found = []
    for path in d.discovery.rglob("*"):  # what every Dynamo process registered for the others to reach it at
        text = path.read_text(errors="replace") if path.is_file() else ""
        found += [f"{path.relative_to(d.discovery)}: {m[0]}" for m in LOOPBACK.finditer(text)]
    advertised = {}
    for i, worker in enumerate(d.workers, 1):  # the address each worker's G4 client advertises, as doctor says
        g4_env = {k: v for k, v in d.kvbm_env[i - 1].items() if "DISK" not in k}  # not probing the worker's disk
        doctor = d.fleet[f"w{i}"].run([dynamo_python(), "-m", "sglang_kvbm.ops.cli", "doctor"], env=g4_env)
        row = re.search(r"G4 advertised address\s+(\w+)\s+peers reach this worker's G4 memory at (\S+) \((.*)\)",
                        doctor.stdout)
        advertised[worker.host] = row.groups() if row else doctor.stdout[-1500:]
    print(f"discovery entries naming loopback: {found}; G4 advertised (doctor): {advertised}")
    assert not found
    assert all(isinstance(row, tuple) and row[:2] == ("ok", host) for host, row in advertised.items()), advertised
    # A loopback address given by hand, facing the master on another host, is refused at start-up.
    refused = d.fleet["w1"].run([dynamo_python(), "-c", "from sglang_kvbm.config import KvbmConfig; KvbmConfig.from_env()"],
                                env={**d.kvbm_env[0], "MOONCAKE_LOCAL_HOSTNAME": "127.0.0.1"})
    assert refused.returncode != 0 and "MOONCAKE_LOCAL_HOSTNAME" in refused.stderr, refused.stderr[-2000:]
    # A master this host has no route to: doctor says so, naming both variables (the server starts without G4).
    lost = d.fleet["w1"].run([dynamo_python(), "-m", "sglang_kvbm.ops.cli", "doctor"],
                             env={"DYN_KVBM_CPU_CACHE_GB": "1", "SGLANG_KVBM_MOONCAKE_MASTER": "198.51.100.1:50051",
                                  "SGLANG_KVBM_MOONCAKE_METADATA": "P2PHANDSHAKE"})
    row = next((line for line in lost.stdout.splitlines() if line.startswith("G4 advertised address")), lost.stdout)
    assert "FAIL" in row and "no route" in row and "SGLANG_KVBM_MOONCAKE_MASTER" in row, row


def run_during(d, prompts, fault, restore, outage_s):
    """``prompts`` through the router, concurrently, while ``fault`` lasts ``outage_s``: (results, errors, hung)."""
    results, errors, hung = [], [], 0
    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(d.complete, p) for p in prompts]
        time.sleep(0.3)
        fault()
        time.sleep(outage_s)
        restore()
        for future in futures:
            try:
                results.append(future.result(timeout=TIMEOUT + 30))
            except AssertionError:
                raise
            except TimeoutError:
                hung += 1
            except Exception as exc:  # refused or failed: not a wrong output, counted
                if "timed out" in str(exc).lower():
                    hung += 1
                else:
                    errors.append(repr(exc)[:200])
    return results, errors, hung


def test_a_worker_cut_off_with_requests_in_flight(deployment):
    d = deployment
    w1 = d.fleet["w1"]
    prompts = [*DOCS, *(filler(90_000 + i) for i in range(3))]
    started = time.monotonic()
    results, errors, hung = run_during(d, prompts, w1.cut, w1.restore, 8.0)
    took = time.monotonic() - started
    print(f"worker cut off 8 s: {len(results)} answered right, {len(errors)} failed {errors}, {hung} hung, "
          f"{took:.1f} s in all")
    assert hung == 0
    for worker in d.workers:  # both serve again, right
        d.complete(DOCS[0], worker)


def test_the_masters_host_cut_off_is_noticed_in_seconds_and_costs_no_request_a_wait(deployment):
    d = deployment
    store = d.fleet["store"]
    for worker in d.workers:  # G4 up on both (a worker cut off before marked it down for a while)
        wait_for(lambda: worker.stats()["mooncake"]["up"], timeout=30, message="G4 not up")
    before = {w.instance_id: w.stats() for w in d.workers}
    store.cut()
    try:
        cut_at = time.monotonic()
        noticed = {}
        for worker in d.workers:
            wait_for(lambda: not worker.stats()["mooncake"]["up"], timeout=15, message="G4 never marked down")
            noticed[worker.host] = time.monotonic() - cut_at
        fresh = [prompt_ids(95_000 + i, PROMPT) for i in range(2)]
        timings = []
        for prompt in [*fresh, *DOCS]:
            started = time.monotonic()
            d.complete(prompt)
            timings.append(round(time.monotonic() - started, 2))
        during = {w.instance_id: w.stats() for w in d.workers}
    finally:
        store.restore()
    restored_at = time.monotonic()
    back = {}
    for worker in d.workers:
        wait_for(lambda: worker.stats()["mooncake"]["up"], timeout=30, message="G4 never came back up")
        back[worker.host] = time.monotonic() - restored_at
    waits = {}
    for w in d.workers:
        b, m = before[w.instance_id], during[w.instance_id]
        waits[w.host] = {k: m["local"][k] - b["local"][k] for k in ("remote_waits_expired", "load_waits_expired")}
        waits[w.host].update({k: m["mooncake"][k] - b["mooncake"][k] for k in ("write_retried", "write_queue_full",
                                                                               "write_gave_up")})
    print(f"master's host cut off: G4 marked down after {noticed} s, up again {back} s after the restore; "
          f"request times while down {timings} s; per worker {waits}")
    assert all(t <= 5.0 for t in noticed.values()), noticed
    assert all(w["remote_waits_expired"] == 0 and w["load_waits_expired"] == 0 for w in waits.values()), waits


def test_a_document_read_from_g4_is_kept_by_the_worker_that_read_it(deployment):
    d = deployment
    doc = prompt_ids(9200, PROMPT)
    a, = [w for w in d.workers if w.host == d.fleet["w1"].address]
    b = d.other(a)
    d.complete(doc, a)
    wait_for(lambda: a.stats()["mooncake"]["write_through"] >= PAGES, timeout=60, step=0.5,
             message="not written through to G4")
    d.fill(a, HOST_BLOCKS // (PROMPT // PAGE) + 1)  # off A's device and host: A holds it on disk only
    d.settle()
    assert a.tiers(doc)["host"] == 0 and a.tiers(doc)["disk"] >= CACHEABLE, a.tiers(doc)
    assert b.tiers(doc) == {"device": 0, "host": 0, "disk": 0, "mooncake": PROMPT}, b.tiers(doc)
    # B serves it (sent there, as when A is busy): from G4, the other host's write.
    before = onboarded(b)
    read = d.complete(doc, b)
    from_g4 = delta(onboarded(b), before)["mooncake"]
    assert read.cached_tokens >= CACHEABLE and from_g4 >= PAGES, (read.cached_tokens, from_g4)
    d.settle()
    d.fill(b, 3)  # off B's device; B's host keeps what it read
    d.settle()
    kept = b.tiers(doc)
    before = {w.instance_id: onboarded(w) for w in d.workers}
    back = d.complete(doc)  # the router's pick: B's host copy (0.75 of a device hit) over A's disk copy (0.25)
    server = d.worker(back.worker_id)
    served = delta(onboarded(server), before[server.instance_id])
    print(f"G4 across hosts: {b.host} read {from_g4} blocks of {a.host}'s document from G4; after its device "
          f"evicted it, its tiers {kept}; the return visit routed to {server.host}, served {served}")
    assert kept["device"] == 0 and kept["host"] >= CACHEABLE, kept
    assert server is b, f"routed to {server.host}, not to the reader {b.host}"
    assert served["host"] >= PAGES and served["mooncake"] == 0, served
    assert back.cached_tokens >= CACHEABLE
