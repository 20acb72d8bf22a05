#!/usr/bin/env bash
# The soak of issue 29 item 7: two `berth server` replicas on one PostgreSQL, 50 agents (real
# `berth-agent` processes running write tasks, and simulated ones from `berth-bench tasks`), a
# deployment and drift loop, and faults: kill -9 of a replica and of agents, a PostgreSQL
# restart, a network-namespace partition of one agent. At the end `berth-bench soak-check`
# reads the database, the acknowledged task ids and the agents' state dirs, prints one row per
# invariant and exits non-zero when one is violated. A benchmark-style script, not a CI test.
#
#   scripts/soak.sh                           # DURATION=600 s of load and faults
#   DURATION=120 SKIP_BUILD=1 scripts/soak.sh # a short run on the binaries already built
#
# Run as root (network namespaces, docker, the PostgreSQL cluster's restart). Settings:
#   DURATION (600)      seconds of load and faults; then QUIESCE (90) s with neither, then the check
#   REAL_AGENTS (6)     real berth-agent processes; the last one runs in its own network namespace
#   SIM_AGENTS (44)     simulated agents (berth-bench tasks, `inspect` tasks, no side effects)
#   SIM_RATE (3)        tasks/s created for the simulated agents
#   WRITE_EVERY (1)     seconds between two write-sticker creates on the real agents
#   FAULT_EVERY (30)    mean seconds between two faults (kill -9 of a replica or of an agent)
#   PARTITION_SECS (45) how long the namespace agent is cut off
#   PG_ADMIN_URL        the cluster (default $BERTH_TEST_POSTGRES_URL); the run makes its own
#                       database in it and drops it at the end (KEEP=1 keeps it and the work dir)
#   PG_DIR              that cluster's directory for the restart (default /tmp/berth-pg, the one
#                       scripts/postgres.sh runs on 55432); PG_RESTART=0 skips the restart
#   BERTH_TEST_REGISTRY the registry the deployed image is pushed to (scripts/registry.sh)
#   BIN (target/debug)  where berth, berth-agent and berth-bench are; SKIP_BUILD=1 skips the build
#
# Everything it starts (processes, the namespace and its veth pair, containers and images named
# berth-soak-<random>, the database, the work dir) is removed on exit, Ctrl-C included; the
# PostgreSQL cluster is brought back up if the run stopped it.
set -euo pipefail

SOAK_ROOT=$(cd "$(dirname "$0")/.." && pwd)
BIN=${BIN:-"$SOAK_ROOT/target/debug"}
# bench-lib.sh resets PG_ADMIN_URL: keep the caller's.
CALLER_PG_ADMIN_URL=${PG_ADMIN_URL:-}
source "$SOAK_ROOT/scripts/bench-lib.sh"

DURATION=${DURATION:-600}
QUIESCE=${QUIESCE:-90}
REAL_AGENTS=${REAL_AGENTS:-6}
SIM_AGENTS=${SIM_AGENTS:-44}
SIM_RATE=${SIM_RATE:-3}
WRITE_EVERY=${WRITE_EVERY:-1}
FAULT_EVERY=${FAULT_EVERY:-30}
PARTITION_SECS=${PARTITION_SECS:-45}
PG_ADMIN_URL=${CALLER_PG_ADMIN_URL:-${BERTH_TEST_POSTGRES_URL:?set BERTH_TEST_POSTGRES_URL or PG_ADMIN_URL}}
PG_DIR=${PG_DIR:-/tmp/berth-pg}
PG_RESTART=${PG_RESTART:-1}
REGISTRY=${BERTH_TEST_REGISTRY:?set BERTH_TEST_REGISTRY (scripts/registry.sh)}
OUT=${OUT:-"$SOAK_ROOT/target/bench-results/soak-$(date -u +%Y%m%dT%H%M%SZ)"}
[ "$REAL_AGENTS" -ge 2 ] || { echo "REAL_AGENTS must be at least 2" >&2; exit 2; }
[ "$(id -u)" -eq 0 ] || { echo "run as root (ip netns, docker, pg_ctl)" >&2; exit 2; }

