#!/usr/bin/env bash
# `ssh.deploy` of a 10 MB artifact plus a trivial deploy script, against `scp` + `ssh` by hand,
# side by side in one run, alternating, N each, against the sshd of scripts/sshd.sh (loopback).
#
#   scripts/bench-ssh-deploy.sh                 # N=7
#   N=5 SKIP_BUILD=1 scripts/bench-ssh-deploy.sh
#
# berth side: the executor as the agent runs it once it holds the assignment (release build of
# crates/berth-exec/examples/ssh_bench.rs). By hand: `scp` of both files, then
# `ssh … 'cd DIR && ./deploy.sh'`, with the same key and the host key pinned in a known_hosts file.
# The deploy directories live below the sshd user's work dir and go with the run.
set -euo pipefail

source "$(dirname "$0")/bench-lib.sh"
cd "$BENCH_ROOT"

N=${N:-7}
eval "$(bash scripts/sshd.sh | grep '^export ')"
if [ "${SKIP_BUILD:-0}" != 1 ]; then
    cargo build --release -p berth-exec --example ssh_bench
fi
EXAMPLE="${CARGO_TARGET_DIR:-$BENCH_ROOT/target}/release/examples/ssh_bench"
[ -x "$EXAMPLE" ] || { echo "missing $EXAMPLE" >&2; exit 1; }

echo "command: N=$N scripts/bench-ssh-deploy.sh"
bench_machine
echo "openssh: $(ssh -V 2>&1)"
"$EXAMPLE" "$N"
