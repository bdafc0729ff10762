"""Show, through Dynamo's frontend, a prefix pushed out of a worker's device pool coming back from its host tier.

Run by ``run.sh --check`` (standard library only, so any Python runs it):

1. a prompt goes through the frontend; Dynamo's KV router picks a worker (``nvext.worker_id``);
2. filler prompts pinned to that worker (``nvext.backend_instance_id``) push the prompt out of its
   device pool; the worker's ``/tiers`` shows it in host memory, and the router was told so by
   the worker's ``CPU_PINNED`` KV events;
3. the prompt again, unpinned: the router sends it to the same worker, which loads it from host
   memory (``cached_tokens`` and the worker's ``onboard_blocks_h2d``) and answers as the cold run did.

Exits 0 when all of that happened.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import time
import urllib.request


def call(url: str, body: dict | None = None, timeout: float = 600) -> dict:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data, {"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.load(response)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frontend", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="kvbm-demo")
    parser.add_argument("--workers", default="9091=6881,9092=6882",
                        help="per worker: DYN_SYSTEM_PORT=DYN_KVBM_METRICS_PORT, comma-separated")
    parser.add_argument("--tokens", type=int, default=400)
    args = parser.parse_args()

    kvbm_port = {}  # Dynamo instance id -> the worker's kvbm endpoint
    for pair in args.workers.split(","):
        system, kvbm = pair.split("=")
        text = urllib.request.urlopen(f"http://127.0.0.1:{system}/metrics", timeout=10).read().decode()
        kvbm_port[int(re.search(r'worker_id="([0-9a-f]+)"', text).group(1), 16)] = int(kvbm)

    def complete(prompt, max_tokens=8, worker=None):
        nvext = {"extra_fields": ["worker_id"]}
        if worker is not None:
            nvext["backend_instance_id"] = worker
        out = call(f"{args.frontend}/v1/completions", {"model": args.model, "prompt": prompt, "max_tokens": max_tokens,
                                                       "temperature": 0, "logprobs": 1, "nvext": nvext})
        return out["nvext"]["worker_id"]["decode_worker_id"], out

    def tiers(worker, prompt):
        return call(f"http://127.0.0.1:{kvbm_port[worker]}/tiers", {"token_ids": prompt})

    def onboarded(worker):
        return call(f"http://127.0.0.1:{kvbm_port[worker]}/stats")["connector"]["onboard_blocks_h2d"]

    rng = random.Random(0)
    prompt = [rng.randrange(100, 1000) for _ in range(args.tokens)]
    holder, cold = complete(prompt)
    print(f"1. cold: routed to worker {holder:x}, cached_tokens {cold['usage']['prompt_tokens_details']['cached_tokens']}")

    for n in range(12):
        time.sleep(0.5)  # the offload copies run off the scheduler's path
        where = tiers(holder, prompt)
        if where["device"] == 0 and where["host"] >= args.tokens - 4:
            break
        complete([rng.randrange(100, 1000) for _ in range(args.tokens)], 1, worker=holder)
    print(f"2. after {n} pinned fillers, worker {holder:x} holds the prompt: {where} (tokens, cumulative by tier)")

    before = onboarded(holder)
    started = time.perf_counter()
    worker, warm = complete(prompt)
    seconds = time.perf_counter() - started
    loaded = onboarded(holder) - before
    cached = warm["usage"]["prompt_tokens_details"]["cached_tokens"]
    same = warm["choices"][0]["text"] == cold["choices"][0]["text"]
    print(f"3. again: routed to worker {worker:x} ({'the holder' if worker == holder else 'NOT the holder'}), "
          f"cached_tokens {cached}, {loaded} blocks loaded from host memory, {seconds:.3f}s; "
          f"same text as the cold run: {same}")
    ok = worker == holder and cached > 0 and loaded > 0 and same
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
