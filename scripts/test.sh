#!/usr/bin/env bash
# The whole berth test suite, as CI runs it: installs and starts what the tests need (PostgreSQL
# from Debian's packages, on a project-owned cluster), checks formatting and lints, then runs
# every test. Idempotent; run it as root on Debian 12 with a Rust toolchain (rustup) installed.
set -euo pipefail
cd "$(dirname "$0")/.."

say() { echo "test.sh: $*" >&2; }

command -v cargo >/dev/null || { say "cargo is missing: install Rust with rustup first"; exit 1; }

BERTH_TEST_POSTGRES_URL="$(bash scripts/postgres.sh | tail -n 1)"
export BERTH_TEST_POSTGRES_URL
say "PostgreSQL for tests: ${BERTH_TEST_POSTGRES_URL%%@*}@…"

say "cargo fmt --check"
cargo fmt --all -- --check

say "cargo clippy (warnings are errors)"
cargo clippy --workspace --all-targets --locked -- -D warnings

say "cargo test"
cargo test --workspace --locked
