#!/usr/bin/env bash
# Builds the Debian packages `berth` (server and CLI) and `berth-agent` with cargo-deb into
# <target>/debian/, then checks them: dpkg-deb lists the binaries, units, defaults files, man
# pages and completions (and not the other package's), the control data asks for the user the
# unit runs as, the installed units pass `systemd-analyze verify`, and both packages install,
# reconfigure and remove cleanly in a throwaway root (an overlay of /). Nothing is installed on
# this machine. A release build, so it is not part of `cargo test` (tests/packaging.rs covers the
# cheap parts: unit verification, completions, man pages); scripts/test.sh runs it last.
# Idempotent; installs cargo-deb (cargo install, into ~/.cargo/bin) when it is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

say() { echo "package.sh: $*" >&2; }
fail() { say "FAIL: $*"; exit 1; }

command -v dpkg-deb >/dev/null || fail "dpkg-deb is missing: run this on Debian"
command -v cargo-deb >/dev/null || cargo install cargo-deb --locked >&2

target="$(cargo metadata --no-deps --format-version 1 | grep -o '"target_directory":"[^"]*"' | cut -d'"' -f4)"
release="$target/release"

# The agent is built with its own profile (`[profile.agent]`: opt-level "s", fat LTO, one codegen
# unit) and without the `server` feature: a smaller binary is fewer resident pages on every host
# (BENCHMARKS.md, "Agent size"). `cargo deb --profile agent` reads its target/release/ assets from
# target/agent/.
agent="$target/agent"
say "cargo build --release (berth); cargo build --profile agent (berth-agent)"
cargo build --release --locked -p berth-cli --bin berth
cargo build --profile agent --locked -p berth-cli --no-default-features --bin berth-agent

# Man pages and completions come from the binaries themselves (clap_mangen, clap_complete), so
# they always match the flags; the package metadata (crates/berth-cli/Cargo.toml) picks them up
# from target/release/pkg/ (target/agent/pkg/ for the agent).
for bin in berth berth-agent; do
    dir="$release"
    [ "$bin" = berth ] || dir="$agent"
    out="$dir/pkg/$bin"
    rm -rf "$out"
    mkdir -p "$out/completions"
    "$dir/$bin" man --out "$out/man"
    # Debian policy compresses man pages; cargo-deb does not for files under target/release.
    gzip -9n "$out"/man/*.1
    "$dir/$bin" completions bash >"$out/completions/$bin.bash"
    "$dir/$bin" completions zsh >"$out/completions/_$bin"
    "$dir/$bin" completions fish >"$out/completions/$bin.fish"
done

debs="$target/debian"
rm -f "$debs"/berth_*.deb "$debs"/berth-agent_*.deb
say "cargo deb (berth, and the agent variant: berth-agent)"
cargo deb -p berth-cli --no-build --output "$debs/" >&2
cargo deb -p berth-cli --no-build --variant agent --profile agent --output "$debs/" >&2

check() { # check DEB NAME OTHER CONF: the contents and control data of package NAME
    local deb="$1" name="$2" other="$3" conf="$4" contents control
    contents="$(dpkg-deb --contents "$deb" | awk '{print $NF}')"
    for path in \
        "./usr/bin/$name" \
        "./usr/lib/systemd/system/$name.service" \
        "./etc/default/$name" \
        "./$conf" \
        "./usr/share/man/man1/$name.1.gz" \
        "./usr/share/bash-completion/completions/$name" \
        "./usr/share/zsh/vendor-completions/_$name" \
        "./usr/share/fish/vendor_completions.d/$name.fish"; do
        grep -qxF "$path" <<<"$contents" || fail "$deb lacks $path"
    done
    if grep -qxF "./usr/bin/$other" <<<"$contents" || grep -qF "/$other.service" <<<"$contents"; then
        fail "$deb also holds $other's files"
    fi
    control="$(dpkg-deb --field "$deb" Package Depends)"
    grep -qx "Package: $name" <<<"$control" || fail "$deb is not package $name"
    grep -q '^Depends:.*adduser' <<<"$control" || fail "$deb does not depend on adduser"
    local tmp
    tmp="$(mktemp -d)"
    dpkg-deb --ctrl-tarfile "$deb" | tar -x -C "$tmp"
    grep -q "adduser --system --group --home /var/lib/$name" "$tmp/postinst" || fail "$deb's postinst creates no user $name"
    grep -qx "/etc/default/$name" "$tmp/conffiles" || fail "/etc/default/$name is not a conffile"
    grep -qx "/$conf" "$tmp/conffiles" || fail "/$conf is not a conffile"
    rm -rf "$tmp"
    say "$(basename "$deb"): $(wc -l <<<"$contents") entries, $(du -k "$deb" | cut -f1) KiB"
}
berth_deb="$(ls "$debs"/berth_*.deb)"
agent_deb="$(ls "$debs"/berth-agent_*.deb)"
check "$berth_deb" berth berth-agent etc/berth/server.toml
check "$agent_deb" berth-agent berth etc/berth-agent/agent.toml
grep -q 'man1/berth-server.1.gz$' <<<"$(dpkg-deb --contents "$berth_deb")" || fail "no man page per subcommand"

# A throwaway root, never this machine's /: the extracted programs run and show their man page.
root="$(mktemp -d)"
trap 'rm -rf "$root"' EXIT
dpkg-deb -x "$berth_deb" "$root"
dpkg-deb -x "$agent_deb" "$root"
"$root/usr/bin/berth" --version >&2
"$root/usr/bin/berth-agent" --version >&2
if command -v systemd-analyze >/dev/null; then
    # The units as installed, with ExecStart resolved in the throwaway root.
    mkdir -p "$root/verify"
    for unit in berth berth-agent; do
        sed "s#ExecStart=/usr/bin/#ExecStart=$root/usr/bin/#" "$root/usr/lib/systemd/system/$unit.service" >"$root/verify/$unit.service"
    done
    warnings="$(systemd-analyze verify --man=no "$root/verify/berth.service" "$root/verify/berth-agent.service" 2>&1)" \
        || fail "systemd-analyze verify: $warnings"
    [ -z "$warnings" ] || fail "systemd-analyze verify warned: $warnings"
fi
# Install, reconfigure (the maintainer scripts again: idempotent) and remove both packages in a
# throwaway root: an overlay of / whose writes go to a tmpfs directory, in a mount namespace of
# its own, so this machine's system is never touched. Needs root (overlayfs, chroot).
install_check() {
    local t
    t="$(mktemp -d -p /dev/shm)"
    mkdir -p "$t/upper/debs" "$t/work" "$t/merged"
    cp "$berth_deb" "$agent_deb" "$t/upper/debs/"
    unshare --mount --propagation private sh -eu -c '
        t="$1"; m="$t/merged"
        mount -t overlay overlay -o "lowerdir=/,upperdir=$t/upper,workdir=$t/work" "$m"
        mount -t proc proc "$m/proc"
        mount -t tmpfs tmpfs "$m/run"
        in_root() { chroot "$m" "$@"; }
        in_root sh -c "dpkg -i /debs/*.deb" >/dev/null
        in_root dpkg-reconfigure berth berth-agent
        for user in berth berth-agent; do
            [ "$(in_root getent passwd "$user" | cut -d: -f7)" = /usr/sbin/nologin ]
            [ "$(in_root grep -c "^$user:" /etc/passwd)" = 1 ]
        done
        [ "$(in_root stat -c "%U %a" /var/lib/berth-agent)" = "berth-agent 700" ]
        in_root berth --version >/dev/null
        in_root berth-agent --version >/dev/null
        # The shipped config files parse (a bad key would exit 78).
        in_root berth server --print-config >/dev/null
        in_root berth-agent --print-config >/dev/null
        in_root test -f /etc/default/berth -a -f /usr/lib/systemd/system/berth-agent.service
        in_root dpkg -r berth berth-agent >/dev/null
        in_root test ! -e /usr/bin/berth
    ' sh "$t" || { rm -rf "$t"; fail "installing the packages into a throwaway root"; }
    rm -rf "$t"
    say "installed, reconfigured and removed both packages in a throwaway root"
}
if [ "$(id -u)" = 0 ] && command -v unshare >/dev/null; then
    install_check
elif [ "${CI:-}" = true ] || [ "${BERTH_REQUIRE_SERVICES:-}" = 1 ]; then
    fail "the install check needs root and unshare (CI=true or BERTH_REQUIRE_SERVICES=1)"
else
    say "SKIP install check: needs root and unshare"
fi

say "OK: $berth_deb $agent_deb"
echo "$berth_deb"
echo "$agent_deb"