RUN_ID=$(od -An -N4 -tx1 /dev/urandom | tr -d ' \n')
PREFIX="berth-soak-$RUN_ID"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/berth-soak.XXXXXX")
chmod 755 "$WORK"
STOP="$WORK/stop"
mkdir -p "$OUT"
EVENTS="$OUT/events.log"
: >"$EVENTS"
NS="$PREFIX"
# The veth pair: its names are unique on the host, /30 inside 10.204.0.0/16 from the run id.
N=$((0x${RUN_ID:0:4} % 16384))
HOST_IF="bsk${N}h"
NS_IF="bsk${N}n"
BASE=$((0x0ACC0000 + N * 4)) # 10.204.0.0 + 4n
ip4() { echo "$(($1 >> 24 & 255)).$(($1 >> 16 & 255)).$(($1 >> 8 & 255)).$(($1 & 255))"; }
HOST_IP=$(ip4 $((BASE + 1)))
NS_IP=$(ip4 $((BASE + 2)))

declare -A REPLICA_PID=() REPLICA_URL=() REPLICA_LISTEN=() REPLICA_STARTS=()
declare -A AGENT_PID=() AGENT_ID=() AGENT_STARTS=()
LOAD_PIDS=()
PG_STOPPED=0
PARTITIONED=0

log() { echo "$(date -u +%H:%M:%S) $*" | tee -a "$EVENTS"; }

pg_bin() { echo "/usr/lib/postgresql/$(cat "$PG_DIR/data/PG_VERSION")/bin"; }
pg_ctl() { (cd / && runuser -u postgres -- "$(pg_bin)/pg_ctl" -D "$PG_DIR/data" "$@"); }
pg_start() {
    pg_ctl -l "$PG_DIR/postgresql.log" -w -t 120 start >/dev/null
    PG_STOPPED=0
}

