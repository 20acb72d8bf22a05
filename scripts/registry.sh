#!/usr/bin/env bash
# Starts berth's own throwaway Docker registries for the executor tests, on loopback only:
#   127.0.0.1:55000  no authentication
#   127.0.0.1:55001  htpasswd (bcrypt) authentication, user `registry-tester`, a random password kept in
#                    $ROOT/credentials (0600) so reruns print the same one
# and prints `export` lines for the tests as its last lines. Docker treats 127.0.0.0/8 registries
# as insecure-allowed, so plain HTTP works without daemon configuration.
#
# Idempotent: a registry this script started and that still answers is left running. It never
# stops, reconfigures or reuses a registry it did not start (such as the Debian package's own
# service on port 5000): a foreign process on one of our ports is an error.
#
# Run as root on Debian 12: installs `docker-registry`, `busybox-static` (the tests build their
# images from its /bin/busybox) and `apache2-utils` (htpasswd) when missing.
#   BERTH_REGISTRY_DIR   configs, storage, logs and pid files (default /tmp/berth-registry)
# Usage: eval "$(bash scripts/registry.sh | grep '^export ')"
set -euo pipefail

ROOT="${BERTH_REGISTRY_DIR:-/tmp/berth-registry}"
PLAIN_PORT=55000
AUTH_PORT=55001
USER_NAME=registry-tester

say() { echo "registry.sh: $*" >&2; }
die() { say "$*"; exit 1; }

[ "$(id -u)" -eq 0 ] || die "run as root (it installs packages)"

# Installs the Debian packages whose files are missing. The package lists are refreshed only when
# they do not know a package yet (fresh machine) or turn out to be stale.
need_packages=()
[ -x /usr/bin/docker-registry ] || need_packages+=(docker-registry)
# The tests copy /bin/busybox into FROM-scratch images, so it must be the static build.
busybox_linkage="$(ldd /bin/busybox 2>&1 || true)"
case "$busybox_linkage" in
    *"not a dynamic executable"*) ;;
    *) need_packages+=(busybox-static) ;;
esac
command -v htpasswd >/dev/null || need_packages+=(apache2-utils)
if [ "${#need_packages[@]}" -gt 0 ]; then
    say "installing ${need_packages[*]} from Debian's packages"
    export DEBIAN_FRONTEND=noninteractive
    if ! apt-cache show "${need_packages[@]}" >/dev/null 2>&1; then
        apt-get update >&2
    fi
    if ! apt-get install -y --no-install-recommends "${need_packages[@]}" >&2; then
        apt-get update >&2
        apt-get install -y --no-install-recommends "${need_packages[@]}" >&2
    fi
    # Where a service manager runs, the package may have started its own registry (port 5000).
    # That one belongs to the system, not to us: it is left alone.
fi
[ -x /usr/bin/docker-registry ] || die "/usr/bin/docker-registry is missing after installing"
command -v htpasswd >/dev/null || die "htpasswd is missing after installing apache2-utils"

mkdir -p "$ROOT"
chmod 0700 "$ROOT"

# The password is made once and kept, so that an already running registry and a rerun agree.
if [ ! -s "$ROOT/credentials" ]; then
    (umask 077 && head -c 18 /dev/urandom | base64 | tr -d '/+=' >"$ROOT/credentials")
fi
PASSWORD="$(cat "$ROOT/credentials")"
if [ ! -s "$ROOT/htpasswd" ] || ! htpasswd -vb "$ROOT/htpasswd" "$USER_NAME" "$PASSWORD" >/dev/null 2>&1; then
    (umask 077 && htpasswd -Bbn "$USER_NAME" "$PASSWORD" >"$ROOT/htpasswd")
fi

# Writes the config of the registry on port $1 (auth: $2 = yes|no).
write_config() {
    local port="$1" auth="$2" cfg="$ROOT/registry-$1.yml"
    {
        echo "# berth test registry (scripts/registry.sh); generated, do not edit"
        echo "version: 0.1"
        echo "log:"
        echo "  level: warn"
        echo "  accesslog:"
        echo "    disabled: true"
        echo "storage:"
        echo "  filesystem:"
        echo "    rootdirectory: $ROOT/data-$port"
        echo "  delete:"
        echo "    enabled: true"
        echo "http:"
        echo "  addr: 127.0.0.1:$port"
        echo "  secret: berth-test-$port"
        if [ "$auth" = yes ]; then
            echo "auth:"
            echo "  htpasswd:"
            echo "    realm: berth-test"
            echo "    path: $ROOT/htpasswd"
        fi
    } >"$cfg.tmp"
    mv "$cfg.tmp" "$cfg"
}

# 0 when the registry we started for port $1 is alive (its pid runs docker-registry).
ours_alive() {
    local pidfile="$ROOT/registry-$1.pid" pid
    [ -s "$pidfile" ] || return 1
    pid="$(cat "$pidfile")"
    [ -r "/proc/$pid/cmdline" ] || return 1
    tr '\0' ' ' <"/proc/$pid/cmdline" | grep -q "docker-registry serve $ROOT/registry-$1.yml"
}

port_in_use() { ss -Hltn "sport = :$1" | grep -q .; }

answers() {
    local code
    code="$(curl -s -o /dev/null -w '%{http_code}' --max-time 2 "http://127.0.0.1:$1/v2/" || true)"
    [ "$code" = 200 ] || [ "$code" = 401 ]
}

start_registry() {
    local port="$1" auth="$2"
    if ours_alive "$port"; then
        if answers "$port"; then
            say "registry on 127.0.0.1:$port already runs (pid $(cat "$ROOT/registry-$port.pid"))"
            return
        fi
        die "our registry on port $port (pid $(cat "$ROOT/registry-$port.pid")) does not answer; see $ROOT/registry-$port.log"
    fi
    port_in_use "$port" && die "port $port is taken by a process this script did not start; leaving it alone"
    write_config "$port" "$auth"
    mkdir -p "$ROOT/data-$port"
    say "starting a registry on 127.0.0.1:$port (auth: $auth, log: $ROOT/registry-$port.log)"
    setsid /usr/bin/docker-registry serve "$ROOT/registry-$port.yml" \
        >"$ROOT/registry-$port.log" 2>&1 </dev/null &
    # The pid is read back from the process table rather than taken from $!: setsid forks when it
    # happens to lead a process group, and before its exec /proc shows this shell, so $! can name a
    # process that is gone or not yet the registry while the registry itself starts fine.
    local pid
    for _ in $(seq 1 300); do
        if answers "$port"; then
            pid="$(pgrep -f -o "^/usr/bin/docker-registry serve $ROOT/registry-$port.yml" || true)"
            [ -n "$pid" ] || die "port $port answers, but not from the registry this script started"
            echo "$pid" >"$ROOT/registry-$port.pid"
            return
        fi
        sleep 0.1
    done
    tail -n 20 "$ROOT/registry-$port.log" >&2 || true
    die "the registry on port $port did not come up"
}

start_registry "$PLAIN_PORT" no
start_registry "$AUTH_PORT" yes

echo "export BERTH_TEST_REGISTRY=127.0.0.1:$PLAIN_PORT"
echo "export BERTH_TEST_AUTH_REGISTRY=127.0.0.1:$AUTH_PORT"
echo "export BERTH_TEST_REGISTRY_USER=$USER_NAME"
echo "export BERTH_TEST_REGISTRY_PASSWORD=$PASSWORD"
