#!/usr/bin/env bash
# Builds the previous release's berth-agent (the newest line of RELEASES) from its commit, for the
# N-1 upgrade test (crates/berth-cli/tests/upgrade_e2e.rs), and prints the binary's path as its last
# line. scripts/test.sh exports that as BERTH_TEST_PREVIOUS_AGENT.
#
# The commit's tree is exported with `git archive` (no worktree to clean up) and built into the
# SAME target directory as the current tree, so only berth's own crates compile again: every
# dependency whose version and features did not change since that release is already there. Run it after
# the current tree's test build and before its tests, never while a cargo command holds the target
# directory. The build also leaves the old binaries at <target>/debug/berth{,-agent}; the next cargo
# command that builds the current tree's (the test run) links the current ones back.
#
# Idempotent: a binary already built for the pinned commit is reused.
set -euo pipefail
cd "$(dirname "$0")/.."

say() { echo "previous-agent.sh: $*" >&2; }
fail() { say "$*"; exit 1; }

read -r version commit < <(grep -v -e '^#' -e '^[[:space:]]*$' RELEASES | tail -n 1) \
    || fail "RELEASES names no release"
[[ "$version" =~ ^([0-9]+)\.([0-9]+)\.([0-9]+)$ ]] || fail "RELEASES: bad version ${version:-<none>}"
prev_major=${BASH_REMATCH[1]} prev_minor=${BASH_REMATCH[2]}
[[ "$commit" =~ ^[0-9a-f]{40}$ ]] || fail "RELEASES: release $version needs a full 40-hex commit, not ${commit:-<none>}"

# The workspace must be the next release: the pinned one's minor + 1 (or the next major's .0).
current="$(sed -n '/^\[workspace.package\]/,/^\[/s/^version = "\(.*\)"$/\1/p' Cargo.toml)"
[[ "$current" =~ ^([0-9]+)\.([0-9]+)\.[0-9]+$ ]] || fail "Cargo.toml: no [workspace.package] version"
cur_major=${BASH_REMATCH[1]} cur_minor=${BASH_REMATCH[2]}
if ! { [[ $cur_major == "$prev_major" && $cur_minor == $((prev_minor + 1)) ]] \
    || [[ $cur_major == $((prev_major + 1)) && $cur_minor == 0 ]]; }; then
    fail "the workspace is at $current but the newest release in RELEASES is $version: the workspace must be its next minor (see RELEASES)"
fi

git cat-file -e "$commit^{commit}" 2>/dev/null \
    || fail "commit $commit (release $version) is not in this repository: a shallow clone? Fetch the history (git fetch --unshallow) and run again"

target="${CARGO_TARGET_DIR:-$PWD/target}"
mkdir -p "$target"
target="$(cd "$target" && pwd)"
out="$target/previous-agent/$version-${commit:0:12}"
bin="$out/berth-agent"
if [[ -x "$bin" ]] && "$bin" --version 2>/dev/null | grep -qx "berth-agent $version"; then
    say "berth-agent $version (commit ${commit:0:12}) already built"
    echo "$bin"
    exit 0
fi

rm -rf "$out"
mkdir -p "$out/src"
git archive --format=tar "$commit" | tar -x -C "$out/src"
# Built as the current tree's tests build their berth-agent: `cargo test --workspace` resolves every
# dependency's features over the whole workspace with its dev-dependencies, so a plain
# `cargo build -p berth-cli` would resolve other features and compile about 150 dependencies again.
# Building one integration test of berth-cli (its smallest) makes cargo build its binaries
# with exactly those features. No incremental state: the build is a one-off.
smallest="$(ls -S "$out"/src/crates/berth-cli/tests/*.rs | tail -n 1)"
smallest="$(basename "$smallest" .rs)"
say "building berth-agent $version from ${commit:0:12} (target dir $target, via --test $smallest)"
start=$SECONDS
CARGO_INCREMENTAL=0 cargo test --locked --manifest-path "$out/src/Cargo.toml" \
    --target-dir "$target" --workspace --no-run --test "$smallest"
cp "$target/debug/berth-agent" "$bin.tmp"
mv "$bin.tmp" "$bin"
rm -rf "$out/src"
say "built in $((SECONDS - start)) s: $("$bin" --version)"
"$bin" --version | grep -qx "berth-agent $version" \
    || fail "the binary built from $commit says \"$("$bin" --version)\", not berth-agent $version"
echo "$bin"