cleanup() {
    set +e
    touch "$STOP"
    for pid in "${LOAD_PIDS[@]}"; do stop_pid "$pid"; done
    for k in "${!AGENT_PID[@]}"; do stop_pid "${AGENT_PID[$k]}"; done
    for k in "${!REPLICA_PID[@]}"; do stop_pid "${REPLICA_PID[$k]}"; done
    # A shared service: never leave the cluster down.
    [ "$PG_STOPPED" = 0 ] || pg_start
    ip netns del "$NS" 2>/dev/null
    ip link del "$HOST_IF" 2>/dev/null
    remove_docker_objects "$PREFIX"
    if [ "${KEEP:-0}" = 1 ]; then
        echo "KEEP=1: database $PG_DB and $WORK kept"
    else
        drop_db
        rm -rf "$WORK"
    fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

if [ "${SKIP_BUILD:-0}" != 1 ]; then
    (cd "$SOAK_ROOT" && cargo build --locked -p berth-cli -p berth-agent -p berth-bench --bins)
fi
for b in berth berth-agent berth-bench; do
    [ -x "$BIN/$b" ] || { echo "missing $BIN/$b" >&2; exit 1; }
done
if [ "$PG_RESTART" = 1 ] && ! [ -s "$PG_DIR/data/postmaster.pid" ]; then
    echo "no running cluster in $PG_DIR (PG_DIR); PG_RESTART=0 runs without the restart" >&2
    exit 1
fi
ulimit -n "$(ulimit -Hn)"

{
    echo "command: DURATION=$DURATION REAL_AGENTS=$REAL_AGENTS SIM_AGENTS=$SIM_AGENTS SIM_RATE=$SIM_RATE WRITE_EVERY=$WRITE_EVERY FAULT_EVERY=$FAULT_EVERY scripts/soak.sh"
    bench_machine
    echo "binaries: $BIN"
    echo "postgres: $PG_ADMIN_URL ($(psql "$PG_ADMIN_URL" -qAt -c "SELECT 'fsync=' || current_setting('fsync') || ', synchronous_commit=' || current_setting('synchronous_commit')"))"
} | tee "$OUT/machine.txt"

# --- the namespace: the last real agent lives behind a veth pair to replica b ----------------
ip netns add "$NS"
ip link add "$HOST_IF" type veth peer name "$NS_IF" netns "$NS"
ip addr add "$HOST_IP/30" dev "$HOST_IF"
ip link set "$HOST_IF" up
ip -n "$NS" addr add "$NS_IP/30" dev "$NS_IF"
ip -n "$NS" link set "$NS_IF" up
ip -n "$NS" link set lo up

# --- two replicas on one database ------------------------------------------------------------
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
create_db
DB_URL=$(db_url)
# Short heartbeats (5 s: a session lapses after 15 s) and lease grace so that what a fault
# leaves behind is swept, read back or redeployed within the run.
SERVER_FLAGS=(--database "$DB_URL" --heartbeat-interval-secs 5 --lease-grace-secs 5)

# start_replica a|b: on its fixed address, a fresh log per start; waits until it listens.
start_replica() {
    local r=$1 n log
    n=$((${REPLICA_STARTS[$r]:-0} + 1))
    REPLICA_STARTS[$r]=$n
    log="$OUT/server-$r.$n.log"
    "$BIN/berth" server --data-dir "$WORK/server-$r" --listen "${REPLICA_LISTEN[$r]}" \
        --hostname "$HOST_IP" "${SERVER_FLAGS[@]}" 2>"$log" &
    REPLICA_PID[$r]=$!
    local deadline=$((SECONDS + 120))
    until grep -q 'listening on https://' "$log" 2>/dev/null; do
        if ! kill -0 "${REPLICA_PID[$r]}" 2>/dev/null; then
            log "replica $r exited during start-up (see $log)"
            return 1
        fi
        [ "$SECONDS" -lt "$deadline" ] || { log "replica $r did not listen within 120 s"; return 1; }
        sleep 0.2
    done
}

REPLICA_LISTEN[a]="127.0.0.1:$(free_port)"
REPLICA_LISTEN[b]="$HOST_IP:$(free_port)"
REPLICA_URL[a]="https://${REPLICA_LISTEN[a]}"
REPLICA_URL[b]="https://${REPLICA_LISTEN[b]}"
start_replica a
until [ -s "$WORK/server-a/admin.token" ] && [ -s "$WORK/server-a/ca.crt" ]; do sleep 0.2; done
# The second replica with the first's key material (README, "Several replicas").
mkdir -p "$WORK/server-b"
chmod 700 "$WORK/server-b"
for f in ca.crt ca.key jwt.key registry-token.key registry-token.crt master.key sealing.key; do
    cp -p "$WORK/server-a/$f" "$WORK/server-b/$f"
done
start_replica b
log "replicas: a ${REPLICA_URL[a]}, b ${REPLICA_URL[b]} on database $PG_DB"

export BERTH_CA_FILE="$WORK/server-a/ca.crt"
BERTH_TOKEN=$(cat "$WORK/server-a/admin.token")
export BERTH_TOKEN
# The CLI tries the replicas in order (5xx or no connection: the next one).
cli() { "$BIN/berth" --server "${REPLICA_URL[a]}" --server "${REPLICA_URL[b]}" "$@"; }

# --- the image: FROM scratch + busybox httpd, two versions, like the tests' fixtures ----------
make_image() {
    local version=$1 root="$WORK/image-$1"
    mkdir -p "$root/bin" "$root/www"
    cp /bin/busybox "$root/bin/busybox"
    echo "$version" >"$root/www/index.html"
    tar -C "$root" -cf "$root.tar" .
    docker import \
        --change 'ENTRYPOINT ["/bin/busybox", "sh", "-c", "trap '"'"'exit 0'"'"' TERM; /bin/busybox httpd -f -p 8080 -h /www & wait"]' \
        "$root.tar" "$REGISTRY/$PREFIX/web:$version" >/dev/null
    DOCKER_CONFIG="$WORK/docker-config" docker push -q "$REGISTRY/$PREFIX/web:$version" >/dev/null
    docker inspect --format '{{index .RepoDigests 0}}' "$REGISTRY/$PREFIX/web:$version"
    docker rmi "$REGISTRY/$PREFIX/web:$version" >/dev/null
}

# --- real agents -----------------------------------------------------------------------------
# agent_cmd I: the agent's command line (after registration); the namespace agent runs inside
# the namespace and knows replica b only, the others know both.
agent_cmd() {
    local i=$1
    if [ "$i" = "$REAL_AGENTS" ]; then
        echo ip netns exec "$NS" "$BIN/berth-agent" --state-dir "$WORK/agent-$i" --server "${REPLICA_URL[b]}"
    else
        echo "$BIN/berth-agent" --state-dir "$WORK/agent-$i" --server "${REPLICA_URL[a]}" --server "${REPLICA_URL[b]}"
    fi
}

start_agent() {
    local i=$1 n
    n=$((${AGENT_STARTS[$i]:-0} + 1))
    AGENT_STARTS[$i]=$n
    # shellcheck disable=SC2046
    $(agent_cmd "$i") "${@:2}" 2>"$OUT/agent-$i.$n.log" &
    AGENT_PID[$i]=$!
}

TOKEN_JSON=$(cli token create -o json)
for i in $(seq 1 "$REAL_AGENTS"); do
    token=$(cli token create -o json)
    mkdir -p "$WORK/agent-$i"
    start_agent "$i" --register --token "$(jq -r .token <<<"$token")" \
        --ca-fingerprint "$(jq -r .caFingerprint <<<"$TOKEN_JSON")" --name "soak-$RUN_ID-$i"
done
for i in $(seq 1 "$REAL_AGENTS"); do
    deadline=$((SECONDS + 120))
    until [ -s "$WORK/agent-$i/identity.json" ]; do
        [ "$SECONDS" -lt "$deadline" ] || { log "agent $i did not register"; cat "$OUT/agent-$i.1.log" >&2; exit 1; }
        sleep 0.5
    done
    AGENT_ID[$i]=$(jq -r .agentId "$WORK/agent-$i/identity.json")
done
for i in $(seq 1 "$REAL_AGENTS"); do
    if [ "$i" = "$REAL_AGENTS" ]; then
        # Docker's socket does not care about namespaces, but its published ports live on the
        # host: this agent takes write tasks only, never a deployment.
        cli agents label "${AGENT_ID[$i]}" role=partitioned >/dev/null
    else
        cli agents label "${AGENT_ID[$i]}" env=soak "port=$(free_port)" >/dev/null
    fi
    deadline=$((SECONDS + 120))
    until cli agents show "${AGENT_ID[$i]}" -o json 2>/dev/null |
        jq -e '.status == "online" or .status == "degraded"' >/dev/null; do
        [ "$SECONDS" -lt "$deadline" ] || { log "agent $i did not come online"; exit 1; }
        sleep 0.5
    done
done
log "$REAL_AGENTS real agents online (agent $REAL_AGENTS in namespace $NS at $NS_IP)"

# --- the environment and two releases --------------------------------------------------------
V1=$(make_image v1)
V2=$(make_image v2)
for r in 1 2; do
    ref=$V1
    [ "$r" = 2 ] && ref=$V2
    config=$(jq -cn --arg name "$PREFIX-{{target.name}}" '{
        containerName: $name, restartPolicy: "no",
        ports: ["127.0.0.1:{{target.labels.port}}:8080/tcp"],
        healthCheck: {type: "http", interval: 1, url: "http://127.0.0.1:{{target.labels.port}}/"}}')
    cli release create "r$r" --image "web=$ref" --config "web=$config" >/dev/null
done
# Drift every 10 s, healed by redeploying; a lost agent holds its target 60 s before read-back.
cli env create soak --tier qa --selector env=soak --max-parallel 2 --health-timeout 60 \
    --task-timeout 60 --auto-heal --drift-interval 10s >/dev/null
log "environment soak over agents 1..$((REAL_AGENTS - 1)), releases r1 ($V1) and r2 ($V2)"

# --- load --------------------------------------------------------------------------------------
# Simulated agents on replica a: inspect tasks at SIM_RATE/s; acknowledged ids logged at the end.
"$BIN/berth-bench" tasks --server "${REPLICA_URL[a]}" --ca-file "$BERTH_CA_FILE" \
    --name-prefix "$PREFIX-sim" --agents "$SIM_AGENTS" --rate "$SIM_RATE" --concurrency 8 \
    --duration-secs "$DURATION" --warmup-secs 0 --drain-secs 30 --heartbeat-interval-secs 5 \
    --created-log "$OUT/created-sim.txt" >"$OUT/bench-tasks.log" 2>&1 &
LOAD_PIDS+=($!)
BENCH_PID=$!

# run_child CMD…: CMD in the background, waited for, so that the loop's TERM trap (which ends
# the child too) fires at once instead of after a deployment's whole --wait.
run_child() {
    "$@" &
    CHILD=$!
    wait "$CHILD"
}
loop_trap() {
    CHILD=""
    trap '[ -z "$CHILD" ] || kill -TERM "$CHILD" 2>/dev/null; exit 0' TERM
}

# Write tasks on the real agents, each create under its own idempotency key (the CLI retries on
# the other replica): every acknowledged id is appended at once.
write_loop() {
    set +e
    loop_trap
    local n=0 i out
    : >"$OUT/created-writes.txt"
    while [ ! -e "$STOP" ]; do
        n=$((n + 1))
        i=$((RANDOM % REAL_AGENTS + 1))
        run_child "$BIN/berth" --server "${REPLICA_URL[a]}" --server "${REPLICA_URL[b]}" task create --type write-sticker --agent "${AGENT_ID[$i]}" \
            --payload "{\"name\":\"soak-$n\"}" --idempotency-key "soak-$RUN_ID-write-$n" \
            --timeout-secs 60 -o json >"$WORK/write.out" 2>>"$OUT/write-errors.log"
        if [ $? = 0 ]; then
            echo "$(jq -r .id "$WORK/write.out") agent-$i soak-$n" >>"$OUT/created-writes.txt"
        fi
        sleep "$WRITE_EVERY"
    done
}
write_loop &
LOAD_PIDS+=($!)

# Deployments: r1, r2, r1… each followed to its end. A target whose task went `unknown` holds
# its deployment until an operator acts (DESIGN.md, "Lost lease with side effects"), and so
# does the environment: its next deployment is refused (DEPLOYMENT_IN_PROGRESS). The loop acts
# as that operator on whichever deployment holds the environment (its own, or a drift heal):
# after DEPLOY_WAIT s it retries each unknown task once, and after another DEPLOY_WAIT s it
# cancels the deployment. Every step is logged.
DEPLOY_WAIT=${DEPLOY_WAIT:-120}
deployment_state() {
    cli -o json deployment show "$1" 2>/dev/null | jq -r '.state // "?"'
}
is_over() {
    case "$1" in succeeded | failed | rolled_back | cancelled) return 0 ;; esac
    return 1
}
# follow ID SECS: waits until the deployment is over or SECS have passed (a `deployment wait`
# cut short by a replica's death is started again); its last state in FOLLOWED.
follow() {
    local id=$1 until=$((SECONDS + $2))
    FOLLOWED=$(deployment_state "$id")
    while ! is_over "$FOLLOWED" && [ "$SECONDS" -lt "$until" ] && [ ! -e "$STOP" ]; do
        run_child timeout $((until - SECONDS + 1)) "$BIN/berth" --server "${REPLICA_URL[a]}" \
            --server "${REPLICA_URL[b]}" deployment wait "$id" >/dev/null 2>&1
        FOLLOWED=$(deployment_state "$id")
        is_over "$FOLLOWED" || sleep 2
    done
}
# settle ID: follows it; the operator's retry, then cancel, when it holds.
settle() {
    local id=$1 t
    follow "$id" "$DEPLOY_WAIT"
    is_over "$FOLLOWED" || [ -e "$STOP" ] || {
        for t in $(cli -o json deployment show "$id" 2>/dev/null |
            jq -r '.targets[]? | (.tasks[]?, .rollbackTasks[]?)'); do
            [ "$(cli -o json task show "$t" 2>/dev/null | jq -r .state)" = unknown ] || continue
            cli task retry "$t" >/dev/null 2>&1 &&
                echo "$(date -u +%H:%M:%S) operator: retried unknown task $t of deployment $id" >>"$EVENTS"
        done
        follow "$id" "$DEPLOY_WAIT"
    }
    is_over "$FOLLOWED" || [ -e "$STOP" ] || {
        cli deployment cancel "$id" >/dev/null 2>&1 &&
            echo "$(date -u +%H:%M:%S) operator: cancelled deployment $id" >>"$EVENTS"
        follow "$id" "$DEPLOY_WAIT"
    }
}
deploy_loop() {
    set +e
    loop_trap
    local n=0 rel id
    : >"$OUT/deployments.txt"
    while [ ! -e "$STOP" ]; do
        n=$((n + 1))
        rel="r$((n % 2 + 1))"
        if "$BIN/berth" --server "${REPLICA_URL[a]}" --server "${REPLICA_URL[b]}" -o json \
            deploy "$rel" --env soak >"$WORK/deploy.json" 2>"$WORK/deploy.err"; then
            id=$(jq -r .id "$WORK/deploy.json")
            settle "$id"
            echo "$(date -u +%H:%M:%S) $n $rel $id state=$FOLLOWED" >>"$OUT/deployments.txt"
        elif grep -q DEPLOYMENT_IN_PROGRESS "$WORK/deploy.err"; then
            # Held by another (a drift heal, or one the loop gave up following): settle that one.
            id=$(cli -o json deployment ls --env soak 2>/dev/null |
                jq -r '[.[] | select(.state | IN("succeeded", "failed", "rolled_back", "cancelled") | not)] | last | .id // empty')
            echo "$(date -u +%H:%M:%S) $n $rel refused: held by ${id:-?}" >>"$OUT/deployments.txt"
            [ -z "$id" ] || settle "$id"
        else
            echo "$(date -u +%H:%M:%S) $n $rel refused: $(tail -n 1 "$WORK/deploy.err" | cut -c1-200)" >>"$OUT/deployments.txt"
        fi
        sleep 5
    done
}
deploy_loop &
LOAD_PIDS+=($!)

