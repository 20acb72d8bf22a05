#!/usr/bin/env bash
# Task-transport benchmarks against a real release `berth server`, on SQLite and PostgreSQL.
#
#   scripts/bench-tasks.sh                                  # everything, RUNS times each
#   SCENARIOS="verify pickup" DATABASES=sqlite RUNS=1 scripts/bench-tasks.sh
#
# Scenarios (each run gets a fresh server, data dir and, on PostgreSQL, a fresh database):
#   verify  result-signature verifications per second on one thread (no server)
#   pickup  AGENTS (100) agents, open loop RATE (100) tasks/s for DURATION (30) s
#   max     AGENTS agents, closed loop with CONCURRENCY (32) creators for DURATION s
#   idle    AGENTS agents at RATE tasks/s plus HB_AGENTS (10000) agents that only heartbeat
#           every 30 s and hold a long-poll open; HB_WARMUP (35) s unmeasured, HB_DURATION (60) s
#           measured. SQLite only (IDLE_DATABASES to change).
# Knobs: RUNS (3), DATABASES ("sqlite postgres"), SKIP_BUILD=1, OUT (results dir),
# REGISTER_CONCURRENCY (16).
# PostgreSQL is berth's benchmark cluster, set like production (`BERTH_PG_DURABLE=1
# scripts/postgres.sh`: fsync, synchronous_commit and full_page_writes on, 127.0.0.1:55433);
# PG_DURABLE=0 uses the tests' cluster instead (fsync off). PG_STATEMENTS=1 writes the run's
# pg_stat_statements (calls and time per statement) next to its log.
set -euo pipefail

source "$(dirname "$0")/bench-lib.sh"

RUNS=${RUNS:-3}
SCENARIOS=${SCENARIOS:-"verify pickup max idle"}
DATABASES=${DATABASES:-"sqlite postgres"}
IDLE_DATABASES=${IDLE_DATABASES:-sqlite}
AGENTS=${AGENTS:-100}
RATE=${RATE:-100}
DURATION=${DURATION:-30}
CONCURRENCY=${CONCURRENCY:-32}
HB_AGENTS=${HB_AGENTS:-10000}
HB_WARMUP=${HB_WARMUP:-35}
HB_DURATION=${HB_DURATION:-60}
REGISTER_CONCURRENCY=${REGISTER_CONCURRENCY:-16}
OUT=${OUT:-"$BENCH_ROOT/target/bench-results/tasks-$(date -u +%Y%m%dT%H%M%SZ)"}

WORK=$(mktemp -d "${TMPDIR:-/tmp}/berth-bench-tasks.XXXXXX")
SAMPLER_PID=""
cleanup() {
    stop_pid "$SAMPLER_PID"
    stop_server
    drop_db
    rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

BENCH_BINS="berth berth-bench" bench_build berth-cli berth-bench
# Every simulated agent is one socket in the server (HTTP/2) and one in berth-bench, which raises
# its own limit).
ulimit -n "$(ulimit -Hn)"
mkdir -p "$OUT"
{
    bench_machine
    echo "fd limit: $(ulimit -n)"
    echo "uptime:  $(uptime)"
} | tee "$OUT/machine.txt"

if [[ " $DATABASES $IDLE_DATABASES " == *" postgres "* ]] && [[ "$SCENARIOS" != "verify" ]]; then
    PG_ADMIN_URL=$(BERTH_PG_DURABLE=${PG_DURABLE:-1} bash "$BENCH_ROOT/scripts/postgres.sh" | tail -n 1)
    if [ "${PG_DURABLE:-1}" = 1 ]; then
        echo "PostgreSQL: $PG_ADMIN_URL (durable: fsync, synchronous_commit, full_page_writes on)"
    else
        echo "PostgreSQL: $PG_ADMIN_URL (berth's test cluster: fsync=off)"
    fi
fi

# sample PID FILE: every 2 s, "unix_time cpu_ticks rss_kib".
sample() {
    local pid=$1 file=$2
    while kill -0 "$pid" 2>/dev/null; do
        echo "$(date +%s.%N) $(cpu_ticks "$pid") $(rss_kib "$pid")" >>"$file"
        sleep 2
    done
}

# run NAME DB RUN BENCH-ARGS…
run() {
    local name=$1 db=$2 run=$3
    shift 3
    local tag="$name-$db-$run" data="$WORK/data-$name-$db-$run" extra=()
    echo
    echo "=== $tag: berth-bench $* ($(uptime | sed 's/.*load/load/')) ==="
    if [ "$db" = postgres ]; then
        create_db
        if [ "${PG_STATEMENTS:-0}" = 1 ]; then
            psql "$(db_url)" -qAt -c "CREATE EXTENSION IF NOT EXISTS pg_stat_statements; SELECT pg_stat_statements_reset()" >/dev/null
        fi
        extra=(--database "$(db_url)")
    fi
    start_server "$data" "$OUT/$tag.server.log" "${extra[@]}"
    sample "$SERVER_PID" "$OUT/$tag.samples" &
    SAMPLER_PID=$!
    echo "uptime before: $(uptime)" >"$OUT/$tag.log"
    BERTH_TOKEN=$(cat "$data/admin.token") "$BIN/berth-bench" tasks "$@" \
        --server "$SERVER_URL" --ca-file "$data/ca.crt" \
        --concurrency-register "$REGISTER_CONCURRENCY" --name-prefix "$tag" | tee -a "$OUT/$tag.log"
    echo "uptime after: $(uptime)" | tee -a "$OUT/$tag.log"
    curl -sS --cacert "$data/ca.crt" "$SERVER_URL/metrics" >"$OUT/$tag.metrics" || true
    if [ "$db" = postgres ] && [ "${PG_STATEMENTS:-0}" = 1 ]; then
        psql "$(db_url)" -qA -F $'\t' -c "SELECT calls, round(total_exec_time::numeric, 1) AS ms, rows, query FROM pg_stat_statements WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database()) ORDER BY calls DESC" >"$OUT/$tag.statements" || true
    fi
    stop_pid "$SAMPLER_PID"
    SAMPLER_PID=""
    stop_server
    drop_db
    rm -rf "$data"
}

for scenario in $SCENARIOS; do
    case $scenario in
        verify)
            echo
            echo "=== verify ($(uptime | sed 's/.*load/load/')) ==="
            "$BIN/berth-bench" verify --seconds 3 --runs "$RUNS" | tee "$OUT/verify.log"
            continue
            ;;
        idle) dbs=$IDLE_DATABASES ;;
        *) dbs=$DATABASES ;;
    esac
    for db in $dbs; do
        for r in $(seq 1 "$RUNS"); do
            case $scenario in
                pickup) run pickup "$db" "$r" --agents "$AGENTS" --rate "$RATE" --duration-secs "$DURATION" ;;
                max) run max "$db" "$r" --agents "$AGENTS" --rate 0 --concurrency "$CONCURRENCY" --duration-secs "$DURATION" ;;
                idle) run idle "$db" "$r" --agents "$AGENTS" --rate "$RATE" --heartbeat-agents "$HB_AGENTS" \
                    --warmup-secs "$HB_WARMUP" --duration-secs "$HB_DURATION" --drain-secs 10 ;;
                *) echo "unknown scenario $scenario (verify, pickup, max, idle)" >&2; exit 2 ;;
            esac
        done
    done
