#!/usr/bin/env bash
# The web UI, measured by headless Chromium itself (`berth-bench ui`, release builds) against a
# release `berth server` (SQLite) holding AGENTS (10000) registered agents:
#
#   agents page   time to first byte of `/agents` (its first page of 50 rows, read from the
#                 store and rendered by maud), against the same 50 rows from the JSON API
#                 (`/api/v1/agents?limit=50`) fetched by the same page, alternating, ROUNDS (50)
#                 each; Navigation/Resource Timing `responseStart - requestStart`.
#   event to DOM  a task created through the admin API every 700 ms, EVENTS (100) of them; from
#                 the `createdAt` of its `task.state` event (stamped in the commit) to its row in
#                 the tasks page's DOM (app.js refetches and swaps <main>), against the same
#                 event reaching a plain EventSource in that page (the baseline).
#
#   scripts/bench-ui.sh
#   AGENTS=1000 EVENTS=50 SKIP_BUILD=1 scripts/bench-ui.sh
#
# Needs `chromium` and `chromium-driver` (scripts/test.sh installs them). Everything it starts
# (server, chromedriver and its browser) and its temp dir go with the run.
set -euo pipefail

source "$(dirname "$0")/bench-lib.sh"

AGENTS=${AGENTS:-10000}
ROUNDS=${ROUNDS:-50}
EVENTS=${EVENTS:-100}
command -v chromedriver >/dev/null || { echo "chromedriver is missing: apt-get install chromium chromium-driver" >&2; exit 1; }
BENCH_BINS="berth berth-bench" bench_build berth-cli berth-bench

WORK=$(mktemp -d "${TMPDIR:-/tmp}/berth-bench-ui.XXXXXX")
DRIVER_PID=""
cleanup() {
    # chromedriver leads its own process group, with the Chromium it started.
    [ -z "$DRIVER_PID" ] || kill -KILL -- "-$DRIVER_PID" 2>/dev/null || true
    stop_server
    rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

echo "command: AGENTS=$AGENTS ROUNDS=$ROUNDS EVENTS=$EVENTS scripts/bench-ui.sh"
bench_machine
echo "browser: $(chromium --version 2>/dev/null || echo unknown)"

PORT=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
setsid chromedriver --port="$PORT" --allowed-ips=127.0.0.1 >"$WORK/chromedriver.log" 2>&1 &
DRIVER_PID=$!
disown "$DRIVER_PID"
start_server "$WORK/data" "$WORK/server.log"
for _ in $(seq 1 100); do
    curl -fsS "http://127.0.0.1:$PORT/status" >/dev/null 2>&1 && break
    sleep 0.1
done
BERTH_TOKEN=$(cat "$WORK/data/admin.token") "$BIN/berth-bench" ui \
    --server "$SERVER_URL" --ca-file "$WORK/data/ca.crt" --name-prefix ui \
    --agents "$AGENTS" --rounds "$ROUNDS" --events "$EVENTS" \
    --webdriver "http://127.0.0.1:$PORT"
