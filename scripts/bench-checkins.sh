#!/usr/bin/env bash
# Seed 001 checkins at fleet scale against a real release `berth server` on SQLite.
#
#   scripts/bench-checkins.sh                 # 10,000 agents/environments, RUNS=1
#   AGENTS=2000 DURATION=30 SKIP_BUILD=1 scripts/bench-checkins.sh
#
# Each run (fresh server and data dir): AGENTS (10000) simulated agents register with the label
# env=<name>, one environment each (selector env=<name>), then `berth-bench checkins`:
#   open      every agent checks in every INTERVAL (60) s at a random phase = AGENTS/INTERVAL
#             per second; DURATION (60) s measured after the first interval.
#   closed    CONCURRENCY (200) checkins in flight, round-robin over all agents (each
#             environment's bucket is 6 a minute), CLOSED_DURATION (30) s.
#   baseline  the heartbeat closed loop of the first CONCURRENCY agents, same run, same length.
# Server CPU is sampled from /proc every 2 s and attributed to each phase's window.
# Knobs: RUNS (1), REGISTER_CONCURRENCY (16), SKIP_BUILD=1, OUT (results dir).
set -euo pipefail

source "$(dirname "$0")/bench-lib.sh"

RUNS=${RUNS:-1}
AGENTS=${AGENTS:-10000}
INTERVAL=${INTERVAL:-60}
DURATION=${DURATION:-60}
CONCURRENCY=${CONCURRENCY:-200}
CLOSED_DURATION=${CLOSED_DURATION:-30}
REGISTER_CONCURRENCY=${REGISTER_CONCURRENCY:-16}
OUT=${OUT:-"$BENCH_ROOT/target/bench-results/checkins-$(date -u +%Y%m%dT%H%M%SZ)"}

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
ulimit -n "$(ulimit -Hn)"
mkdir -p "$OUT"
{
    echo "command: AGENTS=$AGENTS INTERVAL=$INTERVAL DURATION=$DURATION CONCURRENCY=$CONCURRENCY CLOSED_DURATION=$CLOSED_DURATION RUNS=$RUNS scripts/bench-checkins.sh"
    bench_machine
    echo "fd limit: $(ulimit -n)"
} | tee "$OUT/machine.txt"

# sample PID FILE: every 2 s, "unix_time cpu_ticks rss_kib".
sample() {
    local pid=$1 file=$2
    while kill -0 "$pid" 2>/dev/null; do
        echo "$(date +%s.%N) $(cpu_ticks "$pid") $(rss_kib "$pid")" >>"$file"
        sleep 2
    done
}

for r in $(seq 1 "$RUNS"); do
    data="$WORK/data-$r" tag="checkins-$r"
    echo
    echo "=== $tag ==="
    # Every simulated agent connects from 127.0.0.1: the per-source cap (1000 by default)
    # would refuse all but the first thousand connections, which a real fleet spreads over
    # its hosts' addresses.
    start_server "$data" "$OUT/$tag.server.log" --max-connections-per-source "$((AGENTS + CONCURRENCY + 100))"
    sample "$SERVER_PID" "$OUT/$tag.samples" &
    SAMPLER_PID=$!
    BERTH_TOKEN=$(cat "$data/admin.token") "$BIN/berth-bench" checkins \
        --server "$SERVER_URL" --ca-file "$data/ca.crt" \
        --concurrency-register "$REGISTER_CONCURRENCY" --name-prefix "$tag" \
        --agents "$AGENTS" --interval-secs "$INTERVAL" --duration-secs "$DURATION" \
        --concurrency "$CONCURRENCY" --closed-duration-secs "$CLOSED_DURATION" | tee "$OUT/$tag.log"
    stop_pid "$SAMPLER_PID"
    SAMPLER_PID=""
    stop_server
    rm -rf "$data"
done

echo
echo "=== medians over $RUNS run(s); logs in $OUT ==="
python3 - "$OUT" "$CLK_TCK" <<'EOF'
import glob, json, os, statistics, sys

out, clk = sys.argv[1], int(sys.argv[2])

def summary(log):
    for line in open(log):
        if line.startswith("SUMMARY "):
            return json.loads(line[len("SUMMARY "):])

def server_cpu(rows, window):
    """Server CPU % of one core between the samples nearest the window's ends."""
    if not window or len(rows) < 2:
        return float("nan")
    a = min(rows, key=lambda r: abs(r[0] - window[0]))
    b = min(rows, key=lambda r: abs(r[0] - window[1]))
    return (b[1] - a[1]) / clk / max(b[0] - a[0], 1e-9) * 100 if b[0] > a[0] else float("nan")

runs = []
for log in sorted(l for l in glob.glob(os.path.join(out, "checkins-*.log")) if not l.endswith(".server.log")):
    s = summary(log)
    if not s:
        continue
    rows = [tuple(map(float, l.split())) for l in open(log[:-4] + ".samples") if len(l.split()) == 3]
    cpu = {k: server_cpu(rows, (s.get(k) or {}).get("window")) for k in ("open", "closed", "heartbeat_baseline")}
    runs.append((s, cpu, max((r[2] for r in rows), default=0) / 1024))
if not runs:
    sys.exit("no SUMMARY line")
med = lambda f: statistics.median([f(s, c, m) for s, c, m in runs])
s0 = runs[0][0]
print(f"{len(runs)} run(s), {s0['agents']} agents, {s0['environments']} environments")
print(f"  registration {med(lambda s, c, m: s['registration']['per_sec']):.0f}/s; "
      f"environments {med(lambda s, c, m: s['create_environment']['per_sec']):.0f}/s "
      f"(p50 {med(lambda s, c, m: s['create_environment']['latency']['p50_ms']):.2f} ms)")
if s0.get("open"):
    o = lambda k, sub=None: med(lambda s, c, m: s["open"][k] if sub is None else s["open"][k][sub])
    print(f"  open loop: offered {o('offered_per_sec'):.1f}/s, achieved {o('achieved_per_sec'):.1f}/s, "
          f"p50 {o('latency', 'p50_ms'):.2f} ms, p99 {o('latency', 'p99_ms'):.2f} ms, max {o('latency', 'max_ms'):.2f} ms, "
          f"429s {o('rate_limited'):.0f}, errors {o('errors'):.0f}; server CPU {med(lambda s, c, m: c['open']):.1f} % of a core")
for key, label in (("closed", "closed-loop checkins"), ("heartbeat_baseline", "closed-loop heartbeats (baseline)")):
    k = lambda f: med(lambda s, c, m: f(s[key]))
    extra = f", 429s {k(lambda x: x['rate_limited']):.0f}" if key == "closed" else ""
    print(f"  {label}: {k(lambda x: x['throughput_per_sec']):.0f}/s, p50 {k(lambda x: x['latency']['p50_ms']):.2f} ms, "
          f"p99 {k(lambda x: x['latency']['p99_ms']):.2f} ms, errors {k(lambda x: x['errors']):.0f}{extra}; "
          f"server CPU {med(lambda s, c, m: c[key]):.1f} % of a core, machine busy {k(lambda x: x['cpu']['machine_busy_pct']):.1f} %")
print(f"  checkins/heartbeats closed-loop ratio: "
      f"{med(lambda s, c, m: s['closed']['throughput_per_sec'] / max(s['heartbeat_baseline']['throughput_per_sec'], 1)):.2f}")
print(f"  server peak RSS {med(lambda s, c, m: m):.0f} MiB")
EOF
