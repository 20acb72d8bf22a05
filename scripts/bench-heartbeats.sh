#!/usr/bin/env bash
# Heartbeat and registration benchmarks against a real release `berth server` on SQLite.
#
#   scripts/bench-heartbeats.sh            # both scenarios, RUNS times each
#   SCENARIOS=open RUNS=1 scripts/bench-heartbeats.sh
#
# Scenarios (each run gets a fresh server and data dir):
#   open    AGENTS (10000) simulated agents heartbeat every INTERVAL (30) s at random phases;
#           DURATION (60) s are measured after the first interval, which opens the connections.
#   closed  TP_AGENTS (200) agents heartbeat back to back for TP_DURATION (30) s: max throughput.
# Knobs: RUNS (3), REGISTER_CONCURRENCY (16), SKIP_BUILD=1 to reuse target/release, OUT (results dir).
set -euo pipefail

source "$(dirname "$0")/bench-lib.sh"

RUNS=${RUNS:-3}
SCENARIOS=${SCENARIOS:-"open closed"}
AGENTS=${AGENTS:-10000}
INTERVAL=${INTERVAL:-30}
DURATION=${DURATION:-60}
TP_AGENTS=${TP_AGENTS:-200}
TP_DURATION=${TP_DURATION:-30}
REGISTER_CONCURRENCY=${REGISTER_CONCURRENCY:-16}
OUT=${OUT:-"$BENCH_ROOT/target/bench-results/heartbeats-$(date -u +%Y%m%dT%H%M%SZ)"}

WORK=$(mktemp -d "${TMPDIR:-/tmp}/berth-bench.XXXXXX")
SAMPLER_PID=""
cleanup() {
    stop_pid "$SAMPLER_PID"
    stop_server
    rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

BENCH_BINS="berth berth-bench" bench_build berth-cli berth-bench
# 10,000 agents are 10,000 sockets in the server (and in berth-bench, which raises its own).
ulimit -n "$(ulimit -Hn)"
mkdir -p "$OUT"
{
    bench_machine
    echo "fd limit: $(ulimit -n) (server, after ulimit -n to the hard limit)"
} | tee "$OUT/machine.txt"

# sample PID PORT FILE: every 2 s, "unix_time cpu_ticks rss_kib established_connections".
sample() {
    local pid=$1 port=$2 file=$3
    while kill -0 "$pid" 2>/dev/null; do
        echo "$(date +%s.%N) $(cpu_ticks "$pid") $(rss_kib "$pid") $(ss -Htn state established "( sport = :$port )" | wc -l)" >>"$file"
        sleep 2
    done
}

# run NAME RUN BENCH-ARGS…
run() {
    local name=$1 run=$2
    shift 2
    local data="$WORK/data-$name-$run" tag="$name-$run"
    echo
    echo "=== $tag: berth-bench $* ==="
    # Every simulated agent connects from 127.0.0.1: lift the per-source cap (1000 by default).
    start_server "$data" "$OUT/$tag.server.log" --heartbeat-interval-secs "$INTERVAL" \
        --max-connections-per-source 0
    local port=${SERVER_URL##*:}
    sample "$SERVER_PID" "$port" "$OUT/$tag.samples" &
    SAMPLER_PID=$!
    BERTH_TOKEN=$(cat "$data/admin.token") "$BIN/berth-bench" "$@" \
        --server "$SERVER_URL" --ca-file "$data/ca.crt" \
        --concurrency-register "$REGISTER_CONCURRENCY" --name-prefix "$tag" | tee "$OUT/$tag.log"
    curl -sS --cacert "$data/ca.crt" "$SERVER_URL/metrics" >"$OUT/$tag.metrics"
    echo "server /metrics after the run (curl --cacert):"
    grep -E '^berth_(heartbeat_batch_size|heartbeats_total)' "$OUT/$tag.metrics" || true
    stop_pid "$SAMPLER_PID"
    SAMPLER_PID=""
    stop_server
    rm -rf "$data"
}

for scenario in $SCENARIOS; do
    for r in $(seq 1 "$RUNS"); do
        case $scenario in
            open) run open "$r" heartbeats --agents "$AGENTS" --interval-secs "$INTERVAL" --duration-secs "$DURATION" ;;
            closed) run closed "$r" throughput --agents "$TP_AGENTS" --duration-secs "$TP_DURATION" ;;
            *) echo "unknown scenario $scenario (open, closed)" >&2; exit 2 ;;
        esac
    done
done