# Drift: every DRIFT_EVERY (60) s one deployed container is removed behind berth's back; the
# drift read-back must find it and (auto-heal) deploy it again.
DRIFT_EVERY=${DRIFT_EVERY:-60}
drift_loop() {
    set +e
    loop_trap
    local victim
    while [ ! -e "$STOP" ]; do
        run_child sleep "$DRIFT_EVERY"
        victim=$(docker ps --format '{{.Names}}' --filter "name=$PREFIX-" | shuf -n 1)
        if [ -n "$victim" ]; then
            docker rm -f "$victim" >/dev/null 2>&1 &&
                echo "$(date -u +%H:%M:%S) drift: removed $victim" >>"$EVENTS"
        fi
    done
}
drift_loop &
LOAD_PIDS+=($!)

# --- faults --------------------------------------------------------------------------------------
KILLS_REPLICA=0 KILLS_AGENT=0 PG_RESTARTS=0 PARTITIONS=0 CRASHES=0

# A process that exited on its own (not killed by us) is a finding: logged, counted, restarted.
supervise() {
    local k
    for k in "${!REPLICA_PID[@]}"; do
        if ! kill -0 "${REPLICA_PID[$k]}" 2>/dev/null; then
            wait "${REPLICA_PID[$k]}" 2>/dev/null
            CRASHES=$((CRASHES + 1))
            log "replica $k exited on its own (log $OUT/server-$k.${REPLICA_STARTS[$k]}.log); restarting"
            start_replica "$k" || true
        fi
    done
    for k in "${!AGENT_PID[@]}"; do
        if ! kill -0 "${AGENT_PID[$k]}" 2>/dev/null; then
            wait "${AGENT_PID[$k]}" 2>/dev/null
            CRASHES=$((CRASHES + 1))
            log "agent $k exited on its own (log $OUT/agent-$k.${AGENT_STARTS[$k]}.log); restarting"
            start_agent "$k"
        fi
    done
}

