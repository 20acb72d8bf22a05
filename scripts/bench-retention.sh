#!/usr/bin/env bash
# Retention: the time to prune TASKS (1,000,000) old finished tasks (each with its attempt) from
# a release server's SQLite database, and the task path's latency while it runs, side by side
# with the same load on the same database with retention off.
#
#   scripts/bench-retention.sh                       # builds target/release first
#   SKIP_BUILD=1 TASKS=200000 scripts/bench-retention.sh
#
# Simulated agents make real finished tasks; stopped, the database is grown to TASKS tasks
# whose times are 40 days old (scripts/grow-tasks.py), and copied. Then, one after the other:
#   off    the copy, --retention-days 0: `berth-bench tasks` (RATE/s, AGENTS agents, DURATION s);
#   prune  the original, default retention (30 days): the same load, started with the server,
#          while the first sweep deletes 500 rows per transaction with a 50 ms pause; the prune
#          time is from the server's start to its "retention: pruned" line.
set -euo pipefail

source "$(dirname "$0")/bench-lib.sh"

TASKS=${TASKS:-1000000}
RATE=${RATE:-100}
AGENTS=${AGENTS:-8}
DURATION=${DURATION:-60}
OUT=${OUT:-"$BENCH_ROOT/target/bench-results/retention-$(date -u +%Y%m%dT%H%M%SZ)"}

WORK=$(mktemp -d "${TMPDIR:-/tmp}/berth-bench.XXXXXX")
cleanup() {
    stop_server
    rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

BENCH_BINS="berth berth-bench" bench_build berth-cli berth-bench
mkdir -p "$OUT"
bench_machine | tee "$OUT/machine.txt"

data="$WORK/data"
seed_large_db "$data" "$TASKS" --age-days 40
cp -a "$data" "$WORK/off"

# load NAME: the task path under RATE/s for DURATION s against the running server.
load() {
    BERTH_TOKEN=$(cat "$2/admin.token") "$BIN/berth-bench" tasks --server "$SERVER_URL" \
        --ca-file "$2/ca.crt" --agents "$AGENTS" --rate "$RATE" --duration-secs "$DURATION" \
        --warmup-secs 5 --name-prefix "$1" >"$OUT/$1.log"
    grep '^SUMMARY ' "$OUT/$1.log" | cut -c9- >"$OUT/$1.json"
}

echo "=== off: retention disabled ==="
start_server "$WORK/off" "$OUT/server-off.log" --retention-days 0
load off "$WORK/off"
stop_server

echo "=== prune: the first sweep runs under the same load ==="
started=$(date +%s.%N)
start_server "$data" "$OUT/server-prune.log"
# Notes when the first sweep ends, while the load runs, and the largest WAL file seen.
(
    deadline=$((SECONDS + 1800))
    wal_max=0
    until grep -q 'retention: pruned' "$OUT/server-prune.log" || [ "$SECONDS" -ge "$deadline" ]; do
        wal=$(stat -c %s "$data/berth.db-wal" 2>/dev/null || echo 0)
        [ "$wal" -gt "$wal_max" ] && wal_max=$wal
        sleep 0.2
    done
    date +%s.%N >"$WORK/pruned_at"
    echo "$wal_max" >"$OUT/wal_max_bytes"
) &
watcher=$!
load prune "$data"
wait "$watcher"
grep -q 'retention: pruned' "$OUT/server-prune.log" || { echo "no prune within 30 min" >&2; exit 1; }
pruned=$(awk "BEGIN {print $(cat "$WORK/pruned_at") - $started}")
echo "prune: ${pruned} s; $(grep -o 'tasks=[0-9]* events=[0-9]*' "$OUT/server-prune.log" | head -n1)"
echo "largest WAL file during the prune: $(cat "$OUT/wal_max_bytes") bytes"
stop_server

python3 - "$OUT" "$pruned" <<'EOF'
import json, sys
out, pruned = sys.argv[1], float(sys.argv[2])
runs = {name: json.load(open(f"{out}/{name}.json")) for name in ("off", "prune")}
print(f"\n=== {out} ===")
print("| | retention off | first prune running | ratio |")
print("|---|---|---|---|")
for key, label in (("create", "create"), ("end_to_end", "end to end")):
    for q in ("p50_ms", "p99_ms"):
        a, b = runs["off"][key][q], runs["prune"][key][q]
        print(f"| {label} {q[:-3]} (ms) | {a:.2f} | {b:.2f} | {b / a:.2f} |")
for r in runs.values():
    assert r["errors"] == 0, r
print(f"| throughput (tasks/s) | {runs['off']['throughput_per_sec']} | {runs['prune']['throughput_per_sec']} | |")
print(f"\nprune: {pruned:.0f} s from the server's start to its 'retention: pruned' line")
EOF
