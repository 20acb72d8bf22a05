#!/usr/bin/env bash
# Reconciler cost at fleet size (issue 29, "Measure"): one `berth server` on one durable
# PostgreSQL database holding ENVS (1,000) environments with ENVS running deployments over
# ENVS × PER_ENV (10,000) targets, no API traffic. Per reconciler: passes, statements per pass,
# and server CPU per pass.
#
#   scripts/bench-reconcilers.sh                                     # target/release
#   BINS="base=/work/bench-bins/base head=/work/bench-bins/head" RUNS=2 scripts/bench-reconcilers.sh
#
# BINS: label=DIR pairs; the database is seeded once (scripts/bench-reconcilers-seed.sql, into a
# template migrated by the first DIR's server) and each run gets its own copy, runs interleaved
# label by label. Each run: WARMUP (20) s after the server listens and every environment has a
# completed readiness pass again, then DURATION (60) s
# measured: pg_stat_statements of the run's database (reset at the start; BEGIN/COMMIT
# included), the server's CPU from /proc, and /metrics at both ends (the reconciler driver's
# `berth_reconciler_passes_total{name}` when the build has it). Then PERF_SECS (20; 0 skips)
# s of `perf record --call-graph dwarf` on the server, which splits its CPU between the
# reconcilers by the frames on each sample's stack.
#
# Passes: from `berth_reconciler_passes_total` when the build exports it, else from the
# calls of the one statement each pass of that loop runs once (the report names it).
# Statements: attributed to a reconciler by their text (the patterns in
# scripts/bench-reconcilers-report.py); a statement two loops share (a task by id, a release by
# name) is split by each caller's units, counted from statements only that caller runs, and the
# report prints the split's prediction against the measured total. Server CPU per reconciler:
# the window's CPU times the loop's share of the perf samples (samples naming no loop are left
# out and reported).
# Knobs: ENVS, PER_ENV, WARMUP, DURATION, PERF_SECS, RUNS (1), OUT, KEEP_PERF=1 (keep each
# run's perf.data in OUT), KEEP_TEMPLATE=1 (keep the
# seeded template database and print its name), TEMPLATE=NAME (reuse one instead of seeding;
# with TEMPLATE_DATA=DIR, the data dir its seeding server made, kept under OUT).
set -euo pipefail

source "$(dirname "$0")/bench-lib.sh"

ENVS=${ENVS:-1000}
PER_ENV=${PER_ENV:-10}
WARMUP=${WARMUP:-20}
DURATION=${DURATION:-60}
PERF_SECS=${PERF_SECS:-20}
RUNS=${RUNS:-1}
BINS=${BINS:-"run=$BIN"}
OUT=${OUT:-"$BENCH_ROOT/target/bench-results/reconcilers-$(date -u +%Y%m%dT%H%M%SZ)"}

