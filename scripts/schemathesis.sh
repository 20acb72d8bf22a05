#!/usr/bin/env bash
# The contract test: schemathesis (from PyPI, pinned, in a project-owned venv) against a live
# `berth server`, as the operator and as a registered agent (its client certificate), checking
# that no answer is a 5xx and that every status and body is one openapi/berth.json documents.
# Idempotent; everything it starts (server, agents, temp dir) is removed on exit. Any failure
# fails the script.
#
# Usage: scripts/schemathesis.sh [BIN_DIR]   (default: the cargo target dir's debug/, built here)
# SCHEMATHESIS_MAX_EXAMPLES bounds the examples per operation and phase (default 100);
# SCHEMATHESIS_SEED picks another seed (default 1, so a failure reproduces); with
# SCHEMATHESIS_REPORT_DIR every request and answer is kept there as HAR.
set -euo pipefail
cd "$(dirname "$0")/.."

say() { echo "schemathesis.sh: $*" >&2; }

SCHEMATHESIS_VERSION=4.32.5
# Project-owned and ignored by git: the venv, and the run's directory, where schemathesis keeps
# the failures `st replay ID` (run there) reproduces.
home="$PWD/target/schemathesis"
venv="$home/venv"
max_examples="${SCHEMATHESIS_MAX_EXAMPLES:-100}"
report=()
[[ -n "${SCHEMATHESIS_REPORT_DIR:-}" ]] && report=(--report har --report-dir "$SCHEMATHESIS_REPORT_DIR")

