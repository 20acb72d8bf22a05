#!/usr/bin/env bash
# Event delivery over SSE (`GET /api/v1/events`) against a real release `berth server`:
# `berth-bench events`, CLIENTS (100) clients against BASELINE (1) in the same invocation,
# alternating for ROUNDS (3) rounds, tasks created at RATE (20)/s for DURATION (20) s per case.
#
#   scripts/bench-events.sh                          # SQLite and PostgreSQL
#   DATABASES=sqlite SKIP_BUILD=1 scripts/bench-events.sh
#
# One fresh server (and, on PostgreSQL, a fresh database) per database. PostgreSQL is berth's
# test cluster (scripts/postgres.sh: fsync=off, synchronous_commit=off). Logs go to OUT.
set -euo pipefail

source "$(dirname "$0")/bench-lib.sh"

DATABASES=${DATABASES:-"sqlite postgres"}
CLIENTS=${CLIENTS:-100}
BASELINE=${BASELINE:-1}
ROUNDS=${ROUNDS:-3}
RATE=${RATE:-20}
DURATION=${DURATION:-20}
OUT=${OUT:-"$BENCH_ROOT/target/bench-results/events-$(date -u +%Y%m%dT%H%M%SZ)"}

WORK=$(mktemp -d "${TMPDIR:-/tmp}/berth-bench-events.XXXXXX")
cleanup() {
    stop_server
    drop_db
    rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

BENCH_BINS="berth berth-bench" bench_build berth-cli berth-bench
mkdir -p "$OUT"
bench_machine | tee "$OUT/machine.txt"

for db in $DATABASES; do
    extra=()
    if [ "$db" = postgres ]; then
        [ -n "$PG_ADMIN_URL" ] || PG_ADMIN_URL=$(bash "$BENCH_ROOT/scripts/postgres.sh" | tail -n 1)
        create_db
        extra=(--database "$(db_url)")
    fi
    echo
    echo "=== events on $db ($(uptime | sed 's/.*load/load/')) ==="
    start_server "$WORK/data-$db" "$OUT/$db.server.log" "${extra[@]}"
    BERTH_TOKEN=$(cat "$WORK/data-$db/admin.token") "$BIN/berth-bench" events \
        --server "$SERVER_URL" --ca-file "$WORK/data-$db/ca.crt" --name-prefix "events-$db" \
        --clients "$CLIENTS" --baseline-clients "$BASELINE" --rounds "$ROUNDS" \
        --rate "$RATE" --duration-secs "$DURATION" | tee "$OUT/$db.log"
    stop_server
    drop_db
done
echo "logs in $OUT"
