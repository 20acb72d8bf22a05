#!/usr/bin/env bash
# A 3-target rolling deployment (maxParallel 1, so 3 waves): its wall time against the sum of
# its tasks' execution times, side by side in each run, N runs alternating between two releases
# so every run changes every target.
#
#   scripts/bench-rollout.sh                # N=6
#   N=3 SKIP_BUILD=1 scripts/bench-rollout.sh
#
# Three `berth-agent`s on this host's Docker engine, one `berth server` (SQLite), two images
# (FROM scratch + busybox httpd via `docker import`) pushed to the local registry of
# scripts/registry.sh and deployed by digest with an http health check (interval 1 s).
#
#   wall      deployment createdAt -> finishedAt (server clock)
#   tasks     the sum over its tasks of assignedAt -> finishedAt: the agent's own work (pull,
#             create, start, health) plus signing and submitting the result
#   overhead  (wall - tasks) / waves: what berth adds per wave (the deployment pass noticing the
#             result, creating the next wave's task, and the agent's long-poll picking it up)
#
# Everything it creates is named berth-e2e-bench-<random> and removed on exit.
set -euo pipefail

source "$(dirname "$0")/bench-lib.sh"

N=${N:-6}
OUT=${OUT:-"$BENCH_ROOT/target/bench-results/rollout-$(date -u +%Y%m%dT%H%M%SZ)"}

eval "$(bash "$BENCH_ROOT/scripts/registry.sh" | grep '^export ')"
REGISTRY=${BERTH_TEST_REGISTRY:?scripts/registry.sh did not export BERTH_TEST_REGISTRY}

PREFIX="berth-e2e-bench-$(od -An -N4 -tx1 /dev/urandom | tr -d ' \n')"
REPO="$REGISTRY/$PREFIX/web"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/berth-e2e-bench.XXXXXX")
AGENT_PIDS=()

