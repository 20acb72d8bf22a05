#!/usr/bin/env bash
# Idle cost of real release `berth-agent`s: each registered with --register against one real
# release server, then left alone with the default 30 s heartbeat interval (its mTLS session and
# task stream held) for SECONDS (300). Samples each agent's VmRSS every 5 s and its CPU time,
# utime+stime from /proc/PID/stat, at the start and end of the window (plus the on-CPU
# nanoseconds of its threads, /proc/PID/task/*/schedstat, per 60 s part of the window); prints
# median, min and max RSS, CPU % of one core, the binary's size, and where the resident pages are
# (/proc/PID/smaps summed per mapping: the binary, each library, heap, stack, other anonymous),
# and which crates' code the resident text pages hold (scripts/resident-pages.py).
#
# The agent measured is the shipped one: `--profile agent`, without the server feature, as
# scripts/package.sh builds it (AGENT_DIR, default target/agent); the server is $BIN/berth.
#
#   scripts/bench-agent-idle.sh [SECONDS]      SKIP_BUILD=1 reuses target/release and target/agent
#   BASE_BIN=DIR scripts/bench-agent-idle.sh   A/B: DIR/berth-agent ("base") runs beside
#                                              $AGENT_DIR/berth-agent ("new"), same server, same window
set -euo pipefail

source "$(dirname "$0")/bench-lib.sh"

WINDOW=${1:-300}
OUT=${OUT:-"$BENCH_ROOT/target/bench-results/agent-idle-$(date -u +%Y%m%dT%H%M%SZ)"}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/berth-bench-idle.XXXXXX")
AGENT_DIR=${AGENT_DIR:-"$BENCH_ROOT/target/agent"}
LABELS=(new)
AGENT_BINS=("$AGENT_DIR/berth-agent")
if [ -n "${BASE_BIN:-}" ]; then
    LABELS=(base new)
    AGENT_BINS=("$BASE_BIN/berth-agent" "$AGENT_DIR/berth-agent")