WORK=$(mktemp -d "${TMPDIR:-/tmp}/berth-bench-reconcilers.XXXXXX")
chmod 0755 "$WORK"
TEMPLATE=${TEMPLATE:-}
OWN_TEMPLATE=""
cleanup() {
    stop_server
    drop_db
    if [ -n "$OWN_TEMPLATE" ] && [ "${KEEP_TEMPLATE:-0}" != 1 ]; then
        psql "$PG_ADMIN_URL" -qAt -c "DROP DATABASE IF EXISTS $OWN_TEMPLATE WITH (FORCE)" >/dev/null 2>&1 || true
    fi
    rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

for pair in $BINS; do
    dir=${pair#*=}
    for b in berth; do
        [ -x "$dir/$b" ] || { echo "missing $dir/$b (BINS=\"$BINS\")" >&2; exit 1; }
    done
done
mkdir -p "$OUT"
PG_ADMIN_URL=$(BERTH_PG_DURABLE=1 bash "$BENCH_ROOT/scripts/postgres.sh" | tail -n 1)
{
    echo "command: ENVS=$ENVS PER_ENV=$PER_ENV WARMUP=$WARMUP DURATION=$DURATION PERF_SECS=$PERF_SECS RUNS=$RUNS BINS=\"$BINS\" scripts/bench-reconcilers.sh"
    bench_machine
    echo "postgres: $PG_ADMIN_URL (durable benchmark cluster)"
    for pair in $BINS; do
        echo "bin ${pair%%=*}: ${pair#*=} ($("${pair#*=}/berth" --version 2>/dev/null || echo '?'))"
    done
} | tee "$OUT/machine.txt"

psql_db() { psql "${PG_ADMIN_URL%/*}/$1" -v ON_ERROR_STOP=1 -qAt "${@:2}"; }

# wait_for DESCRIPTION SECONDS COMMAND…: until COMMAND succeeds, or fails the run at the deadline.
wait_for() {
    local what=$1 limit=$2
    shift 2
    local deadline=$((SECONDS + limit))
    until "$@"; do
        [ "$SECONDS" -lt "$deadline" ] || { echo "timed out after ${limit}s waiting for $what" >&2; exit 1; }
        sleep 1
    done
}

# readiness_settled DB: every environment of DB has a completed readiness pass.
readiness_settled() {
    [ "$(psql_db "$1" -c "SELECT count(*) FROM environment_readiness WHERE (pass ->> 'complete')::boolean")" -ge "$ENVS" ]
}

# seed: a template database migrated by the first build's server, seeded by SQL, then served
# once until every environment's readiness pass is complete (the steady state the runs start
# from). Its data dir (keys, admin token) is kept for the runs.
seed() {
    local first=${BINS%% *}
    BIN=${first#*=}
    OWN_TEMPLATE="berth_bench_recon_$(od -An -N6 -tx1 /dev/urandom | tr -d ' \n')"
    TEMPLATE=$OWN_TEMPLATE
    TEMPLATE_DATA="$WORK/seed-data"
    [ "${KEEP_TEMPLATE:-0}" != 1 ] || TEMPLATE_DATA="$OUT/seed-data"
    psql "$PG_ADMIN_URL" -qAt -c "CREATE DATABASE $OWN_TEMPLATE" >/dev/null
    local url="${PG_ADMIN_URL%/*}/$OWN_TEMPLATE"
    echo "seeding $OWN_TEMPLATE: $ENVS environments × $PER_ENV targets (migrated by $BIN)"
    start_server "$TEMPLATE_DATA" "$OUT/seed-server-1.log" --database "$url"
    stop_server
    psql_db "$OWN_TEMPLATE" -c "CREATE EXTENSION IF NOT EXISTS pg_stat_statements" >/dev/null
    local started=$SECONDS
    psql_db "$OWN_TEMPLATE" -v envs="$ENVS" -v per="$PER_ENV" -f "$BENCH_ROOT/scripts/bench-reconcilers-seed.sql" >/dev/null
    echo "seeded in $((SECONDS - started)) s; serving it once until readiness settles"
    start_server "$TEMPLATE_DATA" "$OUT/seed-server-2.log" --database "$url"
    wait_for "every environment's readiness pass to complete" 300 readiness_settled "$OWN_TEMPLATE"
    stop_server
    psql_db "$OWN_TEMPLATE" -c "SELECT 'template: ' || (SELECT count(*) FROM deployments WHERE state IN ('pending','running')) || ' active deployments, ' || (SELECT count(*) FROM deployment_targets) || ' deployment targets, ' || (SELECT count(*) FROM agents) || ' agents, ' || (SELECT count(*) FROM tasks) || ' tasks, ' || (SELECT count(*) FROM target_observations) || ' observations, ' || (SELECT count(*) FROM environment_readiness) || ' readiness rows'" | tee -a "$OUT/machine.txt"
    [ "${KEEP_TEMPLATE:-0}" != 1 ] || echo "kept template: TEMPLATE=$OWN_TEMPLATE TEMPLATE_DATA=$TEMPLATE_DATA"
}

# backend_ticks DB: CPU ticks of the PostgreSQL backends connected to DB, "pid:ticks" per line.
backend_ticks() {
    local pid
    for pid in $(psql "$PG_ADMIN_URL" -qAt -c "SELECT pid FROM pg_stat_activity WHERE datname = '$1'"); do
        echo "$pid:$(cpu_ticks "$pid" 2>/dev/null || echo 0)"
    done
}

# run LABEL DIR N
run() {
    local label=$1 dir=$2 n=$3
    local tag="$label-$n" data="$WORK/data-$label-$n"
    BIN=$dir
    echo
    echo "=== $tag: $dir ($(uptime | sed 's/.*load/load/')) ==="
    PG_DB="berth_bench_$(od -An -N6 -tx1 /dev/urandom | tr -d ' \n')"
    psql "$PG_ADMIN_URL" -qAt -c "CREATE DATABASE $PG_DB TEMPLATE $TEMPLATE" >/dev/null
    # Each target's next drift check again within the hour from now, at an offset of its own
    # (the same in every run): no run starts with a backlog of checks the copy made due.
    psql_db "$PG_DB" -c "UPDATE target_observations SET next_check_at = now() + ((('x' || substr(md5(agent_id::text), 1, 8))::bit(32)::bigint % 3600000) * interval '1 millisecond')" >/dev/null
    cp -a "$TEMPLATE_DATA" "$data"
    start_server "$data" "$OUT/$tag.server.log" --database "$(db_url)" --retention-days 30
    # A build that counts the readiness generation differently starts a pass everywhere: the
    # window starts once they are complete again.
    wait_for "readiness passes to complete" 300 readiness_settled "$PG_DB"
    sleep "$WARMUP"
    local url
    url=$(db_url)
    psql "$url" -qAt -c "SELECT pg_stat_statements_reset(0, (SELECT oid FROM pg_database WHERE datname = current_database()), 0)" >/dev/null
    curl -sS --cacert "$data/ca.crt" "$SERVER_URL/metrics" >"$OUT/$tag.metrics.start"
    backend_ticks "$PG_DB" >"$OUT/$tag.pg.start"
    local t0 c0 t1 c1
    t0=$(date +%s.%N)
    c0=$(cpu_ticks "$SERVER_PID")
    sleep "$DURATION"
    t1=$(date +%s.%N)
    c1=$(cpu_ticks "$SERVER_PID")
    backend_ticks "$PG_DB" >"$OUT/$tag.pg.end"
    curl -sS --cacert "$data/ca.crt" "$SERVER_URL/metrics" >"$OUT/$tag.metrics.end"
    psql "$url" -qA -F $'\t' -c "SELECT calls, round(total_exec_time::numeric, 1) AS ms, rows, regexp_replace(query, '\s+', ' ', 'g') AS query FROM pg_stat_statements WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database()) ORDER BY calls DESC" >"$OUT/$tag.statements"
    echo "$t0 $c0 $t1 $c1" >"$OUT/$tag.cpu"
    echo "server CPU: $(python3 -c "print(round(($c1-$c0)/$CLK_TCK/($t1-$t0)*1000, 1))") ms/s over $(python3 -c "print(round($t1-$t0, 1))") s"
    if [ "$PERF_SECS" -gt 0 ]; then
        perf record -q -F 199 --call-graph dwarf,16384 -p "$SERVER_PID" -o "$WORK/$tag.perf.data" -- sleep "$PERF_SECS" >/dev/null 2>&1 || true
        perf script -i "$WORK/$tag.perf.data" -F comm,tid,ip,sym 2>/dev/null | c++filt | python3 "$BENCH_ROOT/scripts/bench-reconcilers-report.py" perf >"$OUT/$tag.perf" || true
        [ "${KEEP_PERF:-0}" = 1 ] && mv "$WORK/$tag.perf.data" "$OUT/" || rm -f "$WORK/$tag.perf.data"
    fi
    grep -c 'WARN\|ERROR' "$OUT/$tag.server.log" | sed 's/^/server log warnings and errors: /' || true
    stop_server
    drop_db
    rm -rf "$data"
}

if [ -z "$TEMPLATE" ]; then
    seed
else
    [ -n "${TEMPLATE_DATA:-}" ] || { echo "TEMPLATE needs TEMPLATE_DATA" >&2; exit 2; }
fi
for r in $(seq 1 "$RUNS"); do
    for pair in $BINS; do
        run "${pair%%=*}" "${pair#*=}" "$r"
    done
done

echo
echo "=== per reconciler; logs in $OUT ==="
python3 "$BENCH_ROOT/scripts/bench-reconcilers-report.py" report "$OUT" "$CLK_TCK" | tee "$OUT/report.txt"