done

echo
echo "=== medians over the runs; logs in $OUT ==="
python3 - "$OUT" "$CLK_TCK" <<'EOF'
import glob, json, os, re, statistics, sys

out, clk = sys.argv[1], int(sys.argv[2])

def summary(log):
    for line in open(log):
        if line.startswith("SUMMARY "):
            return json.loads(line[len("SUMMARY "):])

def server_cpu(samples_file, window):
    rows = [tuple(map(float, l.split())) for l in open(samples_file) if len(l.split()) == 3]
    if len(rows) < 2:
        return None
    end = rows[-1]
    start = min(rows[:-1], key=lambda r: abs(r[0] - (end[0] - window)))
    return (end[1] - start[1]) / clk / max(end[0] - start[0], 1e-9) * 100

def med(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else float("nan")

groups = {}
for log in sorted(glob.glob(os.path.join(out, "*-*-*.log"))):
    if log.endswith(".server.log"):
        continue
    m = re.match(r"(\w+)-(\w+)-(\d+)\.log$", os.path.basename(log))
    s = summary(log)
    if m and s:
        cpu = server_cpu(log[:-4] + ".samples", s["duration_secs"])
        groups.setdefault((m.group(1), m.group(2)), []).append((s, cpu))

for (scenario, db), runs in groups.items():
    g = lambda f: med([f(s, c) for s, c in runs])
    lat = lambda k, p: g(lambda s, c: s[k][p])
    print(f"{scenario} on {db}: {len(runs)} run(s), {runs[0][0]['agents']} agents, "
          f"{runs[0][0]['heartbeat_agents']} heartbeat-only, rate {runs[0][0]['rate']}")
    print(f"  created {g(lambda s, c: s['create_per_sec']):.1f}/s, succeeded {g(lambda s, c: s['throughput_per_sec']):.1f}/s, "
          f"errors {g(lambda s, c: s['errors']):.0f}, heartbeat errors {g(lambda s, c: s['heartbeat_errors']):.0f}")
    print(f"  pickup p50 {lat('pickup','p50_ms'):.2f} p90 {lat('pickup','p90_ms'):.2f} p99 {lat('pickup','p99_ms'):.2f} "
          f"max {lat('pickup','max_ms'):.2f} ms")
    print(f"  end-to-end p50 {lat('end_to_end','p50_ms'):.2f} p99 {lat('end_to_end','p99_ms'):.2f} ms; "
          f"create p50 {lat('create','p50_ms'):.2f} p99 {lat('create','p99_ms'):.2f} ms; "
          f"submit p50 {lat('submit','p50_ms'):.2f} p99 {lat('submit','p99_ms'):.2f} ms")
    if runs[0][0]["heartbeat"]["count"]:
        print(f"  heartbeat p50 {lat('heartbeat','p50_ms'):.2f} p99 {lat('heartbeat','p99_ms'):.2f} max {lat('heartbeat','max_ms'):.2f} ms "
              f"(n={g(lambda s, c: s['heartbeat']['count']):.0f})")
    print(f"  server CPU {g(lambda s, c: c):.0f} % of a core; berth-bench {g(lambda s, c: s['cpu']['bench_pct_of_core']):.0f} %; "
          f"machine busy {g(lambda s, c: s['cpu']['machine_busy_pct']):.0f} %")
EOF
