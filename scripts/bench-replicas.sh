#!/usr/bin/env bash
# One replica against two, on one durable PostgreSQL (issue 15 item 2), side by side per run.
#
#   scripts/bench-replicas.sh                 # RUNS (3) of each, DURATION (30) s measured
#   SKIP_BUILD=1 BIN=target/release RUNS=1 scripts/bench-replicas.sh
#
# one: a release `berth server` on the benchmark cluster (`BERTH_PG_DURABLE=1
#      scripts/postgres.sh`: fsync, synchronous_commit and full_page_writes on), AGENTS (100)
#      agents and CONCURRENCY (32) closed-loop creators (`berth-bench tasks`).
# two: two replicas on one database (the second with the first's key material, as README's
#      "Several replicas" says), and two `berth-bench tasks` at once, each with half the agents
#      and half the creators on its own replica: no load balancer, the load spread over both.
# For each: tasks/s (the two benches' sum), each replica's CPU and PostgreSQL's (all of the
# cluster's processes), as % of a core and as CPU ms per task.
set -euo pipefail

source "$(dirname "$0")/bench-lib.sh"

RUNS=${RUNS:-3}
AGENTS=${AGENTS:-100}
CONCURRENCY=${CONCURRENCY:-32}
DURATION=${DURATION:-30}
OUT=${OUT:-"$BENCH_ROOT/target/bench-results/replicas-$(date -u +%Y%m%dT%H%M%SZ)"}

