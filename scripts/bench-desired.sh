#!/usr/bin/env bash
# Seed 001 converge time: `berth env set-desired` until the agent reported `applied`, against
# the same compose steps run by hand, side by side in one run, interleaved, N rounds each.
#
#   scripts/bench-desired.sh              # N=7
#   N=3 SKIP_BUILD=1 scripts/bench-desired.sh
#
# One busybox httpd image (`docker import`, like the tests' fixtures) in the local registry of
# scripts/registry.sh, pulled once before the rounds (neither side pulls). Two bundle
# directories, A and B, differ in their published port, so every round recreates the
# container. Each has a compose healthcheck (busybox wget every 1 s), a `.env.template`
# (PORT, GREETING) and a manifest with one `builtin` secret (GREETING).
#
#   berth   `berth env set-desired E SHA`, then one `berth-agent --env E --once` tick (checkin,
#           bundle + sha check, lease, secret read, .env render, `docker-compose up -d
#           --remove-orphans`, health wait, report) until it exits; then `berth env desired E`
#           must show appliedSha = SHA and lastResult = applied (checked after the clock stops).
#   by hand `docker-compose -p P -f DIR/docker-compose.yml --env-file DIR/.env up -d
#           --remove-orphans` (the .env written beforehand, secret included), then `docker
#           inspect` every 100 ms until the container is running and healthy.
#
# Rate buckets (seed 001, per environment): checkin 6/min, lease 5/hour. Every apply takes a
# lease, so one environment holds an unmeasured first apply plus at most 4 measured rounds:
# rounds use environments E1, E2, … (4 rounds each), all selecting the one agent's label
# bench=<prefix>; each new environment starts with an unmeasured apply of A.
#
# Everything it creates is named berth-e2e-bench-<random> and removed on exit.
set -euo pipefail

source "$(dirname "$0")/bench-lib.sh"

N=${N:-7}
ROUNDS_PER_ENV=4
COMPOSE=${COMPOSE:-docker-compose}
OUT=${OUT:-"$BENCH_ROOT/target/bench-results/desired-$(date -u +%Y%m%dT%H%M%SZ)"}

eval "$(bash "$BENCH_ROOT/scripts/registry.sh" | grep '^export ')"
REGISTRY=${BERTH_TEST_REGISTRY:?scripts/registry.sh did not export BERTH_TEST_REGISTRY}

PREFIX="berth-e2e-bench-$(od -An -N4 -tx1 /dev/urandom | tr -d ' \n')"
REPO="$REGISTRY/$PREFIX/web"
MANUAL_PROJECT="$PREFIX-manual"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/berth-e2e-bench.XXXXXX")