# pause S: S seconds, supervising every second.
pause() {
    local until=$((SECONDS + $1))
    while [ "$SECONDS" -lt "$until" ]; do
        supervise
        sleep 1
    done
}

kill_replica() {
    local r
    r=$(printf 'a\nb\n' | shuf -n 1)
    log "kill -9 replica $r (pid ${REPLICA_PID[$r]})"
    kill -KILL "${REPLICA_PID[$r]}"
    wait "${REPLICA_PID[$r]}" 2>/dev/null || true
    KILLS_REPLICA=$((KILLS_REPLICA + 1))
    sleep $((RANDOM % 5 + 2))
    start_replica "$r"
    log "replica $r back"
}

kill_agent() {
    local i
    i=$((RANDOM % REAL_AGENTS + 1))
    log "kill -9 agent $i (pid ${AGENT_PID[$i]})"
    kill -KILL "${AGENT_PID[$i]}"
    wait "${AGENT_PID[$i]}" 2>/dev/null || true
    KILLS_AGENT=$((KILLS_AGENT + 1))
    sleep $((RANDOM % 5 + 1))
    start_agent "$i"
    log "agent $i back"
}

restart_postgres() {
    log "PostgreSQL stop (fast) in $PG_DIR"
    PG_STOPPED=1
    pg_ctl -m fast -w -t 120 stop >/dev/null
    sleep 5
    pg_start
    PG_RESTARTS=$((PG_RESTARTS + 1))
    log "PostgreSQL back"
}

