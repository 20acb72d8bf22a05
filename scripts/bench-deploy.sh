#!/usr/bin/env bash
# Deploy overhead of `docker.run`: a release `berth server` + `berth-agent` on this host against
# the same steps by hand with the docker CLI, side by side in one run, alternating, N each.
#
#   scripts/bench-deploy.sh                 # N=10
#   N=3 SKIP_BUILD=1 scripts/bench-deploy.sh
#
# One image (FROM scratch + busybox httpd, made with `docker import` like the tests' fixtures) is
# pushed to the local registry of scripts/registry.sh and deployed by digest. Before every run
# both containers are removed and the image is removed locally, so both sides pull.
#
#   berth   `berth task create --type docker.run … --wait`, http health check (interval 1 s, the
#           smallest berth accepts). Measured: the agent's phase metrics
#           (pull + deploy + healthCheck = assignment received → healthy), the server's
#           assignedAt → finishedAt (adds signing and submitting the result), and
#           createdAt → finishedAt (adds the hand-over to the agent's long-poll).
#   by hand `docker pull repo@digest`, `docker run -d …`, then `curl` every 100 ms until the
#           page answers.
#
# Everything it creates is named berth-e2e-bench-<random> and removed on exit.
set -euo pipefail

source "$(dirname "$0")/bench-lib.sh"

N=${N:-10}
OUT=${OUT:-"$BENCH_ROOT/target/bench-results/deploy-$(date -u +%Y%m%dT%H%M%SZ)"}

eval "$(bash "$BENCH_ROOT/scripts/registry.sh" | grep '^export ')"
REGISTRY=${BERTH_TEST_REGISTRY:?scripts/registry.sh did not export BERTH_TEST_REGISTRY}

PREFIX="berth-e2e-bench-$(od -An -N4 -tx1 /dev/urandom | tr -d ' \n')"
REPO="$REGISTRY/$PREFIX/web"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/berth-e2e-bench.XXXXXX")
AGENT_PID=""