remove_networks() {
    local ids
    ids=$(docker network ls -q --filter "name=$PREFIX" 2>/dev/null || true)
    [ -z "$ids" ] || docker network rm $ids >/dev/null 2>&1 || true
}
cleanup() {
    stop_server
    remove_docker_objects "$PREFIX"
    remove_networks
    rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

BENCH_BINS="berth berth-agent" bench_build berth-cli
mkdir -p "$OUT"

# --- the image: busybox httpd serving $GREETING -------------------------------------------------
mkdir -p "$WORK/rootfs/bin" "$WORK/rootfs/www"
cp /bin/busybox "$WORK/rootfs/bin/busybox"
tar -C "$WORK/rootfs" -cf "$WORK/rootfs.tar" .
docker import "$WORK/rootfs.tar" "$REPO:t" >/dev/null
DOCKER_CONFIG="$WORK/docker-config" docker push -q "$REPO:t" >/dev/null
IMAGE=$(docker inspect --format '{{index .RepoDigests 0}}' "$REPO:t")
docker pull -q "$IMAGE" >/dev/null

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
now_ms() { echo $(($(date +%s%N) / 1000000)); }

# bundle_dir DIR ENV PORT: the compose file, .env.template, manifest and bundle.json.
bundle_dir() {
    local dir=$1 env=$2 port=$3
    mkdir -p "$dir"
    cat >"$dir/docker-compose.yml" <<EOF
version: "2.4"
services:
  web:
    image: $IMAGE
    entrypoint: ["/bin/busybox", "sh", "-c", "echo -n \"\$\$GREETING\" > /www/index.html; trap 'exit 0' TERM; /bin/busybox httpd -f -p 8080 -h /www & wait"]
    environment:
      GREETING: "\${GREETING}"
    ports:
      - "127.0.0.1:\${PORT}:8080"
    healthcheck:
      test: ["CMD", "/bin/busybox", "wget", "-q", "-O", "/dev/null", "http://127.0.0.1:8080/"]
      interval: 1s
      timeout: 1s
      retries: 30
EOF
    printf 'PORT=%s\nGREETING=\n' "$port" >"$dir/.env.template"
    jq -cn --arg path "berth/$env/see/greeting" \
        '{vault_mode: "builtin", entries: [{var: "GREETING", path: $path, kind: "supplied", version: null}]}' \
        >"$dir/secrets.manifest.json"
    jq -cn --arg env "$env" '{env_id: $env, tier: "dev", renderer: "compose"}' >"$dir/bundle.json"
}

# --- server, the agent, the by-hand directories -----------------------------------------------
start_server "$WORK/data" "$WORK/server.log"
export BERTH_SERVER="$SERVER_URL" BERTH_CA_FILE="$WORK/data/ca.crt"
BERTH_TOKEN=$(cat "$WORK/data/admin.token")
export BERTH_TOKEN
SECRET="bench-$(od -An -N8 -tx1 /dev/urandom | tr -d ' \n')"
AGENT_DIR="$WORK/agent"
LABEL="bench=$PREFIX"

create_env() {
    "$BIN/berth" env create "$1" --tier dev --selector "$LABEL" >/dev/null
    printf '%s' "$SECRET" | "$BIN/berth" secret put "$1/see/greeting" --from-file - >/dev/null
}

# tick ENV LOG: one agent tick; fails the bench unless it exits 0.
tick() {
    local env=$1 log=$2 code=0
    RUST_LOG=info "$BIN/berth-agent" --state-dir "$AGENT_DIR" --server "$SERVER_URL" \
        --env "$env" --once --compose-command "$COMPOSE" --health-timeout-secs 60 2>"$log" || code=$?
    [ "$code" = 0 ] || { echo "berth-agent --env $env --once exited $code:" >&2; cat "$log" >&2; exit 1; }
}

# Registered by a first tick of an environment of its own (nothing desired: a checkin only).
create_env "$PREFIX-reg"
TOKEN_JSON=$("$BIN/berth" token create -o json)
RUST_LOG=info "$BIN/berth-agent" --state-dir "$AGENT_DIR" --register \
    --token "$(jq -r .token <<<"$TOKEN_JSON")" --server "$SERVER_URL" \
    --ca-fingerprint "$(jq -r .caFingerprint <<<"$TOKEN_JSON")" \
    --name bench-desired --labels "$LABEL" --env "$PREFIX-reg" --once \
    --compose-command "$COMPOSE" 2>"$OUT/register.log" ||
    { echo "registration tick failed:" >&2; cat "$OUT/register.log" >&2; exit 1; }

# By hand: A and B with their .env rendered beforehand, as an operator keeps them.
for v in a b; do
    bundle_dir "$WORK/manual-$v" manual "$(free_port)"
    sed "s/^GREETING=\$/GREETING=$SECRET/" "$WORK/manual-$v/.env.template" >"$WORK/manual-$v/.env"
    chmod 600 "$WORK/manual-$v/.env"
done

# Per environment: A and B pushed, their shas in SHA_A / SHA_B, A applied (unmeasured).
ENV=""
SHA_A=""
SHA_B=""
next_env() {
    local k=$1 v sha
    ENV="$PREFIX-e$k"
    create_env "$ENV"
    for v in a b; do
        bundle_dir "$WORK/$ENV-$v" "$ENV" "$(free_port)"
        sha=$("$BIN/berth" bundle build "$WORK/$ENV-$v" --out "$WORK/$ENV-$v.tar")
        "$BIN/berth" bundle push "$WORK/$ENV-$v.tar" --env "$ENV" >/dev/null
        if [ "$v" = a ]; then SHA_A=$sha; else SHA_B=$sha; fi
    done
    "$BIN/berth" env set-desired "$ENV" "$SHA_A" >/dev/null
    tick "$ENV" "$OUT/$ENV-warmup.log"
}

manual_up() {
    "$COMPOSE" -p "$MANUAL_PROJECT" -f "$WORK/manual-$1/docker-compose.yml" \
        --env-file "$WORK/manual-$1/.env" up -d --remove-orphans >/dev/null 2>&1
}

run_berth() {
    local i=$1 sha t0 t1 view
    if [ $((i % 2)) -eq 1 ]; then sha=$SHA_B; else sha=$SHA_A; fi
    t0=$(now_ms)
    "$BIN/berth" env set-desired "$ENV" "$sha" >/dev/null
    t1=$(now_ms)
    tick "$ENV" "$OUT/berth-$i.log"
    t2=$(now_ms)
    view=$("$BIN/berth" env desired "$ENV" -o json)
    echo "$view" >"$OUT/berth-$i.json"
    jq -e --arg sha "$sha" '.agents | length == 1 and .[0].appliedSha == $sha and .[0].lastResult == "applied"' \
        <<<"$view" >/dev/null || { echo "round $i: not applied: $view" >&2; exit 1; }
    echo "berth $i $((t2 - t0)) $((t1 - t0)) $((t2 - t1)) $ENV $t1 $t2 $OUT/berth-$i.log" >>"$OUT/runs.txt"
}

run_manual() {
    local i=$1 v t0 t1 state
    if [ $((i % 2)) -eq 1 ]; then v=b; else v=a; fi
    t0=$(now_ms)
    manual_up "$v"
    until state=$(docker inspect --format '{{.State.Status}} {{if .State.Health}}{{.State.Health.Status}}{{end}}' \
        "${MANUAL_PROJECT}_web_1" 2>/dev/null) &&
        [ "$state" = "running healthy" ]; do
        [ $(($(now_ms) - t0)) -lt 60000 ] || { echo "manual round $i never became healthy ($state)" >&2; exit 1; }
        sleep 0.1
    done
    t1=$(now_ms)
    echo "manual $i $((t1 - t0))" >>"$OUT/runs.txt"
}

: >"$OUT/runs.txt"
LOAD_BEFORE=$(cut -d' ' -f1-3 /proc/loadavg)
manual_up a
for i in $(seq 1 "$N"); do
    if [ $(((i - 1) % ROUNDS_PER_ENV)) -eq 0 ]; then
        next_env $(((i - 1) / ROUNDS_PER_ENV + 1))
    fi
    if [ $((i % 2)) -eq 1 ]; then
        run_berth "$i"; run_manual "$i"
    else
        run_manual "$i"; run_berth "$i"
    fi
done
LOAD_AFTER=$(cut -d' ' -f1-3 /proc/loadavg)
"$COMPOSE" -p "$MANUAL_PROJECT" -f "$WORK/manual-a/docker-compose.yml" --env-file "$WORK/manual-a/.env" \
    down --remove-orphans >/dev/null 2>&1 || true
grep -l "$SECRET" "$OUT"/*.log "$OUT"/*.json "$WORK/server.log" 2>/dev/null &&
    { echo "the secret leaked into the files above" >&2; exit 1; }

{
    echo "command: N=$N scripts/bench-desired.sh"
    bench_machine
    echo "load:    before $LOAD_BEFORE, after $LOAD_AFTER"
    echo "docker:  $(docker version --format '{{.Server.Version}}'), $("$COMPOSE" version --short 2>/dev/null || "$COMPOSE" version | head -n1)"
} | tee "$OUT/machine.txt"
echo
python3 - "$OUT/runs.txt" <<'EOF'
import datetime, statistics, sys
rows = [l.split() for l in open(sys.argv[1]) if l.strip()]
berth = [r for r in rows if r[0] == "berth"]
manual = [int(r[2]) for r in rows if r[0] == "manual"]
total = [int(r[2]) for r in berth]
setd = [int(r[3]) for r in berth]
tick = [int(r[4]) for r in berth]
med = statistics.median
print(f"rounds: {len(berth)} berth, {len(manual)} by hand (interleaved, alternating A/B)")
print(f"berth  set-desired -> applied: median {med(total)} ms (min {min(total)}, max {max(total)}); "
      f"set-desired {med(setd)} ms, agent tick {med(tick)} ms")
print(f"by hand compose up -> healthy: median {med(manual)} ms (min {min(manual)}, max {max(manual)})")
print(f"ratio berth/by hand: {med(total) / med(manual):.2f}; berth adds {med(total) - med(manual)} ms (median difference)")
# The tick's phases from the agent's own log lines (UTC timestamps, same clock as date(1)).
def stamp(line):
    t = datetime.datetime.strptime(line.split()[0][:26], "%Y-%m-%dT%H:%M:%S.%f")
    return t.replace(tzinfo=datetime.timezone.utc).timestamp() * 1000
marks = (("checkin: action=apply", "start, identity, TLS, checkin"),
         ("verified", "bundle fetch + sha check"),
         ("resolved", "lease + secret read"),
         ("applied ", ".env render, compose up, health wait"))
phases = {label: [] for _, label in marks}
phases["report, exit"] = []
for b in berth:
    lines = open(b[8]).read().splitlines()
    at = []
    for needle, _ in marks:
        hit = [l for l in lines if needle in l]
        at.append(stamp(hit[0]) if hit else None)
    if None in at:
        continue
    prev = int(b[6])
    for (needle, label), t in zip(marks, at):
        phases[label].append(t - prev)
        prev = t
    phases["report, exit"].append(int(b[7]) - prev)
print("berth tick phases (median ms, from the agent's log timestamps):")
for label, v in phases.items():
    if v:
        print(f"  {label:40s} {med(v):7.1f}  (min {min(v):.1f}, max {max(v):.1f})")
print("per round (ms): " + "; ".join(f"{b[1]}: berth {b[2]} / hand {m}" for b, m in zip(berth, manual)))
EOF
