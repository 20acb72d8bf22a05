#!/usr/bin/env bash
# Starts berth's own throwaway sshd for the `ssh.deploy` tests, on loopback only:
#   127.0.0.1:55022, Debian's /usr/sbin/sshd with its own config, host keys (Ed25519 and RSA),
#   authorized_keys and client keys (Ed25519 and RSA) under $ROOT, letting in one user it creates
#   (`berth-ssh-test`, public key only)
# and prints `export` lines for the tests as its last lines:
#   BERTH_TEST_SSH_HOST, BERTH_TEST_SSH_PORT, BERTH_TEST_SSH_USER
#   BERTH_TEST_SSH_KEY       the client's private key file (OpenSSH format, 0600, root's)
#   BERTH_TEST_SSH_HOST_KEY  the server's public host key line, `ssh-ed25519 AAAA…`, to pin
#   BERTH_TEST_SSH_RSA_KEY       a second client key the user is let in with: RSA, OpenSSH format
#   BERTH_TEST_SSH_RSA_HOST_KEY  the server's RSA host key line, `ssh-rsa AAAA…`
#   BERTH_TEST_SSH_WORKDIR   a directory the user owns, where tests make their deploy directories
#   BERTH_TEST_SSH_LOG       sshd's log (LogLevel VERBOSE): what each client connection did
#
# Idempotent: an sshd this script started and that still answers is left running (reloaded with
# SIGHUP when its generated config changed, e.g. by a newer version of this script). It never
# stops, reconfigures or reuses an sshd it did not start: a foreign process on the port is an error.
#
# Run as root on Debian 12: installs `openssh-server` when missing (the system's own sshd service,
# if the package starts one, is left alone; ours has its own config and port).
#   BERTH_SSHD_DIR   config, keys, logs and the pid file (default /tmp/berth-sshd)
# Usage: eval "$(bash scripts/sshd.sh | grep '^export ')"
set -euo pipefail

ROOT="${BERTH_SSHD_DIR:-/tmp/berth-sshd}"
PORT=55022
USER_NAME=berth-ssh-test
SSHD=/usr/sbin/sshd

say() { echo "sshd.sh: $*" >&2; }
die() { say "$*"; exit 1; }

[ "$(id -u)" -eq 0 ] || die "run as root (it installs packages and creates a user)"

if [ ! -x "$SSHD" ] || ! command -v ssh-keygen >/dev/null; then
    say "installing openssh-server from Debian's packages"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y --no-install-recommends openssh-server >&2 \
        || { apt-get update >&2 && apt-get install -y --no-install-recommends openssh-server >&2; }
fi
[ -x "$SSHD" ] || die "$SSHD is missing after installing openssh-server"

# The user: no password, but not locked either (sshd refuses a locked account without PAM).
if ! id "$USER_NAME" >/dev/null 2>&1; then
    useradd --create-home --shell /bin/sh "$USER_NAME"
fi
usermod -p '*' "$USER_NAME"

# $ROOT is readable by the user: sshd reads authorized_keys with the user's rights. The client key
# lives in a root-only subdirectory.
mkdir -p "$ROOT/client" "$ROOT/work"
chmod 0755 "$ROOT"
chmod 0700 "$ROOT/client"
chown "$USER_NAME:" "$ROOT/work"
chmod 0755 "$ROOT/work"
[ -s "$ROOT/ssh_host_ed25519_key" ] \
    || ssh-keygen -q -t ed25519 -N '' -C berth-test-host -f "$ROOT/ssh_host_ed25519_key"
[ -s "$ROOT/ssh_host_rsa_key" ] \
    || ssh-keygen -q -t rsa -b 3072 -N '' -C berth-test-host -f "$ROOT/ssh_host_rsa_key"
[ -s "$ROOT/client/id_ed25519" ] \
    || ssh-keygen -q -t ed25519 -N '' -C berth-test-client -f "$ROOT/client/id_ed25519"
[ -s "$ROOT/client/id_rsa" ] \
    || ssh-keygen -q -t rsa -b 3072 -N '' -C berth-test-client-rsa -f "$ROOT/client/id_rsa"
cat "$ROOT/client/id_ed25519.pub" "$ROOT/client/id_rsa.pub" >"$ROOT/authorized_keys.tmp"
chmod 0644 "$ROOT/authorized_keys.tmp"
mv "$ROOT/authorized_keys.tmp" "$ROOT/authorized_keys"
# sshd's privilege separation directory.
mkdir -p /run/sshd
chmod 0755 /run/sshd