partition() {
    log "partition: $HOST_IF down for $PARTITION_SECS s (agent $REAL_AGENTS cut off from replica b)"
    PARTITIONED=1
    ip link set "$HOST_IF" down
    pause "$PARTITION_SECS"
    ip link set "$HOST_IF" up
    PARTITIONED=0
    PARTITIONS=$((PARTITIONS + 1))
    log "partition healed"
}

START=$SECONDS
END=$((START + DURATION))
PG_AT=$((START + DURATION * 2 / 5))
CUT_AT=$((START + DURATION * 3 / 5))
log "load and faults for $DURATION s"
while [ "$SECONDS" -lt "$END" ]; do
    pause $((FAULT_EVERY / 2 + RANDOM % (FAULT_EVERY + 1)))
    [ "$SECONDS" -lt "$END" ] || break
    if [ "$PG_RESTART" = 1 ] && [ "$PG_RESTARTS" = 0 ] && [ "$SECONDS" -ge "$PG_AT" ]; then
        restart_postgres
    elif [ "$PARTITIONS" = 0 ] && [ "$SECONDS" -ge "$CUT_AT" ]; then
        partition
    elif [ $((RANDOM % 2)) = 0 ]; then
        kill_replica
    else
        kill_agent
    fi
done
# The short run may end before the one-off faults were due: do them now.
[ "$PG_RESTART" != 1 ] || [ "$PG_RESTARTS" != 0 ] || restart_postgres
[ "$PARTITIONS" != 0 ] || partition