if [[ $# -ge 1 ]]; then
    bin_dir="$1"
else
    cargo build --locked -p berth-cli --bins >&2
    bin_dir="${CARGO_TARGET_DIR:-target}/debug"
fi

# A venv of our own, so the pinned version never meets the system's packages.
if [[ "$("$venv/bin/st" --version 2>/dev/null)" != *" $SCHEMATHESIS_VERSION" ]]; then
    say "installing schemathesis $SCHEMATHESIS_VERSION into $venv"
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet --disable-pip-version-check "schemathesis==$SCHEMATHESIS_VERSION"
fi

# The document must be valid OpenAPI before anything is generated from it: an independent
# validator (PyPI's openapi-spec-validator, pinned) on the committed copy, which
# tests/api.rs keeps equal to the served one.
OPENAPI_SPEC_VALIDATOR_VERSION=0.9.0
if [[ "$("$venv/bin/pip" show openapi-spec-validator 2>/dev/null | sed -n 's/^Version: //p')" \
    != "$OPENAPI_SPEC_VALIDATOR_VERSION" ]]; then
    "$venv/bin/pip" install --quiet --disable-pip-version-check \
        "openapi-spec-validator==$OPENAPI_SPEC_VALIDATOR_VERSION"
fi
"$venv/bin/openapi-spec-validator" openapi/berth.json >&2

work="$(mktemp -d -t berth-schemathesis.XXXXXX)"
pids=()
cleanup() {
    for pid in "${pids[@]}"; do
        kill "$pid" 2>/dev/null && wait "$pid" 2>/dev/null || true
    done
    rm -rf "$work"
}
trap cleanup EXIT

# Only this run's settings reach the binaries.
unset BERTH_SERVER BERTH_TOKEN BERTH_CA_FILE BERTH_DATA_DIR BERTH_LISTEN BERTH_DATABASE \
    BERTH_REGISTRATION_TOKEN BERTH_CA_FINGERPRINT BERTH_AGENT_STATE_DIR BERTH_FAULT_CRASH_AFTER \
    BERTH_HEARTBEAT_INTERVAL_SECS BERTH_AGENT_CERT_VALIDITY_SECS BERTH_AGENT_TRANSPORT \
    BERTH_LEASE_GRACE_SECS BERTH_HOSTNAMES

# Waits (up to 60 s) until COMMAND succeeds, failing with LOG's tail if PID exits first.
wait_until() {
    local what="$1" pid="$2" log="$3"
    shift 3
    for _ in $(seq 1 600); do
        "$@" && return 0
        kill -0 "$pid" 2>/dev/null || { tail -n 30 "$log" >&2; say "$what: the process exited"; exit 1; }
        sleep 0.1
    done
    tail -n 30 "$log" >&2
    say "$what: timed out"
    exit 1
}
json_field() { python3 -c 'import json,sys; print(json.load(sys.stdin)[sys.argv[1]])' "$1"; }

# The server picks a free loopback port and says which.
"$bin_dir/berth" server --data-dir "$work/data" --listen 127.0.0.1:0 2>"$work/server.log" &
server_pid=$!
pids+=("$server_pid")
wait_until "server start" "$server_pid" "$work/server.log" \
    grep -q '^berth server listening on ' "$work/server.log"
url="$(sed -n 's/^berth server listening on //p' "$work/server.log" | head -n 1)"
export BERTH_SERVER="$url" BERTH_CA_FILE="$work/data/ca.crt"
BERTH_TOKEN="$(cat "$work/data/admin.token")"
export BERTH_TOKEN
say "server at $url"

# Registers NAME with a token of TENANT_TOKEN's tenant through the real agent binary and leaves
# it running; sets agent_id and agent_pid once it holds a session.
start_agent() {
    local name="$1" tenant_token="$2" created
    created="$(BERTH_TOKEN="$tenant_token" "$bin_dir/berth" token create -o json)"
    DOCKER_HOST="unix:///nonexistent/berth-schemathesis.sock" \
        "$bin_dir/berth-agent" --register --state-dir "$work/$name" \
        --token "$(json_field token <<<"$created")" --server "$url" \
        --ca-fingerprint "$(json_field caFingerprint <<<"$created")" \
        --name "$name" --sticker-dir "$work/$name-stickers" 2>"$work/$name.log" &
    agent_pid=$!
    pids+=("$agent_pid")
    wait_until "$name registration" "$agent_pid" "$work/$name.log" test -s "$work/$name/identity.json"
    agent_id="$(json_field agentId <"$work/$name/identity.json")"
    wait_until "$name session" "$agent_pid" "$work/$name.log" \
        grep -q "session acquired agent_id=$agent_id" "$work/server.log"
}
stop_agent() { kill "$agent_pid" && wait "$agent_pid" || true; }

# Objects the reads return: an agent of the operator's tenant that heartbeated and ran a task.
start_agent fixture "$BERTH_TOKEN"
BERTH_FIXTURE_AGENT_ID="$agent_id"
BERTH_FIXTURE_TASK_ID="$("$bin_dir/berth" task create --agent "$agent_id" --type write-sticker \
    --payload '{"name":"site","releaseId":"r1"}' --wait -o json | json_field id)"
stop_agent
export BERTH_FIXTURE_AGENT_ID BERTH_FIXTURE_TASK_ID

# The agent schemathesis acts as, stopped (it releases its session) so that the run holds its
# certificate alone. It lives in a tenant of its own: the operator token cannot see it, so no
# generated DELETE takes it away mid-run. (A renewal could, but only with a CSR of the agent's
# own key; generated CSRs are refused as INVALID_CSR.)
tenant_admin="$("$bin_dir/berth" tenant create agents -o json | json_field adminToken)"
start_agent schemathesis "$tenant_admin"
stop_agent
export BERTH_AGENT_ID="$agent_id"
# agent.pem is the key, then the certificate.
awk '/BEGIN CERTIFICATE/{c=1} c' "$work/schemathesis/agent.pem" >"$work/agent.crt"
awk '/BEGIN CERTIFICATE/{exit} 1' "$work/schemathesis/agent.pem" >"$work/agent.key"
# The run starts holding the agent's session, as a live agent would.
BERTH_GENERATION="$(curl --silent --show-error --fail --cacert "$work/data/ca.crt" \
    --cert "$work/agent.crt" --key "$work/agent.key" -H 'Content-Type: application/json' \
    -d '{"instanceId":"schemathesis"}' "$url/api/v1/agents/$BERTH_AGENT_ID/session" |
    json_field generation)"
export BERTH_GENERATION
say "agent $BERTH_AGENT_ID (generation $BERTH_GENERATION); fixture task $BERTH_FIXTURE_TASK_ID"

root="$PWD"
cd "$home"
# One worker: schemathesis' workers are threads, and CPython 3.11 (Debian 12's) keeps the AST
# constructor's recursion counter in interpreter-global state, so two threads in `ast.parse`
# at once (hypothesis parses source to describe a filter lambda) abort an operation with
# `SystemError: AST constructor recursion depth mismatch`: an error of the tools, not of berth.
SCHEMATHESIS_HOOKS="$root/scripts/schemathesis/hooks.py" \
    "$venv/bin/st" --config-file "$root/scripts/schemathesis/config.toml" run "$root/openapi/berth.json" \
    --url "$url" \
    --checks not_a_server_error,status_code_conformance,response_schema_conformance \
    --max-examples "$max_examples" --workers 1 --seed "${SCHEMATHESIS_SEED:-1}" --no-color \
    --generation-database none --request-timeout 60 \
    --tls-verify "$work/data/ca.crt" \
    --request-cert "$work/agent.crt" --request-cert-key "$work/agent.key" \
    -H "Authorization: Bearer $BERTH_TOKEN" "${report[@]}" \
    || { say "schemathesis found failures; the server log ends:"; tail -n 40 "$work/server.log" >&2; exit 1; }