cleanup() {
    stop_pid "$AGENT_PID"
    stop_server
    remove_docker_objects "$PREFIX"
    rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

BENCH_BINS="berth berth-agent" bench_build berth-cli
mkdir -p "$OUT"

# --- the image -------------------------------------------------------------------------------
mkdir -p "$WORK/rootfs/bin" "$WORK/rootfs/www"
cp /bin/busybox "$WORK/rootfs/bin/busybox"
echo bench >"$WORK/rootfs/www/index.html"
tar -C "$WORK/rootfs" -cf "$WORK/rootfs.tar" .
docker import \
    --change 'ENTRYPOINT ["/bin/busybox", "sh", "-c", "trap '"'"'exit 0'"'"' TERM; /bin/busybox httpd -f -p 8080 -h /www & wait"]' \
    "$WORK/rootfs.tar" "$REPO:t" >/dev/null
DOCKER_CONFIG="$WORK/docker-config" docker push -q "$REPO:t" >/dev/null
DIGEST=$(docker inspect --format '{{index .RepoDigests 0}}' "$REPO:t" | sed 's/.*@//')
docker rmi "$REPO:t" >/dev/null

# --- server and agent ------------------------------------------------------------------------
start_server "$WORK/data" "$WORK/server.log"
export BERTH_SERVER="$SERVER_URL" BERTH_CA_FILE="$WORK/data/ca.crt"
BERTH_TOKEN=$(cat "$WORK/data/admin.token")
export BERTH_TOKEN
TOKEN_JSON=$("$BIN/berth" token create -o json)
"$BIN/berth-agent" --state-dir "$WORK/agent" --register \
    --token "$(jq -r .token <<<"$TOKEN_JSON")" --server "$SERVER_URL" \
    --ca-fingerprint "$(jq -r .caFingerprint <<<"$TOKEN_JSON")" \
    --name bench-deploy --sticker-dir "$WORK/stickers" 2>"$WORK/agent.log" &
AGENT_PID=$!
deadline=$((SECONDS + 60))
until [ -s "$WORK/agent/identity.json" ] &&
    "$BIN/berth" agents show "$(jq -r .agentId "$WORK/agent/identity.json")" -o json 2>/dev/null |
    jq -e '.status == "online" or .status == "degraded"' >/dev/null; do
    [ "$SECONDS" -lt "$deadline" ] || { echo "the agent did not come online" >&2; cat "$WORK/agent.log" >&2; exit 1; }
    sleep 0.2
done
AGENT_ID=$(jq -r .agentId "$WORK/agent/identity.json")

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
now_ms() { echo $(($(date +%s%N) / 1000000)); }

reset() {
    docker rm -f "$PREFIX-berth" "$PREFIX-manual" >/dev/null 2>&1 || true
    docker rmi "$REPO@$DIGEST" >/dev/null 2>&1 || true
    if docker image inspect "$REPO@$DIGEST" >/dev/null 2>&1; then
        echo "the image is still there locally" >&2
        exit 1
    fi
}

run_berth() {
    local i=$1 port payload t0 t1 task
    port=$(free_port)
    payload=$(jq -cn --arg image "$REPO" --arg digest "$DIGEST" --arg name "$PREFIX-berth" --argjson port "$port" '{
        image: $image, digest: $digest,
        config: {containerName: $name, releaseId: ($name + "-release"), restartPolicy: "no",
                 ports: ["127.0.0.1:\($port):8080/tcp"],
                 healthCheck: {type: "http", url: "http://127.0.0.1:\($port)/", timeout: 60, interval: 1}}}')
    t0=$(now_ms)
    task=$("$BIN/berth" task create --type docker.run --agent "$AGENT_ID" --payload "$payload" \
        --timeout-secs 120 --wait -o json)
    t1=$(now_ms)
    echo "$task" >"$OUT/berth-$i.json"
    [ "$(jq -r .state <<<"$task")" = succeeded ] || { echo "berth run $i: $task" >&2; exit 1; }
    curl -fsS "http://127.0.0.1:$port/" >/dev/null
    echo "berth $i $((t1 - t0)) $OUT/berth-$i.json" >>"$OUT/runs.txt"
}

run_manual() {
    local i=$1 port t0 t1
    port=$(free_port)
    t0=$(now_ms)
    docker pull -q "$REPO@$DIGEST" >/dev/null
    docker run -d --name "$PREFIX-manual" --restart no -p "127.0.0.1:$port:8080/tcp" "$REPO@$DIGEST" >/dev/null
    until curl -fsS -o /dev/null "http://127.0.0.1:$port/" 2>/dev/null; do
        [ $(($(now_ms) - t0)) -lt 60000 ] || { echo "manual run $i never answered" >&2; exit 1; }
        sleep 0.1
    done
    t1=$(now_ms)
    echo "manual $i $((t1 - t0))" >>"$OUT/runs.txt"
}

: >"$OUT/runs.txt"
LOAD_BEFORE=$(cut -d' ' -f1-3 /proc/loadavg)
for i in $(seq 1 "$N"); do
    if [ $((i % 2)) -eq 1 ]; then
        reset; run_berth "$i"; reset; run_manual "$i"
    else
        reset; run_manual "$i"; reset; run_berth "$i"
    fi
done
reset
LOAD_AFTER=$(cut -d' ' -f1-3 /proc/loadavg)

{
    echo "command: N=$N scripts/bench-deploy.sh"
    bench_machine
    echo "load:    before $LOAD_BEFORE, after $LOAD_AFTER"
    echo "docker:  $(docker version --format '{{.Server.Version}}')"
    python3 - "$OUT/runs.txt" <<'EOF'
import json, statistics, sys
from datetime import datetime

def ts(s):
    s = s.replace("Z", "+00:00")
    if "." in s:
        head, rest = s.split(".", 1)
        frac, tz = rest[:rest.index("+")], rest[rest.index("+"):]
        s = f"{head}.{frac[:6].ljust(6, '0')}{tz}"
    return datetime.fromisoformat(s)

rows = {"manual": [], "metrics": [], "assigned": [], "created": [], "client": [],
        "pull": [], "deploy": [], "health": []}
for line in open(sys.argv[1]):
    kind, _, ms, *rest = line.split()
    if kind == "manual":
        rows["manual"].append(int(ms))
        continue
    t = json.load(open(rest[0]))
    m = t["result"]["metrics"]
    a = t["attempts"][-1]
    rows["pull"].append(m["pullDurationMs"])
    rows["deploy"].append(m["deployDurationMs"])
    rows["health"].append(m["healthCheckDurationMs"])
    rows["metrics"].append(m["pullDurationMs"] + m["deployDurationMs"] + m["healthCheckDurationMs"])
    rows["assigned"].append(round((ts(a["finishedAt"]) - ts(a["assignedAt"])).total_seconds() * 1000))
    rows["created"].append(round((ts(t["finishedAt"]) - ts(t["createdAt"])).total_seconds() * 1000))
    rows["client"].append(int(ms))

med = {k: statistics.median(v) for k, v in rows.items()}
label = {
    "manual": "by hand: pull + run + curl until 200",
    "metrics": "berth: pull+deploy+healthCheck (agent metrics)",
    "pull": "  of which pull",
    "deploy": "  of which deploy (create+start)",
    "health": "  of which health check",
    "assigned": "berth: assignedAt -> finishedAt (server)",
    "created": "berth: createdAt -> finishedAt (server)",
    "client": "berth: CLI create --wait wall (500 ms polling)",
}
print(f"runs:    {len(rows['manual'])} by hand, {len(rows['metrics'])} berth, alternating")
print(f"{'':48} {'median':>8} {'min':>7} {'max':>7}  (ms)")
for k in ["manual", "metrics", "pull", "deploy", "health", "assigned", "created", "client"]:
    v = rows[k]
    print(f"{label[k]:48} {med[k]:8.0f} {min(v):7d} {max(v):7d}")
budget = max(0.10 * med["manual"], 200)
for k in ["metrics", "created"]:
    over = med[k] - med["manual"]
    verdict = "PASS" if over < budget else "FAIL"
    print(f"overhead ({k}) vs by hand: {over:+.0f} ms ({over / med['manual'] * 100:+.1f} %); "
          f"target < {budget:.0f} ms: {verdict}")
EOF
} | tee "$OUT/summary.txt"
