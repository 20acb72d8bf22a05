#!/usr/bin/env bash
# Idle cost of one real release `berth-agent`: registered with --register against a real
# release server, left alone with the default 30 s heartbeat interval for SECONDS (300).
# Samples the agent's VmRSS every 5 s and its CPU time (utime+stime) at the start and end of the
# window; prints median and max RSS and CPU % of one core.
#
#   scripts/bench-agent-idle.sh [SECONDS]      SKIP_BUILD=1 reuses target/release
set -euo pipefail

source "$(dirname "$0")/bench-lib.sh"

WINDOW=${1:-300}
OUT=${OUT:-"$BENCH_ROOT/target/bench-results/agent-idle-$(date -u +%Y%m%dT%H%M%SZ)"}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/berth-bench-idle.XXXXXX")
AGENT_PID=""
cleanup() {
    stop_pid "$AGENT_PID"
    stop_server
    rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

BENCH_BINS="berth berth-agent" bench_build berth-cli
mkdir -p "$OUT"
bench_machine | tee "$OUT/machine.txt"

start_server "$WORK/server" "$OUT/server.log"
ca="$WORK/server/ca.crt"
token_json=$(BERTH_TOKEN=$(cat "$WORK/server/admin.token") "$BIN/berth" --server "$SERVER_URL" \
    --ca-file "$ca" -o json token create --expires 10m)
token=$(jq -r .token <<<"$token_json")
fingerprint=$(jq -r .caFingerprint <<<"$token_json")

BERTH_REGISTRATION_TOKEN=$token "$BIN/berth-agent" --register --server "$SERVER_URL" \
    --ca-fingerprint "$fingerprint" --state-dir "$WORK/agent" --name bench-idle \
    2>"$OUT/agent.log" &
AGENT_PID=$!
deadline=$((SECONDS + 60))
until grep -q 'registered as' "$OUT/agent.log"; do
    kill -0 "$AGENT_PID" 2>/dev/null || { echo "the agent exited:" >&2; cat "$OUT/agent.log" >&2; exit 1; }
    [ "$SECONDS" -lt "$deadline" ] || { echo "the agent did not register within 60 s" >&2; exit 1; }
    sleep 0.2
done
echo "agent $AGENT_PID registered and running; measuring for $WINDOW s"

startup_ticks=$(cpu_ticks "$AGENT_PID")
start=$(date +%s.%N)
: >"$OUT/rss.samples"
while :; do
    kill -0 "$AGENT_PID" 2>/dev/null || { echo "the agent exited during the window:" >&2; tail "$OUT/agent.log" >&2; exit 1; }
    rss_kib "$AGENT_PID" >>"$OUT/rss.samples"
    elapsed=$(awk -v s="$start" -v n="$(date +%s.%N)" 'BEGIN {print n - s}')
    awk -v e="$elapsed" -v w="$WINDOW" 'BEGIN {exit !(e + 5 <= w)}' || break
    sleep 5
done
# Sleep out the remainder so the window is exactly WINDOW seconds.
sleep "$(awk -v s="$start" -v n="$(date +%s.%N)" -v w="$WINDOW" 'BEGIN {r = w - (n - s); print (r > 0 ? r : 0)}')"
end_ticks=$(cpu_ticks "$AGENT_PID")
end=$(date +%s.%N)
rss_kib "$AGENT_PID" >>"$OUT/rss.samples"
breakdown=$(awk '/^(RssAnon|RssFile|RssShmem):/ {printf "%s %s KiB, ", $1, $2}' "/proc/$AGENT_PID/status")
threads=$(awk '/^Threads:/ {print $2}' "/proc/$AGENT_PID/status")
heartbeats=$(curl -sS --cacert "$ca" "$SERVER_URL/metrics" | awk '/^berth_heartbeats_total/ {print $2}')

sort -n "$OUT/rss.samples" | awk -v ticks="$((end_ticks - startup_ticks))" -v clk="$CLK_TCK" \
    -v s="$start" -v e="$end" -v startup="$startup_ticks" -v hb="${heartbeats:-?}" \
    -v breakdown="$breakdown" -v threads="$threads" '
    { v[NR] = $1 }
    END {
        median = (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2
        window = e - s
        printf "window:        %.0f s, %d RSS samples, %s heartbeats stored by the server (whole run)\n", window, NR, hb
        printf "agent RSS:     median %d KiB (%.2f MiB), max %d KiB, min %d KiB\n", median, median / 1024, v[NR], v[1]
        printf "at the end:    %s%s threads\n", breakdown, threads
        printf "agent CPU:     %.2f s in the window = %.4f %% of one core (startup and registration before it: %.2f s)\n",
            ticks / clk, ticks / clk / window * 100, startup / clk
    }' | tee "$OUT/result.txt"
echo "results in $OUT"