log "load stops; $QUIESCE s to settle"
touch "$STOP"
deadline=$((SECONDS + 180))
while kill -0 "$BENCH_PID" 2>/dev/null && [ "$SECONDS" -lt "$deadline" ]; do pause 2; done
for pid in "${LOAD_PIDS[@]}"; do stop_pid "$pid"; done
LOAD_PIDS=()
pause "$QUIESCE"

# --- the verdict -----------------------------------------------------------------------------
STATES=()
for i in $(seq 1 "$REAL_AGENTS"); do STATES+=(--agent-state "$WORK/agent-$i"); done
created=(--created "$OUT/created-writes.txt")
[ -s "$OUT/created-sim.txt" ] && created+=(--created "$OUT/created-sim.txt")
set +e
"$BIN/berth-bench" soak-check --database "$DB_URL" "${created[@]}" "${STATES[@]}" \
    --json "$OUT/verdict.jsonl" | tee "$OUT/verdict.txt"
VERDICT=${PIPESTATUS[0]}
set -e
{
    echo "faults: $KILLS_REPLICA replica kill -9, $KILLS_AGENT agent kill -9, $PG_RESTARTS PostgreSQL restart, $PARTITIONS partition; $CRASHES exits on their own"
    echo "acknowledged creates: $(wc -l <"$OUT/created-writes.txt") write-sticker, $(cat "$OUT/created-sim.txt" 2>/dev/null | wc -l) inspect (simulated agents)"
    echo "deploy loop: $(grep -c 'state=' "$OUT/deployments.txt") deployments made and followed ($(grep -c 'state=succeeded' "$OUT/deployments.txt") succeeded), $(grep -c 'refused' "$OUT/deployments.txt") refused; operator: $(grep -c 'operator: retried' "$EVENTS") unknown tasks retried, $(grep -c 'operator: cancelled' "$EVENTS") deployments cancelled"
    echo "drift: $(grep -c 'drift: removed' "$EVENTS") containers removed"
    grep '^SUMMARY' "$OUT/bench-tasks.log" | head -c 600 || true
    echo
    echo "logs: $OUT"
} | tee "$OUT/summary.txt"
exit "$VERDICT"