cleanup() {
    for pid in "${AGENT_PIDS[@]}"; do stop_pid "$pid"; done
    stop_server
    remove_docker_objects "$PREFIX"
    rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

BENCH_BINS="berth berth-agent" bench_build berth-cli
mkdir -p "$OUT"

# --- two images: the same server, different pages -------------------------------------------
make_image() {
    local tag=$1
    rm -rf "$WORK/rootfs" && mkdir -p "$WORK/rootfs/bin" "$WORK/rootfs/www"
    cp /bin/busybox "$WORK/rootfs/bin/busybox"
    echo "$tag" >"$WORK/rootfs/www/index.html"
    tar -C "$WORK/rootfs" -cf "$WORK/rootfs.tar" .
    docker import \
        --change 'ENTRYPOINT ["/bin/busybox", "sh", "-c", "trap '"'"'exit 0'"'"' TERM; /bin/busybox httpd -f -p 8080 -h /www & wait"]' \
        "$WORK/rootfs.tar" "$REPO:$tag" >/dev/null
    DOCKER_CONFIG="$WORK/docker-config" docker push -q "$REPO:$tag" >/dev/null
    docker inspect --format '{{index .RepoDigests 0}}' "$REPO:$tag"
    docker rmi "$REPO:$tag" >/dev/null
}
REF_A=$(make_image a)
REF_B=$(make_image b)

# --- server, three agents, two releases, one environment -------------------------------------
start_server "$WORK/data" "$WORK/server.log"
export BERTH_SERVER="$SERVER_URL" BERTH_CA_FILE="$WORK/data/ca.crt"
BERTH_TOKEN=$(cat "$WORK/data/admin.token")
export BERTH_TOKEN

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

for name in t1 t2 t3; do
    TOKEN_JSON=$("$BIN/berth" token create -o json)
    "$BIN/berth-agent" --state-dir "$WORK/$name" --register \
        --token "$(jq -r .token <<<"$TOKEN_JSON")" --server "$SERVER_URL" \
        --ca-fingerprint "$(jq -r .caFingerprint <<<"$TOKEN_JSON")" \
        --name "$name" --sticker-dir "$WORK/$name-stickers" 2>"$WORK/$name.log" &
    AGENT_PIDS+=($!)
    deadline=$((SECONDS + 60))
    until [ -s "$WORK/$name/identity.json" ] &&
        "$BIN/berth" agents show "$(jq -r .agentId "$WORK/$name/identity.json")" -o json 2>/dev/null |
        jq -e '.status == "online" and any(.capabilities[]; .name == "docker")' >/dev/null; do
        [ "$SECONDS" -lt "$deadline" ] || { echo "agent $name did not come online" >&2; cat "$WORK/$name.log" >&2; exit 1; }
        sleep 0.2
    done
    port=$(free_port)
    "$BIN/berth" agents label "$(jq -r .agentId "$WORK/$name/identity.json")" \
        env=bench "port=$port" -o json >/dev/null
done

CONFIG=$(jq -cn --arg name "$PREFIX-{{target.name}}" '{
    containerName: $name, restartPolicy: "no",
    ports: ["127.0.0.1:{{target.labels.port}}:8080/tcp"],
    healthCheck: {type: "http", url: "http://127.0.0.1:{{target.labels.port}}/", interval: 1}}')
"$BIN/berth" release create a --image "web=$REF_A" --config "web=$CONFIG" -o json >/dev/null
"$BIN/berth" release create b --image "web=$REF_B" --config "web=$CONFIG" -o json >/dev/null
"$BIN/berth" env create bench --tier dev --selector env=bench --max-parallel 1 \
    --health-timeout 60 --drift-interval 1h -o json >/dev/null

: >"$OUT/runs.txt"
LOAD_BEFORE=$(cut -d' ' -f1-3 /proc/loadavg)
for i in $(seq 1 "$N"); do
    release=$([ $((i % 2)) -eq 1 ] && echo a || echo b)
    out=$("$BIN/berth" deploy "$release" --env bench -o json)
    id=$(jq -r .id <<<"$out")
    "$BIN/berth" deployment wait "$id" -o json >"$OUT/wait-$i.jsonl"
    d=$("$BIN/berth" deployment show "$id" -o json)
    echo "$d" >"$OUT/deployment-$i.json"
    [ "$(jq -r .state <<<"$d")" = succeeded ] || { echo "run $i: $d" >&2; exit 1; }
    for task in $(jq -r '.targets[].tasks[]' <<<"$d"); do
        "$BIN/berth" task show "$task" -o json >"$OUT/task-$i-$task.json"
    done
    echo "$i $OUT/deployment-$i.json" >>"$OUT/runs.txt"
done
LOAD_AFTER=$(cut -d' ' -f1-3 /proc/loadavg)

{
    echo "command: N=$N scripts/bench-rollout.sh"
    bench_machine
    echo "load:    before $LOAD_BEFORE, after $LOAD_AFTER"
    echo "docker:  $(docker version --format '{{.Server.Version}}')"
    python3 - "$OUT" <<'EOF'
import glob, json, os, statistics, sys
from datetime import datetime

def ts(s):
    s = s.replace("Z", "+00:00")
    if "." in s:
        head, rest = s.split(".", 1)
        frac, tz = rest[:rest.index("+")], rest[rest.index("+"):]
        s = f"{head}.{frac[:6].ljust(6, '0')}{tz}"
    return datetime.fromisoformat(s)

def ms(a, b):
    return (ts(b) - ts(a)).total_seconds() * 1000

out = sys.argv[1]
walls, sums, overheads = [], [], []
for line in open(os.path.join(out, "runs.txt")):
    i, path = line.split()
    d = json.load(open(path))
    wall = ms(d["createdAt"], d["finishedAt"])
    total = 0.0
    for t in d["targets"]:
        for task in t["tasks"]:
            doc = json.load(open(os.path.join(out, f"task-{i}-{task}.json")))
            a = doc["attempts"][-1]
            total += ms(a["assignedAt"], a["finishedAt"])
    waves = len({t["wave"] for t in d["targets"]})
    walls.append(wall); sums.append(total); overheads.append((wall - total) / waves)
    print(f"run {i}: wall {wall:7.0f} ms, tasks {total:7.0f} ms, overhead/wave {(wall - total) / waves:6.1f} ms")
med = statistics.median
print(f"runs:    {len(walls)}, 3 targets, maxParallel 1 (3 waves)")
print(f"median:  wall {med(walls):.0f} ms, sum of task execution {med(sums):.0f} ms "
      f"(ratio {med(walls) / med(sums):.3f}), berth's overhead per wave {med(overheads):.1f} ms "
      f"(target < 100 ms: {'PASS' if med(overheads) < 100 else 'FAIL'})")
EOF
} | tee "$OUT/summary.txt"
