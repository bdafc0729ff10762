#!/usr/bin/env bash
# Dynamo on one machine, no etcd or NATS: a frontend with Dynamo's KV router and two
# `python -m dynamo.sglang` workers running sglang-kvbm (host and disk tiers, KV events).
# See README.md beside this file for what each setting is for.
#
#   examples/dynamo/run.sh            # start, print how to use it, run until Ctrl-C
#   examples/dynamo/run.sh --check    # start, show a prefix routed back from host memory, stop
#
# Environment (all optional):
#   DYNAMO_PYTHON  Dynamo's interpreter (default: .venv-dynamo/bin/python, which `make test` builds)
#   MODEL          a model directory (default: a random-weight GPT-2 generated into $WORK/model)
#   WORK           where discovery, logs, disk tiers and the generated model go (default: a new temp dir)
#   HTTP_PORT      the frontend's port (default 8000)
#   DEVICE         cpu (default: the CPU flags below) or cuda (SGLang's defaults, for a GPU machine)
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
PY=${DYNAMO_PYTHON:-$ROOT/.venv-dynamo/bin/python}
WORK=${WORK:-$(mktemp -d /tmp/kvbm-dynamo-XXXXXX)}
HTTP_PORT=${HTTP_PORT:-8000}
DEVICE=${DEVICE:-cpu}
NAME=kvbm-demo
PAGE=4  # SGLang's --page-size; Dynamo's router takes its block size from it

[ -x "$PY" ] || { echo "no Dynamo environment at $PY: run 'make test' (or set DYNAMO_PYTHON)" >&2; exit 1; }
mkdir -p "$WORK"
if [ -z "${MODEL:-}" ]; then
    MODEL=$WORK/model
    "$PY" -c "from sglang_kvbm.ops.demo.model import make_model; make_model('$MODEL')"
fi

# Shared by every process of the deployment: discovery is a directory (no etcd), requests go
# over TCP and events over ZMQ (no NATS), all on loopback.
export DYN_DISCOVERY_BACKEND=file DYN_FILE_KV=$WORK/discovery DYN_REQUEST_PLANE=tcp DYN_EVENT_PLANE=zmq
export DYN_TCP_RPC_HOST=127.0.0.1 DYN_EVENT_PLANE_HOST=127.0.0.1 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1

ENGINE=()
WORKER_ENV=()
if [ "$DEVICE" = cpu ]; then
    ENGINE=(--device cpu --attention-backend torch_native --mem-fraction-static 0.3 --disable-cuda-graph
            --dtype float32 --max-total-tokens 1024)  # a small device pool: prefixes leave it soon
    # SGLang 0.5.21 (what Dynamo 1.6.1 pins) allocates pages (--page-size > 1) with Triton kernels only, which
    # cannot run on a CPU ("0 active drivers" at the first request). The tests' CPU stand-in for those two
    # kernels (tests/servers/cpu_paged_alloc, never shipped) runs in the workers instead; it patches nothing on
    # an SGLang that has a CPU path (0.5.22 on), and DEVICE=cuda never loads it.
    WORKER_ENV=(PYTHONPATH="$ROOT/tests/servers/cpu_paged_alloc${PYTHONPATH:+:$PYTHONPATH}" KVBM_TEST_CPU_PAGED_ALLOC=1)
fi

PGIDS=()
start() {  # name, command...: its own process group (setsid), output in $WORK/name.log
    local name=$1; shift
    setsid "$@" > "$WORK/$name.log" 2>&1 < /dev/null &
    PGIDS+=($!)
    echo "started $name (process group $!), log $WORK/$name.log"
}
SLEEPER=
stop() {
    trap - EXIT INT TERM
    [ -n "$SLEEPER" ] && kill "$SLEEPER" 2>/dev/null || true
    for g in "${PGIDS[@]}"; do kill -TERM "$g" 2>/dev/null || true; done  # the leaders: Dynamo shuts SGLang down
    for _ in $(seq 40); do  # Dynamo's workers unregister, then wait out a grace period (5 s)
        alive=0
        for g in "${PGIDS[@]}"; do  # its session (setsid); zombies do not count
            ps -o stat= -s "$g" 2>/dev/null | grep -qv '^Z' && alive=1
        done
        [ $alive = 0 ] && break
        sleep 0.5
    done
    for g in "${PGIDS[@]}"; do kill -KILL -- "-$g" 2>/dev/null || true; done
    wait "${PGIDS[@]}" 2>/dev/null || true
    echo "stopped; logs in $WORK"
}
trap stop EXIT INT TERM

