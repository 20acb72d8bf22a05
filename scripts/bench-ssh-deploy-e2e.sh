#!/usr/bin/env bash
# `ssh.deploy` of a 10 MiB artifact plus a trivial deploy script through the whole stack, against
# `scp` + `ssh` by hand, side by side in one run, alternating, N rounds each, against the sshd of
# scripts/sshd.sh (loopback).
#
#   scripts/bench-ssh-deploy-e2e.sh              # N=7
#   N=5 SKIP_BUILD=1 scripts/bench-ssh-deploy-e2e.sh
#
#   berth    `berth task create --type ssh.deploy --wait` (release builds): the server queues
#            the task, the agent's long poll takes it, fetches both artifacts by sha256 from
#            the server (pushed once, before the rounds, as a release's files are), checks
#            them, connects (host key pinned), backs up, uploads over SFTP, runs the script,
#            writes the sticker, and its signed result is verified; the CLI returns when the
#            task is `succeeded`.
#   by hand  `scp` of both files, then `ssh … 'cd DIR && ./deploy.sh'`, the same key, the host
#            key pinned in a known_hosts file, BatchMode.
#
# The key is the test sshd's throwaway key; it is passed as the task's sealed credential.
# Everything it creates (server, agent, temp and deploy directories) goes with the run.
set -euo pipefail

source "$(dirname "$0")/bench-lib.sh"

N=${N:-7}
eval "$(bash "$BENCH_ROOT/scripts/sshd.sh" | grep '^export ')"
BENCH_BINS="berth berth-agent" bench_build berth-cli

