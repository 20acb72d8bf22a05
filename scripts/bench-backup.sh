#!/usr/bin/env bash
# `berth backup` of a large SQLite database, against copying the same file, side by side.
#
#   scripts/bench-backup.sh                        # builds target/release first
#   SKIP_BUILD=1 TASKS=200000 RUNS=1 scripts/bench-backup.sh
#
# A release server runs simulated agents for a few seconds (real finished tasks, each with its
# attempt); stopped, its database is grown to TASKS (1,000,000) tasks by copying those rows
# under fresh ids; started again, it stays up (live) while each of RUNS (3) rounds times
#   cp + sync   the database file copied and flushed: the I/O floor (not a consistent copy);
#   backup      `berth backup` with a passphrase: SQLite's online backup, the key material,
#               the tar stream, age encryption (scrypt's ~1 s key derivation included), fsync.
set -euo pipefail

source "$(dirname "$0")/bench-lib.sh"

TASKS=${TASKS:-1000000}
RUNS=${RUNS:-3}
OUT=${OUT:-"$BENCH_ROOT/target/bench-results/backup-$(date -u +%Y%m%dT%H%M%SZ)"}

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
seed_large_db "$data" "$TASKS"

start_server "$data" "$OUT/server.log"
db_bytes=$(stat -c %s "$data/berth.db")
for r in $(seq 1 "$RUNS"); do
    start=$(date +%s.%N)
    cp "$data/berth.db" "$WORK/copy.db" && sync "$WORK/copy.db"
    echo "cp $(awk "BEGIN {print $(date +%s.%N) - $start}")" | tee -a "$OUT/times"
    rm -f "$WORK/copy.db"
    start=$(date +%s.%N)
    BERTH_BACKUP_PASSPHRASE=bench "$BIN/berth" backup "$WORK/berth.age" --data-dir "$data" >/dev/null
    echo "backup $(awk "BEGIN {print $(date +%s.%N) - $start}") $(stat -c %s "$WORK/berth.age")" | tee -a "$OUT/times"
    rm -f "$WORK/berth.age"
done

echo
echo "=== medians over $RUNS run(s), database $db_bytes bytes ($TASKS tasks); results in $OUT ==="
python3 - "$OUT/times" "$db_bytes" <<'EOF'
import statistics, sys
rows = [l.split() for l in open(sys.argv[1])]
cp = statistics.median(float(r[1]) for r in rows if r[0] == "cp")
backup = statistics.median(float(r[1]) for r in rows if r[0] == "backup")
size = statistics.median(int(r[2]) for r in rows if r[0] == "backup")
db = int(sys.argv[2])
print(f"  cp + sync of the database: {cp:.2f} s ({db / cp / 2**20:.0f} MiB/s)")
print(f"  berth backup (live):       {backup:.2f} s ({db / backup / 2**20:.0f} MiB/s of database), "
      f"{backup / cp:.1f}x the copy")
print(f"  backup file: {size / 2**20:.1f} MiB for a {db / 2**20:.1f} MiB database")
EOF