fi
AGENT_PIDS=()
cleanup() {
    for pid in "${AGENT_PIDS[@]}"; do stop_pid "$pid"; done
    stop_server
    rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

BENCH_BINS="berth" bench_build berth-cli
if [ "${SKIP_BUILD:-0}" != 1 ]; then
    (cd "$BENCH_ROOT" && cargo build --profile agent -p berth-cli --no-default-features --bin berth-agent)
fi
for b in "${AGENT_BINS[@]}"; do
    [ -x "$b" ] || { echo "missing $b" >&2; exit 1; }
done
mkdir -p "$OUT"
bench_machine | tee "$OUT/machine.txt"

# thread_ns PID: on-CPU nanoseconds of the process's live threads (schedstat's first field).
thread_ns() {
    cat /proc/"$1"/task/*/schedstat 2>/dev/null | awk '{s += $1} END {printf "%d\n", s}'
}

# rss_map PID: resident (and mapped) KiB per mapping in /proc/PID/smaps, summed by what is mapped.
rss_map() {
    local exe
    exe=$(readlink "/proc/$1/exe")
    awk -v exe="$exe" '
        /^[0-9a-f]+-[0-9a-f]+ / {
            path = $6; for (i = 7; i <= NF; i++) path = path " " $i
            if (path == exe || path == exe " (deleted)") name = "binary " $2
            else if (path == "") name = "anonymous (thread stacks, malloc arenas, mmaps)"
            else if (path ~ /^\//) { n = split(path, p, "/"); name = p[n] }
            else name = path
            next
        }
        /^Size:/ { size[name] += $2 }
        /^Rss:/ { rss[name] += $2 }
        END { for (n in rss) if (rss[n] > 0) printf "  %7d KiB  %s (of %d KiB mapped)\n", rss[n], n, size[n] }
    ' "/proc/$1/smaps" | sort -rn
}

start_server "$WORK/server" "$OUT/server.log"
ca="$WORK/server/ca.crt"
for i in "${!LABELS[@]}"; do
    label=${LABELS[$i]}
    token_json=$(BERTH_TOKEN=$(cat "$WORK/server/admin.token") "$BIN/berth" --server "$SERVER_URL" \
        --ca-file "$ca" -o json token create --expires 10m)
    token=$(jq -r .token <<<"$token_json")
    fingerprint=$(jq -r .caFingerprint <<<"$token_json")
    BERTH_REGISTRATION_TOKEN=$token "${AGENT_BINS[$i]}" --register --server "$SERVER_URL" \
        --ca-fingerprint "$fingerprint" --state-dir "$WORK/agent-$label" --name "bench-idle-$label" \
        2>"$OUT/agent-$label.log" &
    AGENT_PIDS+=($!)
done
deadline=$((SECONDS + 60))
for i in "${!LABELS[@]}"; do
    label=${LABELS[$i]}
    until grep -q 'registered as' "$OUT/agent-$label.log"; do
        kill -0 "${AGENT_PIDS[$i]}" 2>/dev/null || { echo "agent $label exited:" >&2; cat "$OUT/agent-$label.log" >&2; exit 1; }
        [ "$SECONDS" -lt "$deadline" ] || { echo "agent $label did not register within 60 s" >&2; exit 1; }
        sleep 0.2
    done
done
# Let the session, the first heartbeat and the task stream settle before the window opens.
sleep "${SETTLE:-5}"
echo "agents ${LABELS[*]} (pids ${AGENT_PIDS[*]}) registered and running; measuring for $WINDOW s"

declare -A start_ticks part_ns
for i in "${!LABELS[@]}"; do
    start_ticks[$i]=$(cpu_ticks "${AGENT_PIDS[$i]}")
    part_ns[$i]=$(thread_ns "${AGENT_PIDS[$i]}")
    : >"$OUT/rss-${LABELS[$i]}.samples"
    : >"$OUT/cpu-${LABELS[$i]}.parts"
done
start=$(date +%s.%N)
part_start=$start
sample() {
    for i in "${!LABELS[@]}"; do
        kill -0 "${AGENT_PIDS[$i]}" 2>/dev/null || { echo "agent ${LABELS[$i]} exited during the window:" >&2; tail "$OUT/agent-${LABELS[$i]}.log" >&2; exit 1; }
        rss_kib "${AGENT_PIDS[$i]}" >>"$OUT/rss-${LABELS[$i]}.samples"
    done
}
close_part() { # CPU % of one core of each agent's threads since the last part closed
    local now ns
    now=$(date +%s.%N)
    for i in "${!LABELS[@]}"; do
        ns=$(thread_ns "${AGENT_PIDS[$i]}")
        awk -v a="${part_ns[$i]}" -v b="$ns" -v s="$part_start" -v n="$now" \
            'BEGIN {printf "%.5f\n", (b - a) / 1e9 / (n - s) * 100}' >>"$OUT/cpu-${LABELS[$i]}.parts"
        part_ns[$i]=$ns
    done
    part_start=$now
}
while :; do
    sample
    elapsed=$(awk -v s="$start" -v n="$(date +%s.%N)" 'BEGIN {print n - s}')
    if awk -v e="$elapsed" -v p="$part_start" -v s="$start" 'BEGIN {exit !(e - (p - s) >= 60)}'; then
        close_part
    fi
    awk -v e="$elapsed" -v w="$WINDOW" 'BEGIN {exit !(e + 5 <= w)}' || break
    sleep 5
done
# Sleep out the remainder so the window is exactly WINDOW seconds.
sleep "$(awk -v s="$start" -v n="$(date +%s.%N)" -v w="$WINDOW" 'BEGIN {r = w - (n - s); print (r > 0 ? r : 0)}')"
declare -A end_ticks
for i in "${!LABELS[@]}"; do end_ticks[$i]=$(cpu_ticks "${AGENT_PIDS[$i]}"); done
end=$(date +%s.%N)
sample
heartbeats=$(curl -sS --cacert "$ca" "$SERVER_URL/metrics" | awk '/^berth_heartbeats_total/ {print $2}')

{
    printf "window: %.0f s; %s heartbeats stored by the server (whole run, all agents)\n" \
        "$(awk -v s="$start" -v e="$end" 'BEGIN {print e - s}')" "${heartbeats:-?}"
    for i in "${!LABELS[@]}"; do
        label=${LABELS[$i]}
        pid=${AGENT_PIDS[$i]}
        bin=${AGENT_BINS[$i]}
        echo
        echo "== $label: $bin"
        echo "binary:     $(stat -c %s "$bin") bytes ($(file -b "$bin" | grep -o 'not stripped\|stripped' | head -n1)); $(size "$bin" | awk 'NR == 2 {printf "text %d, data %d, bss %d bytes", $1, $2, $3}')"
        sort -n "$OUT/rss-$label.samples" | awk '
            { v[NR] = $1 }
            END {
                m = (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2
                printf "RSS:        median %d KiB (%.2f MiB), min %d, max %d KiB; %d samples\n", m, m / 1024, v[1], v[NR], NR
            }'
        sort -n "$OUT/cpu-$label.parts" | awk -v t="$((end_ticks[$i] - start_ticks[$i]))" -v clk="$CLK_TCK" \
            -v s="$start" -v e="$end" '
            { v[NR] = $1 }
            END {
                m = (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2
                printf "CPU:        %.2f s utime+stime in the window = %.4f %% of one core; per 60 s part (schedstat): median %.4f %%, max %.4f %% (%d parts)\n",
                    t / clk, t / clk / (e - s) * 100, m, v[NR], NR
            }'
        echo "status:     $(awk '/^(RssAnon|RssFile|RssShmem|VmStk|Threads):/ {printf "%s %s %s  ", $1, $2, $3}' "/proc/$pid/status")"
        echo "rollup:     $(awk '/^(Rss|Pss|Shared_Clean|Private_Clean|Private_Dirty|Anonymous):/ {printf "%s %s  ", $1, $2}' "/proc/$pid/smaps_rollup")"
        echo "resident pages by mapping:"
        rss_map "$pid"
        echo "resident text by crate (scripts/resident-pages.py):"
        python3 "$BENCH_ROOT/scripts/resident-pages.py" "$pid" 15 | sed 's/^/  /'
    done
} | tee "$OUT/result.txt"
echo "results in $OUT"
