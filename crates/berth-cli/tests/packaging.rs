//! The cheap half of packaging, run by `cargo test`: the systemd units in packaging/systemd pass
//! `systemd-analyze verify` and keep their hardening, the agent unit's "don't restart" exit codes
//! are the agent's own, and both binaries print completions and man pages. Building the .deb
//! packages (a release build) is scripts/package.sh.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use berth_agent::AgentError;

const BERTH: &str = env!("CARGO_BIN_EXE_berth");
const AGENT: &str = env!("CARGO_BIN_EXE_berth-agent");

fn unit_path(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../packaging/systemd")
        .join(name)
}

fn run(program: &str, args: &[&str]) -> Output {
    Command::new(program)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{program}: {e}"))
}

/// The units with ExecStart pointing at the binaries just built: `verify` checks that the
/// program exists and is executable, and nothing is installed in /usr/bin here.
fn units_with_built_binaries(dir: &Path) -> Vec<PathBuf> {
    [
        ("berth.service", "/usr/bin/berth ", BERTH),
        ("berth-agent.service", "/usr/bin/berth-agent ", AGENT),
    ]
    .into_iter()
    .map(|(name, installed, built)| {
        let text = std::fs::read_to_string(unit_path(name)).unwrap();
        let line = format!("ExecStart={installed}");
        assert!(text.contains(&line), "{name} runs {installed}");
        let path = dir.join(name);
        std::fs::write(&path, text.replace(&line, &format!("ExecStart={built} "))).unwrap();
        path
    })
    .collect()
}

fn systemd_analyze() -> Option<()> {
    let found = Command::new("systemd-analyze")
        .arg("--version")
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    found.then_some(()).or_else(|| {
        berth_test_utils::require_service(
            "systemd units",
            "systemd-analyze is missing (Debian: apt-get install systemd)",
        )
    })
}

#[test]
fn units_pass_systemd_analyze_verify() {
    let Some(()) = systemd_analyze() else { return };
    let dir = tempfile::tempdir().unwrap();
    let units = units_with_built_binaries(dir.path());
    let mut args = vec!["verify".to_string(), "--man=no".to_string()];
    args.extend(units.iter().map(|u| u.display().to_string()));
    let out = Command::new("systemd-analyze")
        .args(&args)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "systemd-analyze verify: {stderr}");
    // An unknown key or a bad value is only a warning (exit 0): the units must have none.
    assert!(
        stderr.trim().is_empty(),
        "systemd-analyze verify warned: {stderr}"
    );

    // The hardening stays: systemd's own exposure score (0 best, 10 worst) at most 2.0.
    for unit in &units {
        let out = run(
            "systemd-analyze",
            &[
                "security",
                "--offline=yes",
                "--threshold=20",
                &unit.display().to_string(),
            ],
        );
        assert!(
            out.status.success(),
            "{} is exposed more than 2.0:\n{}",
            unit.display(),
            String::from_utf8_lossy(&out.stdout)
        );
    }
}

fn directive(unit: &str, key: &str) -> Vec<String> {
    let text = std::fs::read_to_string(unit_path(unit)).unwrap();
    let prefix = format!("{key}=");
    text.lines()
        .filter_map(|l| l.strip_prefix(&prefix).map(str::to_string))
        .collect()
}

#[test]
fn units_have_the_required_settings() {
    for (unit, user, state) in [
        ("berth.service", "berth", "berth"),
        ("berth-agent.service", "berth-agent", "berth-agent"),
    ] {
        assert_eq!(directive(unit, "User"), [user], "{unit}");
        assert_eq!(directive(unit, "StateDirectory"), [state], "{unit}");
        assert_eq!(directive(unit, "ProtectSystem"), ["strict"], "{unit}");
        assert_eq!(directive(unit, "NoNewPrivileges"), ["yes"], "{unit}");
        assert_eq!(directive(unit, "Restart"), ["on-failure"], "{unit}");
        assert_eq!(
            directive(unit, "EnvironmentFile"),
            [format!("-/etc/default/{user}")],
            "{unit}"
        );
    }
    // The agent's "don't restart" codes are exactly those of the errors a restart cannot fix;
    // 75 (server unreachable past the retry budget) must restart.
    let no_restart: Vec<i32> = directive("berth-agent.service", "RestartPreventExitStatus")[0]
        .split_whitespace()
        .map(|c| c.parse().unwrap())
        .collect();
    let m = || "x".to_string();
    for e in [
        AgentError::Config(m()),
        AgentError::Revoked(m()),
        AgentError::Fenced(m()),
    ] {
        assert!(no_restart.contains(&e.exit_code()), "{e} must not restart");
    }
    assert!(!no_restart.contains(&AgentError::Temporary(m()).exit_code()));
    assert_eq!(
        directive("berth-agent.service", "SupplementaryGroups"),
        ["docker"]
    );
}

