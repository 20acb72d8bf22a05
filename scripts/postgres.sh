#!/usr/bin/env bash
# Starts berth's own throwaway PostgreSQL cluster for tests, on 127.0.0.1:55432, and prints its
# admin URL as the last line of stdout. Idempotent: when the cluster already runs it only prints
# the URL. It never touches the system's default cluster (Debian's "main" on 5432).
#
# Run as root on Debian 12 (installs the `postgresql` package when missing).
#   BERTH_PG_DIR     where the cluster lives (default /tmp/berth-pg, or /tmp/berth-pg-durable;
#                    the `postgres` user must be able to reach it, so not under /root)
#   BERTH_PG_DURABLE =1: the benchmarks' cluster instead, set like production (fsync,
#                    synchronous_commit and full_page_writes on), on 127.0.0.1:55433, with
#                    pg_stat_statements loaded for profiling. The tests' cluster trades
#                    durability for speed: only benchmarks measure durable figures.
# Usage: export BERTH_TEST_POSTGRES_URL="$(bash scripts/postgres.sh | tail -1)"
set -euo pipefail

DURABLE=${BERTH_PG_DURABLE:-0}
if [ "$DURABLE" = 1 ]; then
    PORT=55433
    ROOT="${BERTH_PG_DIR:-/tmp/berth-pg-durable}"
else
    PORT=55432
    ROOT="${BERTH_PG_DIR:-/tmp/berth-pg}"
fi
DATA="$ROOT/data"
LOG="$ROOT/postgresql.log"
URL="postgres://berth:berth@127.0.0.1:${PORT}/postgres"

say() { echo "postgres.sh: $*" >&2; }
die() { say "$*"; exit 1; }

[ "$(id -u)" -eq 0 ] || die "run as root (it installs packages and runs the cluster as the postgres user)"

# The postgres user cannot enter root's home, so always run its commands from /.
as_postgres() { (cd / && runuser -u postgres -- "$@"); }

newest_bin() {
    ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1 || true
}

if [ -z "$(newest_bin)" ] || [ ! -x "$(newest_bin)/initdb" ]; then
    say "installing postgresql from Debian's packages"
    export DEBIAN_FRONTEND=noninteractive
    # Refresh the package lists only when they do not know the package yet (fresh machine), or
    # when they turn out to be stale.
    if ! apt-cache show postgresql >/dev/null 2>&1; then
        apt-get update >&2
    fi
    if ! apt-get install -y --no-install-recommends postgresql >&2; then
        apt-get update >&2
        apt-get install -y --no-install-recommends postgresql >&2
    fi
fi
BIN="$(newest_bin)"
[ -n "$BIN" ] && [ -x "$BIN/initdb" ] || die "no initdb under /usr/lib/postgresql/*/bin after installing"
id postgres >/dev/null 2>&1 || die "the postgres user is missing (the postgresql package creates it)"

# An existing cluster must be run by the major version that created it.
if [ -s "$DATA/PG_VERSION" ]; then
    BIN="/usr/lib/postgresql/$(cat "$DATA/PG_VERSION")/bin"
    [ -x "$BIN/pg_ctl" ] || die "$DATA was made by PostgreSQL $(cat "$DATA/PG_VERSION"), which is not installed; remove $ROOT to start over"
fi

mkdir -p "$ROOT"
chown postgres:postgres "$ROOT"
chmod 0700 "$ROOT"

if [ ! -s "$DATA/PG_VERSION" ]; then
    say "initialising a cluster in $DATA"
    rm -rf "$DATA"
    as_postgres "$BIN/initdb" -D "$DATA" -U postgres -E UTF8 --no-locale \
        --auth-local=trust --auth-host=scram-sha-256 >&2
    # Loopback only and our own socket directory. The tests' cluster has no durability: it
    # holds nothing but test databases, and fsync would make every CREATE DATABASE slow.
    if [ "$DURABLE" = 1 ]; then
        settings="# berth benchmark cluster (scripts/postgres.sh, BERTH_PG_DURABLE=1)
fsync = on
synchronous_commit = on
full_page_writes = on
shared_preload_libraries = 'pg_stat_statements'"
    else
        settings="# berth test cluster (scripts/postgres.sh)
fsync = off
synchronous_commit = off
full_page_writes = off"
    fi
    cat >>"$DATA/postgresql.conf" <<EOF

$settings
listen_addresses = '127.0.0.1'
port = $PORT
unix_socket_directories = '$ROOT'
max_connections = 200
EOF
fi

if ! as_postgres "$BIN/pg_ctl" -D "$DATA" status >/dev/null 2>&1; then
    say "starting the cluster on 127.0.0.1:$PORT (log: $LOG)"
    if ! as_postgres "$BIN/pg_ctl" -D "$DATA" -l "$LOG" -w -t 60 start >&2; then
        tail -n 20 "$LOG" >&2 || true
        die "the cluster did not start (is port $PORT taken by something else?)"
    fi
fi

# The role the tests log in as; created once, with the password the URL carries.
as_postgres "$BIN/psql" -h "$ROOT" -p "$PORT" -U postgres -d postgres -v ON_ERROR_STOP=1 -qAt >&2 <<'SQL'
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'berth') THEN
        CREATE ROLE berth LOGIN SUPERUSER PASSWORD 'berth';
    END IF;
END
$$;
SQL

echo "$URL"