WORK=$(mktemp -d "${TMPDIR:-/tmp}/berth-bench-replicas.XXXXXX")
PIDS=()
cleanup() {
    # SERVER_PID too: a replica that failed to start is not in PIDS yet.
    for pid in "${PIDS[@]}" "${SERVER_PID:-}"; do stop_pid "$pid"; done
    drop_db
    rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

BENCH_BINS="berth berth-bench" bench_build berth-cli berth-bench
ulimit -n "$(ulimit -Hn)"
mkdir -p "$OUT"
PG_ADMIN_URL=$(BERTH_PG_DURABLE=1 bash "$BENCH_ROOT/scripts/postgres.sh" | tail -n 1)
PG_DATA=/tmp/berth-pg-durable/data
{
    bench_machine
    echo "PostgreSQL: $PG_ADMIN_URL (durable: fsync, synchronous_commit, full_page_writes on)"
} | tee "$OUT/machine.txt"

# The CPU ticks of every process of the benchmark cluster (the postmaster and its children).
pg_ticks() {
    local master total=0 pid
    master=$(head -n 1 "$PG_DATA/postmaster.pid")
    for pid in $master $(pgrep -P "$master"); do
        total=$((total + $(cpu_ticks "$pid" 2>/dev/null || echo 0)))
    done
    echo "$total"
}

# replica DATA_DIR LOG: starts one on the run's database; appends its pid to PIDS.
replica() {
    start_server "$1" "$2" --database "$(db_url)"
    PIDS+=("$SERVER_PID")
}

# bench TAG URL DATA_DIR AGENTS CONCURRENCY: one berth-bench against one replica (background).
bench() {
    BERTH_TOKEN=$(cat "$WORK/a/admin.token") "$BIN/berth-bench" tasks \
        --agents "$4" --rate 0 --concurrency "$5" --duration-secs "$DURATION" \
        --server "$2" --ca-file "$3/ca.crt" --name-prefix "$1" >"$OUT/$1.log" 2>&1 &
}

# The CPU ticks of pids $@ (servers), summed.
ticks_of() {
    local total=0 pid
    for pid in "$@"; do total=$((total + $(cpu_ticks "$pid"))); done
    echo "$total"
}

for r in $(seq 1 "$RUNS"); do
    for mode in one two; do
        tag="$mode-$r"
        echo
        echo "=== $tag ($(uptime | sed 's/.*load/load/')) ==="
        create_db
        replica "$WORK/a" "$OUT/$tag.a.server.log"
        url_a=$SERVER_URL
        benches=()
        if [ "$mode" = one ]; then
            bench "$tag-a" "$url_a" "$WORK/a" "$AGENTS" "$CONCURRENCY"
            benches+=($!)
        else
            mkdir -p "$WORK/b"
            chmod 700 "$WORK/b"
            # admin.token only so that start_server finds it: the second replica writes none (the
            # database has its operator token already).
            for f in ca.crt ca.key jwt.key registry-token.key registry-token.crt master.key sealing.key admin.token; do
                cp -p "$WORK/a/$f" "$WORK/b/$f"
            done
            replica "$WORK/b" "$OUT/$tag.b.server.log"
            url_b=$SERVER_URL
            bench "$tag-a" "$url_a" "$WORK/a" $((AGENTS / 2)) $((CONCURRENCY / 2))
            benches+=($!)
            bench "$tag-b" "$url_b" "$WORK/b" $((AGENTS / 2)) $((CONCURRENCY / 2))
            benches+=($!)
        fi
        # CPU over the measured window: from the end of the last bench's 5 s warm-up (after its
        # sessions) to 2 s before the first one's measurement ends.
        sides=(a)
        [ "$mode" = one ] || sides=(a b)
        for side in "${sides[@]}"; do
            until grep -q "sessions acquired" "$OUT/$tag-$side.log" 2>/dev/null; do sleep 0.2; done
        done
        sleep 5
        t0=$(date +%s.%N); s0=$(ticks_of "${PIDS[@]}"); p0=$(pg_ticks)
        per0=(); for pid in "${PIDS[@]}"; do per0+=("$(cpu_ticks "$pid")"); done
        sleep $((DURATION - 2))
        t1=$(date +%s.%N); s1=$(ticks_of "${PIDS[@]}"); p1=$(pg_ticks)
        per1=(); for pid in "${PIDS[@]}"; do per1+=("$(cpu_ticks "$pid")"); done
        for b in "${benches[@]}"; do wait "$b"; done
        python3 - "$OUT" "$tag" "$CLK_TCK" "$t0" "$t1" "$p0" "$p1" "${per0[*]}" "${per1[*]}" <<'EOF' | tee "$OUT/$tag.summary"
import glob, json, sys
out, tag, clk, t0, t1, p0, p1, per0, per1 = sys.argv[1:]
clk, secs = int(clk), float(t1) - float(t0)
summaries = []
for log in sorted(glob.glob(f"{out}/{tag}-?.log")):
    for line in open(log):
        if line.startswith("SUMMARY "):
            summaries.append(json.loads(line[len("SUMMARY "):]))
rate = sum(s["throughput_per_sec"] for s in summaries)
errors = sum(s["errors"] for s in summaries)
pct = lambda a, b: (int(b) - int(a)) / clk / secs * 100
servers = [pct(a, b) for a, b in zip(per0.split(), per1.split())]
pg = pct(p0, p1)
ms = lambda p: p / 100 * 1000 / rate if rate else float("nan")
print(f"RESULT {json.dumps({'tag': tag, 'tasks_per_sec': rate, 'errors': errors, 'server_pct': servers, 'postgres_pct': pg, 'server_ms_per_task': [ms(p) for p in servers], 'postgres_ms_per_task': ms(pg)})}")
EOF
        for pid in "${PIDS[@]}"; do stop_pid "$pid"; done
        PIDS=()
        drop_db
        rm -rf "$WORK/a" "$WORK/b"
    done
done

echo
echo "=== medians over the runs; logs in $OUT ==="
python3 - "$OUT" <<'EOF'
import glob, json, statistics, sys
out = sys.argv[1]
runs = {"one": [], "two": []}
for f in glob.glob(f"{out}/*.summary"):
    for line in open(f):
        if line.startswith("RESULT "):
            r = json.loads(line[len("RESULT "):])
            runs[r["tag"].split("-")[0]].append(r)
med = lambda xs: statistics.median(xs) if xs else float("nan")
for mode, rs in runs.items():
    print(f"{mode}: {len(rs)} run(s), tasks/s {[round(r['tasks_per_sec']) for r in rs]}, median {med([r['tasks_per_sec'] for r in rs]):.0f}; "
          f"errors {sum(r['errors'] for r in rs)}")
    print(f"  per replica: CPU {med([sum(r['server_pct']) / len(r['server_pct']) for r in rs]):.0f} % of a core, "
          f"{med([sum(r['server_ms_per_task']) for r in rs]):.3f} ms of server CPU per task (all replicas); "
          f"PostgreSQL {med([r['postgres_pct'] for r in rs]):.0f} %, {med([r['postgres_ms_per_task'] for r in rs]):.3f} ms per task")
one, two = med([r["tasks_per_sec"] for r in runs["one"]]), med([r["tasks_per_sec"] for r in runs["two"]])
if one == one and two == two and one:
    print(f"two replicas / one: {two / one:.2f}x")
EOF