#[test]
fn completions_for_every_shell() {
    for bin in [BERTH, AGENT] {
        let name = Path::new(bin).file_name().unwrap().to_str().unwrap();
        for shell in ["bash", "zsh", "fish", "elvish", "powershell"] {
            let out = run(bin, &["completions", shell]);
            assert!(out.status.success(), "{name} completions {shell}");
            let script = String::from_utf8(out.stdout).unwrap();
            assert!(script.contains(name), "{name} completions {shell}");
        }
        // The bash script is valid bash.
        let script = run(bin, &["completions", "bash"]).stdout;
        let path = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(path.path(), script).unwrap();
        let out = run("bash", &["-n", path.path().to_str().unwrap()]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let fish = String::from_utf8(run(AGENT, &["completions", "fish"]).stdout).unwrap();
    assert!(
        fish.contains("-l register") && fish.contains("-l allow-hook"),
        "{fish}"
    );
    let bash = String::from_utf8(run(BERTH, &["completions", "bash"]).stdout).unwrap();
    assert!(
        bash.contains("berth__subcmd__token,create)"),
        "subcommands complete"
    );
}

#[test]
fn man_pages_for_the_program_and_each_subcommand() {
    let dir = tempfile::tempdir().unwrap();
    let out_dir = dir.path().display().to_string();
    for bin in [BERTH, AGENT] {
        assert!(run(bin, &["man", "--out", &out_dir]).status.success());
    }
    for page in [
        "berth.1",
        "berth-server.1",
        "berth-token-create.1",
        "berth-agent.1",
    ] {
        let text = std::fs::read_to_string(dir.path().join(page)).unwrap();
        assert!(text.contains(".TH"), "{page}");
    }
    let agent = std::fs::read_to_string(dir.path().join("berth-agent.1")).unwrap();
    assert!(agent.contains("\\-\\-register") && agent.contains("\\-\\-state\\-dir"));
    let server = std::fs::read_to_string(dir.path().join("berth-server.1")).unwrap();
    assert!(
        server.contains("BERTH_DATA_DIR"),
        "flags' variables are documented"
    );

    let stdout = run(BERTH, &["man"]);
    assert!(stdout.status.success());
    assert!(String::from_utf8(stdout.stdout)
        .unwrap()
        .contains(".TH berth 1"));
}

/// `completions` and `man` are subcommands of an agent that otherwise has only flags: the flags
/// and their exit codes are unchanged.
#[test]
fn agent_flags_still_parse_as_before() {
    let out = run(AGENT, &["--register", "--state-dir", "/nonexistent"]);
    assert_eq!(out.status.code(), Some(78));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--register needs --server"));
    assert_eq!(run(AGENT, &["--bogus"]).status.code(), Some(78));
    assert_eq!(
        run(AGENT, &["completions", "nosuchshell"]).status.code(),
        Some(78)
    );
    let version = run(AGENT, &["--version"]);
    assert_eq!(version.status.code(), Some(0));
    assert!(String::from_utf8_lossy(&version.stdout).starts_with("berth-agent "));
}

/// The server's unit does not restart on a configuration error either (exit 78).
#[test]
fn the_server_unit_does_not_restart_on_a_configuration_error() {
    let no_restart = directive("berth.service", "RestartPreventExitStatus");
    let codes: Vec<&str> = no_restart[0].split_whitespace().collect();
    let config = berth_cli::config::EXIT_CONFIG.to_string();
    assert!(codes.contains(&config.as_str()), "{codes:?}");
}

/// The example config files the packages ship (`packaging/config/`, commented out) name every
/// setting; uncommented, each parses, and a value that is a default is the default.
#[test]
fn the_shipped_config_files_name_every_setting_and_parse() {
    use berth_cli::agent_config::AgentSettings;
    use berth_cli::server_config::ServerSettings;
    use clap::Args;

    fn check<T: Args + serde::Serialize + serde::de::DeserializeOwned>(
        name: &str,
        defaults: &T,
        not_defaults: &[&str],
        program: &str,
        program_args: &[&str],
    ) {
        let path = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../packaging/config")
            .join(name);
        let text = std::fs::read_to_string(&path).unwrap();
        // As shipped (all commented out) the binary reads it.
        let mut args = program_args.to_vec();
        let path_text = path.display().to_string();
        args.extend(["--print-config", "--config", &path_text]);
        let out = run(program, &args);
        assert!(
            out.status.success(),
            "{name}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let uncommented: String = text
            .lines()
            .filter_map(|l| l.strip_prefix('#'))
            .filter(|l| l.split_once(" = ").is_some_and(|(k, _)| !k.contains(' ')))
            .map(|l| format!("{l}\n"))
            .collect();
        let table: toml::Table = toml::from_str(&uncommented).unwrap();
        berth_cli::config::parse::<T>(&uncommented, &path).unwrap();
        let keys: Vec<String> = T::augment_args(clap::Command::new("x"))
            .get_arguments()
            .map(|a| a.get_id().to_string())
            .collect();
        for key in &keys {
            assert!(table.contains_key(key), "{name} does not show {key}");
        }
        let defaults: toml::Table = toml::from_str(&toml::to_string(defaults).unwrap()).unwrap();
        for (key, value) in &defaults {
            if !not_defaults.contains(&key.as_str()) {
                assert_eq!(table.get(key), Some(value), "{name}: the default of {key}");
            }
        }
    }
    check(
        "server.toml",
        &ServerSettings::defaults(),
        &["data_dir", "listen"],
        BERTH,
        &["server"],
    );
    check("agent.toml", &AgentSettings::defaults(), &[], AGENT, &[]);
}
