#!/bin/sh
# berth-agent installer, served by a berth server at /install.sh; `berth token create` prints the
# line that runs it (as root). It downloads the agent binary (its sha256 checked), installs it
# with the packaged systemd unit, registers with the one-time token in BERTH_REGISTRATION_TOKEN,
# and starts it. Running it again is harmless: a registered host keeps its identity (the token is
# not used again), the binary and unit are replaced, and the agent restarts.
#
# BERTH_INSTALL_ROOT=DIR installs below DIR instead of /; there, or without systemd, the agent
# is started in the background instead (DIR/var/lib/berth-agent/agent.pid and agent.log).
set -eu

server=@SERVER@
ca_fingerprint=@CA_FINGERPRINT@
root=${BERTH_INSTALL_ROOT:-}
bin=$root/usr/local/bin/berth-agent
state=$root/var/lib/berth-agent
unit=$root/etc/systemd/system/berth-agent.service

say() { echo "berth install: $*" >&2; }

platform=$(uname -s | tr '[:upper:]' '[:lower:]')-$(uname -m)
case $platform in
@PLATFORMS@
    *) say "$server has no berth-agent for $platform"; exit 1 ;;
esac

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# Pinned again: the line that ran this script checked the same fingerprint.
curl -fsSk "$server/ca.crt" -o "$tmp/ca.crt"
if [ "sha256:$(sed '/-----/d' "$tmp/ca.crt" | base64 -d | sha256sum | cut -c1-64)" != "$ca_fingerprint" ]; then
    say "the server's CA is not $ca_fingerprint"
    exit 1
fi
curl -fsS --cacert "$tmp/ca.crt" "$server/downloads/berth-agent/$platform" -o "$tmp/berth-agent"
if [ "$(sha256sum "$tmp/berth-agent" | cut -c1-64)" != "$sha256" ]; then
    say "the downloaded agent does not match its sha256 $sha256"
    exit 1
fi
mkdir -p "$(dirname "$bin")"
# A rename: a running agent keeps its old file until it restarts.
install -m 0755 "$tmp/berth-agent" "$bin.new"
mv -f "$bin.new" "$bin"

systemd=
if [ -z "$root" ] && [ -d /run/systemd/system ]; then
    systemd=yes
    id berth-agent >/dev/null 2>&1 ||
        useradd --system --home-dir /var/lib/berth-agent --shell /usr/sbin/nologin berth-agent
fi

mkdir -p "$state"
chmod 0700 "$state"
if [ -f "$state/identity.json" ]; then
    say "already registered ($state/identity.json); the token is not used"
elif [ -z "${BERTH_REGISTRATION_TOKEN:-}" ]; then
    say "BERTH_REGISTRATION_TOKEN is not set (berth token create prints the line that sets it)"
    exit 2
else
    "$bin" --register-only --server "$server" --ca-fingerprint "$ca_fingerprint" --state-dir "$state"
fi

# The packaged unit; on a host without a docker group, without that group.
mkdir -p "$(dirname "$unit")"
no_docker=
getent group docker >/dev/null 2>&1 || no_docker='/^SupplementaryGroups=docker$/d'
sed "$no_docker" >"$unit.new" <<'UNIT'
@UNIT@
UNIT
mv -f "$unit.new" "$unit"

if [ -n "$systemd" ]; then
    chown -R berth-agent:berth-agent "$state"
    systemctl daemon-reload
    systemctl enable berth-agent
    systemctl restart berth-agent
    say "berth-agent is running: systemctl status berth-agent"
else
    pidfile=$state/agent.pid
    if [ -f "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null; then
        old=$(cat "$pidfile")
        kill "$old"
        waited=0
        while kill -0 "$old" 2>/dev/null && [ "$waited" -lt 300 ]; do
            sleep 1
            waited=$((waited + 1))
        done
    fi
    nohup "$bin" --state-dir "$state" >>"$state/agent.log" 2>&1 </dev/null &
    echo "$!" >"$pidfile"
    say "berth-agent started in the background without systemd (pid $!, log $state/agent.log)"
fi