echo
echo "=== medians over $RUNS run(s); logs in $OUT ==="
python3 - "$OUT" "$CLK_TCK" "$DURATION" "$TP_DURATION" <<'EOF'
import glob, json, os, statistics, sys

out, clk, duration, tp_duration = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])

def summary(log):
    for line in open(log):
        if line.startswith("SUMMARY "):
            return json.loads(line[len("SUMMARY "):])

def server_usage(samples_file, window):
    """Server CPU % of one core over the last `window` s of the run, peak RSS and connections."""
    rows = [tuple(map(float, l.split())) for l in open(samples_file) if len(l.split()) == 4]
    if len(rows) < 2:
        return None
    end = rows[-1]
    start = min(rows[:-1], key=lambda r: abs(r[0] - (end[0] - window)))
    cpu = (end[1] - start[1]) / clk / max(end[0] - start[0], 1e-9) * 100
    return {"cpu_pct": cpu, "rss_mib": max(r[2] for r in rows) / 1024, "conns": max(r[3] for r in rows)}

def med(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else float("nan")

for scenario, window in (("open", duration), ("closed", tp_duration)):
    logs = sorted(l for l in glob.glob(os.path.join(out, f"{scenario}-*.log")) if not l.endswith(".server.log"))
    runs = [(summary(l), server_usage(l[:-4] + ".samples", window)) for l in logs]
    runs = [(s, u) for s, u in runs if s]
    if not runs:
        continue
    g = lambda f: med([f(s, u) for s, u in runs])
    reg = lambda k: g(lambda s, u: s["registration"]["register"][k])
    print(f"{scenario}: {len(runs)} run(s), {runs[0][0]['agents']} agents")
    print(f"  registration: {g(lambda s, u: s['registration']['per_sec']):.0f}/s, "
          f"p50 {reg('p50_ms'):.2f} ms, p99 {reg('p99_ms'):.2f} ms")
    if scenario == "open":
        lat = lambda k: g(lambda s, u: s["latency"][k])
        print(f"  offered {g(lambda s, u: s['offered_per_sec']):.1f}/s, achieved {g(lambda s, u: s['achieved_per_sec']):.1f}/s, "
              f"errors {g(lambda s, u: s['errors']):.0f}")
        print(f"  latency p50 {lat('p50_ms'):.2f} ms, p90 {lat('p90_ms'):.2f} ms, p99 {lat('p99_ms'):.2f} ms, max {lat('max_ms'):.2f} ms")
        print(f"  first heartbeat (TLS handshake) p50 {g(lambda s, u: s['first_heartbeat']['p50_ms']):.2f} ms, "
              f"p99 {g(lambda s, u: s['first_heartbeat']['p99_ms']):.2f} ms")
        print(f"  berth-bench memory per simulated agent: {g(lambda s, u: s['bench_rss_kib_per_agent']):.1f} KiB")
    else:
        lat = lambda k: g(lambda s, u: s["latency"][k])
        print(f"  throughput {g(lambda s, u: s['throughput_per_sec']):.0f}/s, p50 {lat('p50_ms'):.2f} ms, "
              f"p99 {lat('p99_ms'):.2f} ms, errors {g(lambda s, u: s['errors']):.0f}")
    print(f"  p99 per run: {', '.join('%.1f ms' % s['latency']['p99_ms'] for s, u in runs)}")
    print(f"  berth-bench CPU {g(lambda s, u: s['cpu']['bench_pct_of_core']):.1f} % of a core; "
          f"machine busy {g(lambda s, u: s['cpu']['machine_busy_pct']):.1f} % of {runs[0][0]['cpu']['cores']} cores (all processes)")
    b = lambda k: g(lambda s, u: (s.get("batches") or {}).get(k))
    print(f"  server commits: {b('batches'):.0f} for {b('heartbeats'):.0f} heartbeats, mean batch {b('mean_batch'):.2f}")
    print(f"  server: CPU {g(lambda s, u: u and u['cpu_pct']):.1f} % of a core (last {window} s), "
          f"peak RSS {g(lambda s, u: u and u['rss_mib']):.0f} MiB, peak connections {g(lambda s, u: u and u['conns']):.0f}")
    rate = (lambda s: s["achieved_per_sec"]) if scenario == "open" else (lambda s: s["throughput_per_sec"])
    print(f"  server CPU per heartbeat: {g(lambda s, u: u and u['cpu_pct'] / 100 * 1e6 / rate(s)):.0f} µs "
          f"(per run: {', '.join('%.0f' % (u['cpu_pct'] / 100 * 1e6 / rate(s)) for s, u in runs if u)})")
EOF
