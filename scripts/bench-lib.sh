# Shared by scripts/bench-*.sh (sourced, not run): the release build, a throwaway `berth server`
# on a free loopback port, and /proc sampling. Every process started here is recorded so the
# caller's trap can stop it; nothing else is ever signalled.

BENCH_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# BIN: where the binaries are (default target/release), e.g. a baseline build for an A/B run.
BIN=${BIN:-"$BENCH_ROOT/target/release"}
CLK_TCK=$(getconf CLK_TCK)
SERVER_PID=""
SERVER_URL=""
# The PostgreSQL database of a run (create_db, drop_db), on the cluster PG_ADMIN_URL names.
PG_ADMIN_URL=""
PG_DB=""

# create_db: a fresh database for one run; its name in PG_DB, its URL printed by db_url.
create_db() {
    PG_DB="berth_bench_$(od -An -N6 -tx1 /dev/urandom | tr -d ' \n')"
    psql "$PG_ADMIN_URL" -qAt -c "CREATE DATABASE $PG_DB" >/dev/null
}

db_url() {
    echo "${PG_ADMIN_URL%/*}/$PG_DB"
}

# drop_db: drops PG_DB, if a run made one (also from a caller's trap, so it never fails).
drop_db() {
    if [ -n "$PG_DB" ] && [ -n "$PG_ADMIN_URL" ]; then
        psql "$PG_ADMIN_URL" -qAt -c "DROP DATABASE IF EXISTS $PG_DB WITH (FORCE)" >/dev/null 2>&1 || true
    fi
    PG_DB=""
}

# bench_build PACKAGE…: release build of those packages (skipped with SKIP_BUILD=1), then
# checks the binaries in BENCH_BINS are there.
bench_build() {
    if [ "${SKIP_BUILD:-0}" = 1 ]; then
        echo "SKIP_BUILD=1: using the binaries in $BIN"
    else
        local args=()
        for p in "$@"; do args+=(-p "$p"); done
        (cd "$BENCH_ROOT" && cargo build --release "${args[@]}")
    fi
    for b in $BENCH_BINS; do
        [ -x "$BIN/$b" ] || { echo "missing $BIN/$b" >&2; exit 1; }
    done
}

bench_machine() {
    echo "date:    $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "host:    $(uname -srm), $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')"
    echo "memory:  $(free -h | awk '/^Mem:/ {print $2 " total, " $7 " available"}')"
    echo "loadavg: $(cut -d' ' -f1-3 /proc/loadavg)"
    echo "commit:  $(cd "$BENCH_ROOT" && git rev-parse --short HEAD 2>/dev/null || echo unknown)$(cd "$BENCH_ROOT" && git diff --quiet 2>/dev/null || echo ' (dirty tree)')"
}

# start_server DATA_DIR LOG [server flags…]: starts a release server on 127.0.0.1:0 and waits
# until it listens. Sets SERVER_PID and SERVER_URL.
start_server() {
    local data=$1 log=$2
    shift 2
    "$BIN/berth" server --data-dir "$data" --listen 127.0.0.1:0 "$@" 2>"$log" &
    SERVER_PID=$!
    local deadline=$((SECONDS + 60))
    until grep -q 'listening on https://' "$log" 2>/dev/null; do
        if ! kill -0 "$SERVER_PID" 2>/dev/null; then
            echo "the server exited during startup:" >&2
            cat "$log" >&2
            SERVER_PID=""
            exit 1
        fi
        if [ "$SECONDS" -ge "$deadline" ]; then
            echo "the server did not listen within 60 s" >&2
            exit 1
        fi
        sleep 0.2
    done
    SERVER_URL=$(grep -o 'https://127\.0\.0\.1:[0-9]*' "$log" | head -n1)
    until [ -s "$data/admin.token" ] && [ -s "$data/ca.crt" ]; do
        [ "$SECONDS" -lt "$deadline" ] || { echo "no admin token in $data" >&2; exit 1; }
        sleep 0.2
    done
}

# stop_pid PID: SIGTERM, then SIGKILL after 15 s; waits for it.
stop_pid() {
    local pid=$1
    [ -n "$pid" ] || return 0
    kill -0 "$pid" 2>/dev/null || { wait "$pid" 2>/dev/null; return 0; }
    kill -TERM "$pid" 2>/dev/null || true
    local deadline=$((SECONDS + 15))
    while kill -0 "$pid" 2>/dev/null && [ "$SECONDS" -lt "$deadline" ]; do
        sleep 0.2
    done
    kill -KILL "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
}

# remove_docker_objects PREFIX: every container and local image whose name holds PREFIX (a
# bench's own berth-e2e-bench-<random>), and nothing else.
remove_docker_objects() {
    local prefix=$1 ids
    ids=$(docker ps -aq --filter "name=$prefix" 2>/dev/null || true)
    [ -z "$ids" ] || docker rm -f $ids >/dev/null 2>&1 || true
    docker images --digests --format '{{.Repository}} {{.Tag}} {{.Digest}}' 2>/dev/null |
        while read -r repo tag digest; do
            case "$repo" in *"$prefix"*) ;; *) continue ;; esac
            [ "$tag" = "<none>" ] || docker rmi "$repo:$tag" >/dev/null 2>&1 || true
            [ "$digest" = "<none>" ] || docker rmi "$repo@$digest" >/dev/null 2>&1 || true
        done
}

stop_server() {
    stop_pid "$SERVER_PID"
    SERVER_PID=""
}

# cpu_ticks PID: utime + stime in clock ticks (fields 14 and 15 of /proc/PID/stat, counted
# after the parenthesised command name, which may contain spaces).
cpu_ticks() {
    local stat
    stat=$(cat "/proc/$1/stat") || return 1
    stat=${stat##*) }
    # shellcheck disable=SC2086
    set -- $stat
    echo $((${12} + ${13}))
}

# rss_kib PID: VmRSS in KiB.
rss_kib() {
    awk '/^VmRSS:/ {print $2}' "/proc/$1/status"
}

# seed_large_db DATA TASKS [grow-tasks.py options…]: a release server on DATA runs simulated
# agents for a few seconds (real finished tasks, each with its attempt; log in $OUT/seed.log),
# then, stopped, its database is grown to TASKS tasks by scripts/grow-tasks.py.
seed_large_db() {
    local data=$1 tasks=$2
    shift 2
    start_server "$data" "$OUT/server-seed.log"
    BERTH_TOKEN=$(cat "$data/admin.token") "$BIN/berth-bench" tasks --server "$SERVER_URL" \
        --ca-file "$data/ca.crt" --agents 8 --rate 200 --duration-secs 5 --warmup-secs 1 \
        --name-prefix seed >"$OUT/seed.log"
    stop_server
    echo "growing the database to $tasks tasks $*…"
    python3 "$BENCH_ROOT/scripts/grow-tasks.py" "$data/berth.db" "$tasks" "$@"
}