write_config() {
    {
        echo "# berth test sshd (scripts/sshd.sh); generated, do not edit"
        echo "Port $PORT"
        echo "ListenAddress 127.0.0.1"
        echo "HostKey $ROOT/ssh_host_ed25519_key"
        echo "HostKey $ROOT/ssh_host_rsa_key"
        echo "PidFile $ROOT/sshd.pid"
        echo "AuthorizedKeysFile $ROOT/authorized_keys"
        # $ROOT sits in /tmp (sticky, world-writable), which strict modes refuse as a parent of
        # authorized_keys; the file itself is root's and 0644.
        echo "StrictModes no"
        echo "AllowUsers $USER_NAME"
        echo "PubkeyAuthentication yes"
        echo "PasswordAuthentication no"
        echo "KbdInteractiveAuthentication no"
        echo "PermitRootLogin no"
        echo "UsePAM no"
        echo "X11Forwarding no"
        echo "AllowTcpForwarding no"
        echo "PrintMotd no"
        # The benchmark and the tests open many short connections in a row.
        echo "MaxStartups 100:30:200"
        echo "LogLevel VERBOSE"
        echo "Subsystem sftp internal-sftp"
    } >"$ROOT/sshd_config.tmp"
}

# 0 when the sshd we started is alive (its pid runs our config).
ours_alive() {
    local pid
    [ -s "$ROOT/sshd.pid" ] || return 1
    pid="$(cat "$ROOT/sshd.pid")"
    [ -r "/proc/$pid/cmdline" ] || return 1
    tr '\0' ' ' <"/proc/$pid/cmdline" | grep -q "sshd -f $ROOT/sshd_config"
}

port_in_use() { ss -Hltn "sport = :$1" | grep -q .; }

# 0 when something on the port greets like an SSH server.
answers() {
    local banner
    banner="$(timeout 2 bash -c "exec 3<>/dev/tcp/127.0.0.1/$PORT && head -c 8 <&3" 2>/dev/null || true)"
    [ "$banner" = "SSH-2.0-" ]
}

if ours_alive; then
    answers || die "our sshd (pid $(cat "$ROOT/sshd.pid")) does not answer; see $ROOT/sshd.log"
    write_config
    if cmp -s "$ROOT/sshd_config.tmp" "$ROOT/sshd_config"; then
        rm -f "$ROOT/sshd_config.tmp"
        say "sshd on 127.0.0.1:$PORT already runs (pid $(cat "$ROOT/sshd.pid"))"
    else
        "$SSHD" -t -f "$ROOT/sshd_config.tmp" || die "sshd refuses the new config $ROOT/sshd_config.tmp"
        mv "$ROOT/sshd_config.tmp" "$ROOT/sshd_config"
        say "reloading sshd (pid $(cat "$ROOT/sshd.pid")) with its new config"
        hups="$(grep -c 'Received SIGHUP' "$ROOT/sshd.log" || true)"
        # SIGHUP: sshd re-executes itself with the new config; open connections stay.
        kill -HUP "$(cat "$ROOT/sshd.pid")"
        for _ in $(seq 1 100); do
            [ "$(grep -c 'Received SIGHUP' "$ROOT/sshd.log" || true)" -gt "$hups" ] \
                && answers && ours_alive && break
            sleep 0.1
        done
        answers && ours_alive || { tail -n 20 "$ROOT/sshd.log" >&2 || true; die "sshd did not come back"; }
    fi
else
    port_in_use "$PORT" && die "port $PORT is taken by a process this script did not start; leaving it alone"
    write_config
    mv "$ROOT/sshd_config.tmp" "$ROOT/sshd_config"
    "$SSHD" -t -f "$ROOT/sshd_config" || die "sshd refuses its config $ROOT/sshd_config"
    say "starting sshd on 127.0.0.1:$PORT (log: $ROOT/sshd.log)"
    # It daemonizes and writes its pid file itself.
    "$SSHD" -f "$ROOT/sshd_config" -E "$ROOT/sshd.log" </dev/null
    for _ in $(seq 1 100); do
        answers && ours_alive && break
        sleep 0.1
    done
    answers && ours_alive || { tail -n 20 "$ROOT/sshd.log" >&2 || true; die "sshd did not come up"; }
fi

# The pinned key is the public key line without its comment.
HOST_KEY="$(cut -d' ' -f1,2 "$ROOT/ssh_host_ed25519_key.pub")"
echo "export BERTH_TEST_SSH_HOST=127.0.0.1"
echo "export BERTH_TEST_SSH_PORT=$PORT"
echo "export BERTH_TEST_SSH_USER=$USER_NAME"
echo "export BERTH_TEST_SSH_KEY=$ROOT/client/id_ed25519"
echo "export BERTH_TEST_SSH_HOST_KEY='$HOST_KEY'"
echo "export BERTH_TEST_SSH_RSA_KEY=$ROOT/client/id_rsa"
echo "export BERTH_TEST_SSH_RSA_HOST_KEY='$(cut -d' ' -f1,2 "$ROOT/ssh_host_rsa_key.pub")'"
echo "export BERTH_TEST_SSH_WORKDIR=$ROOT/work"
echo "export BERTH_TEST_SSH_LOG=$ROOT/sshd.log"