WORK=$(mktemp -d "${TMPDIR:-/tmp}/berth-ssh-bench.XXXXXX")
REMOTE="$BERTH_TEST_SSH_WORKDIR/$(basename "$WORK")"
AGENT_PID=""
cleanup() {
    stop_pid "$AGENT_PID"
    stop_server
    rm -rf "$WORK" "$REMOTE"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

now_ms() { echo $(($(date +%s%N) / 1000000)); }

echo "command: N=$N scripts/bench-ssh-deploy-e2e.sh"
bench_machine
echo "openssh: $(ssh -V 2>&1)"

# --- the files: 10 MiB of random bytes and a script that checks them ---------------------------
head -c $((10 * 1024 * 1024)) /dev/urandom >"$WORK/artifact.bin"
printf '#!/bin/sh\nset -e\ntest -s artifact.bin\necho deployed > deployed.txt\n' >"$WORK/deploy.sh"
chmod 755 "$WORK/deploy.sh"
# Owned by the SSH user, as what it deploys into must be.
install -d -m 700 -o "$(stat -c %u "$BERTH_TEST_SSH_WORKDIR")" -g "$(stat -c %g "$BERTH_TEST_SSH_WORKDIR")" "$REMOTE"

# --- server and agent ------------------------------------------------------------------------
start_server "$WORK/data" "$WORK/server.log"
export BERTH_SERVER="$SERVER_URL" BERTH_CA_FILE="$WORK/data/ca.crt"
BERTH_TOKEN=$(cat "$WORK/data/admin.token")
export BERTH_TOKEN
TOKEN_JSON=$("$BIN/berth" token create -o json)
"$BIN/berth-agent" --state-dir "$WORK/agent" --register \
    --token "$(jq -r .token <<<"$TOKEN_JSON")" --server "$SERVER_URL" \
    --ca-fingerprint "$(jq -r .caFingerprint <<<"$TOKEN_JSON")" \
    --name bench-ssh --sticker-dir "$WORK/stickers" 2>"$WORK/agent.log" &
AGENT_PID=$!
AGENT_ID=""
for _ in $(seq 1 300); do
    AGENT_ID=$("$BIN/berth" agents ls -o json | jq -r '.[] | select(.name == "bench-ssh" and .status == "online") | .id' 2>/dev/null || true)
    [ -n "$AGENT_ID" ] && break
    sleep 0.2
done
[ -n "$AGENT_ID" ] || { echo "the agent did not come online:" >&2; cat "$WORK/agent.log" >&2; exit 1; }

t0=$(now_ms)
ART_SHA=$("$BIN/berth" artifact push "$WORK/artifact.bin")
PUSH_MS=$(($(now_ms) - t0))
SCRIPT_SHA=$("$BIN/berth" artifact push "$WORK/deploy.sh")
echo "artifact push (10 MiB, once, like a release's files): $PUSH_MS ms"

KNOWN="$WORK/known_hosts"
echo "[$BERTH_TEST_SSH_HOST]:$BERTH_TEST_SSH_PORT $BERTH_TEST_SSH_HOST_KEY" >"$KNOWN"
SSH_OPTS=(-i "$BERTH_TEST_SSH_KEY" -o BatchMode=yes -o "UserKnownHostsFile=$KNOWN" -o StrictHostKeyChecking=yes)

berth_round() {
    local dir=$1 payload
    payload=$(jq -cn --arg host "$BERTH_TEST_SSH_HOST" --argjson port "$BERTH_TEST_SSH_PORT" \
        --arg user "$BERTH_TEST_SSH_USER" --arg key "$BERTH_TEST_SSH_HOST_KEY" --arg dir "$dir" \
        --arg art "$ART_SHA" --arg script "$SCRIPT_SHA" \
        '{target: {host: $host, port: $port, user: $user, hostKey: $key}, deployDirectory: $dir,
          artifacts: [{name: "artifact.bin", sha256: $art}, {name: "deploy.sh", sha256: $script, executable: true}],
          script: {command: ["./deploy.sh"], timeout: 60}, sticker: {name: "bench"}}')
    local state
    state=$("$BIN/berth" task create --type ssh.deploy --agent "$AGENT_ID" --payload "$payload" \
        --timeout-secs 120 --credential "sshPrivateKey=$(cat "$BERTH_TEST_SSH_KEY")" --wait -o json |
        jq -r .state)
    [ "$state" = succeeded ] || { echo "ssh.deploy ended $state" >&2; exit 1; }
}

hand_round() {
    local dir=$1 target="$BERTH_TEST_SSH_USER@$BERTH_TEST_SSH_HOST"
    ssh "${SSH_OPTS[@]}" -p "$BERTH_TEST_SSH_PORT" "$target" "mkdir -p '$dir'"
    scp -q "${SSH_OPTS[@]}" -P "$BERTH_TEST_SSH_PORT" "$WORK/artifact.bin" "$WORK/deploy.sh" "$target:$dir/"
    ssh "${SSH_OPTS[@]}" -p "$BERTH_TEST_SSH_PORT" "$target" "cd '$dir' && ./deploy.sh"
}

# One unmeasured round each (connections, caches), then N alternating rounds.
berth_round "$REMOTE/warm-berth"
hand_round "$REMOTE/warm-hand"
BERTH=()
HAND=()
for i in $(seq 1 "$N"); do
    t0=$(now_ms)
    berth_round "$REMOTE/berth-$i"
    BERTH+=($(($(now_ms) - t0)))
    t0=$(now_ms)
    hand_round "$REMOTE/hand-$i"
    HAND+=($(($(now_ms) - t0)))
    [ -s "$REMOTE/berth-$i/deployed.txt" ] && [ -s "$REMOTE/hand-$i/deployed.txt" ] ||
        { echo "round $i: a deploy left no deployed.txt" >&2; exit 1; }
done

stats() { printf '%s\n' "$@" | sort -n | awk '{a[NR]=$1} END {printf "%6d | %6d | %6d", a[int((NR+1)/2)], a[1], a[NR]}'; }
echo
echo "| N=$N rounds, ms                                   | median |    min |    max |"
echo "|---------------------------------------------------|-------:|-------:|-------:|"
echo "| by hand: ssh mkdir + scp (2 files) + ssh ./deploy.sh | $(stats "${HAND[@]}") |"
echo "| berth: task create --wait (server, agent, fetch, SFTP) | $(stats "${BERTH[@]}") |"