start frontend "$PY" -m dynamo.frontend --router-mode kv --http-host 127.0.0.1 --http-port "$HTTP_PORT"

worker() {  # index, SGLang port, events port, kvbm metrics port, Dynamo status port
    # The events endpoint must bind the wildcard host (tcp://*:P): see README.md.
    DYN_KVBM_CPU_CACHE_GB=1 DYN_KVBM_DISK_CACHE_GB=2 DYN_KVBM_DISK_CACHE_DIR="$WORK/disk$1" \
    DYN_KVBM_METRICS=true DYN_KVBM_METRICS_PORT=$4 SGLANG_KVBM_ROUTER_BLOCK_SIZE=$PAGE DYN_SYSTEM_PORT=$5 \
    start "worker$1" env "${WORKER_ENV[@]}" "$PY" -m dynamo.sglang --model-path "$MODEL" --served-model-name "$NAME" \
        "${ENGINE[@]}" --page-size "$PAGE" --host 127.0.0.1 --port "$2" \
        --radix-cache-backend kvbm \
        --kv-events-config "{\"publisher\":\"zmq\",\"topic\":\"kv-events\",\"endpoint\":\"tcp://*:$3\"}"
}
worker 1 30001 5557 6881 9091
worker 2 30011 5558 6882 9092

echo "waiting for the workers and the frontend (about a minute on 2 CPU cores) ..."
ready() { "$PY" - "$HTTP_PORT" <<'EOF'
import json, sys, urllib.request
def get(url):
    return json.load(urllib.request.urlopen(url, timeout=5))
try:
    workers = [get(f"http://127.0.0.1:{p}/health").get("status") == "ready" for p in (9091, 9092)]
    health = get(f"http://127.0.0.1:{sys.argv[1]}/health")
    found = {i["instance_id"] for i in health.get("instances", []) if i.get("endpoint") == "generate"}
    sys.exit(0 if all(workers) and len(found) == 2 else 1)
except Exception:
    sys.exit(1)
EOF
}
for _ in $(seq 300); do
    ready && break
    for g in "${PGIDS[@]}"; do kill -0 -- "-$g" 2>/dev/null || { echo "a process exited; see $WORK/*.log" >&2; exit 1; }; done
    sleep 1
done
ready || { echo "not ready after 300 s; see $WORK/*.log" >&2; exit 1; }

echo
echo "ready: http://127.0.0.1:$HTTP_PORT/v1/completions (model $NAME); each worker's tiers:"
echo "  curl -s 127.0.0.1:6881/tiers -d '{\"token_ids\": [1,2,3,4,5,6,7,8]}'   # worker 1 (6882: worker 2)"
echo "  curl -s 127.0.0.1:$HTTP_PORT/v1/completions -H 'content-type: application/json' \\"
echo "    -d '{\"model\": \"$NAME\", \"prompt\": [11,12,13,14,15,16,17,18,19], \"max_tokens\": 4, \"nvext\": {\"extra_fields\": [\"worker_id\"]}}'"

if [ "${1:-}" = --check ]; then
    "$PY" "$HERE/check.py" --frontend "http://127.0.0.1:$HTTP_PORT" --model "$NAME" --workers 9091=6881,9092=6882
    exit $?
fi
echo "Ctrl-C stops everything."
sleep infinity &  # in the background, so that a signal runs the trap at once
SLEEPER=$!
wait $SLEEPER
