//! SSH targets end to end (issue 12): `berth server`, one `berth-agent` acting for the real sshd
//! of `scripts/sshd.sh`, and the CLI an operator uses — `secret put` (the key), `ssh-target
//! scan|add`, `release create --ssh-dir` (its files pushed as artifacts, fetched by the agent by
//! sha256), an environment of SSH targets, `deploy --wait`, `env status` (drift read back over
//! SSH), a failing release rolled back, and an agent killed mid-deploy (`unknown`, then read back
//! over SSH, never run again). The private key is never in plain text on disk or in a view.
//!
//! Without the `BERTH_TEST_SSH_*` variables the tests print SKIP, except under `CI=true` or
//! `BERTH_REQUIRE_SERVICES=1`, where they fail.

#![cfg(unix)]

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::time::Duration;

use berth_test_utils::files_containing;
use berth_test_utils::ssh::{self, SshEnv};
use common::*;
use serde_json::Value;

const DEPLOY: Duration = Duration::from_secs(120);

/// A server, an agent labelled `role=edge`, the target's key stored as `ssh/<name>-key`, and
/// the SSH target `name` (labels `tier=<name>`) registered through the CLI.
struct World {
    server: Server,
    agent: Agent,
    env: SshEnv,
    tmp: tempfile::TempDir,
    /// The deploy directory on the target (the sshd runs on this machine).
    remote: tempfile::TempDir,
}

impl World {
    fn start(test: &str, server_args: &[&str]) -> Option<World> {
        let env = ssh::env(test)?;
        let tmp = tempdir();
        let server = Server::start(&tmp.path().join("data"), server_args);
        let agent = Agent::register(&server, tmp.path(), "edge-1", &["--labels", "role=edge"]);
        let remote = env.tempdir();
        Some(World {
            server,
            agent,
            env,
            tmp,
            remote,
        })
    }

    fn add_target(&self, name: &str) {
        let key_file = self.tmp.path().join("target.key");
        std::fs::write(&key_file, &self.env.private_key).unwrap();
        std::fs::set_permissions(&key_file, std::fs::Permissions::from_mode(0o600)).unwrap();
        let secret = format!("ssh/{name}-key");
        self.server.cli(&[
            "secret",
            "put",
            &secret,
            "--from-file",
            &key_file.display().to_string(),
        ]);
        std::fs::remove_file(&key_file).unwrap();

        // The key a person checks before pinning it, as `ssh-keyscan` would show it.
        let port = self.env.port.to_string();
        let scanned = self
            .server
            .cli(&["ssh-target", "scan", &self.env.host, "--port", &port]);
        assert_eq!(scanned["hostKey"], self.env.host_key.trim(), "{scanned}");
        let label = format!("tier={name}");
        let added = self.server.cli(&[
            "ssh-target",
            "add",
            name,
            "--host",
            &self.env.host,
            "--port",
            &port,
            "--user",
            &self.env.user,
            "--via",
            "role=edge",
            "--host-key",
            self.env.host_key.trim(),
            "--key-secret",
            &secret,
            "--label",
            &label,
        ]);
        assert_eq!(added["viaSelector"]["role"], "edge", "{added}");
        assert_eq!(added["keySecret"], secret.as_str(), "{added}");
    }

    fn deploy_dir(&self) -> String {
        self.remote.path().join("site").display().to_string()
    }

    /// A release of `files` (name, content, executable) with `deploy.sh` as its script.
    fn release(&self, name: &str, files: &[(&str, &str, bool)]) {
        let dir = self.tmp.path().join(name);
        std::fs::create_dir_all(&dir).unwrap();
        for (file, content, executable) in files {
            let path = dir.join(file);
            std::fs::write(&path, content).unwrap();
            let mode = if *executable { 0o755 } else { 0o644 };
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
        }
        let release = self.server.cli(&[
            "release",
            "create",
            name,
            "--ssh-dir",
            &dir.display().to_string(),
            "--deploy-dir",
            &self.deploy_dir(),
            "--script",
            "deploy.sh",
            "--script-timeout",
            "60",
        ]);
        let artifacts = release["ssh"]["artifacts"].as_array().expect("artifacts");
        assert_eq!(artifacts.len(), files.len(), "{release}");
        assert!(
            artifacts
                .iter()
                .all(|a| a["sha256"].is_string() && a.get("content").is_none()),
            "by reference only: {release}"
        );
    }

    /// `berth deploy RELEASE --env ENV`, then the deployment once it has ended.
    fn deploy(&self, release: &str, env: &str) -> Value {
        let created = self.server.cli(&["deploy", release, "--env", env]);
        let id = str_of(&created, "id").to_string();
        wait_for(DEPLOY, "the deployment to end", || {
            let d = self.server.cli(&["deployment", "show", &id]);
            match d["state"].as_str() {
                Some("pending" | "awaiting_approval" | "running") => Err(d.to_string()),
                _ => Ok(d),
            }
        })
    }

    fn remote_file(&self, name: &str) -> Option<String> {
        std::fs::read_to_string(Path::new(&self.deploy_dir()).join(name)).ok()
    }

    fn status_target(&self, env: &str) -> Value {
        let status = self.server.cli(&["env", "status", env]);
        status["targets"][0].clone()
    }

    /// The private key's body must be nowhere in plain text: not in the server's data dir, not
    /// in the agent's state dir, not in a task view.
    fn assert_key_sealed(&self) {
        let body = self
            .env
            .private_key
            .lines()
            .nth(1)
            .expect("a multi-line OpenSSH key")
            .to_string();
        for root in [self.tmp.path().join("data"), self.agent.state_dir.clone()] {
            let found = files_containing(&root, body.as_bytes());
            assert!(found.is_empty(), "the private key in plain text: {found:?}");
        }
        for task in self.server.tasks(&[]) {
            let shown = self.server.task(str_of(&task, "id"));
            assert!(!shown.to_string().contains(&body), "{shown:#}");
        }
    }
}

const DEPLOY_SH: &str = "#!/bin/sh\nset -e\ncp index.html live.html\n";

#[test]
fn an_environment_of_ssh_targets_deploys_reads_back_and_rolls_back() {
    let Some(w) = World::start(
        "an_environment_of_ssh_targets_deploys_reads_back_and_rolls_back",
        &[],
    ) else {
        return;
    };
    w.add_target("web-1");
    let listed = w.server.cli(&["ssh-target", "ls"]);
    assert_eq!(listed[0]["name"], "web-1", "{listed}");

    w.release(
        "site-1",
        &[
            ("index.html", "<h1>v1</h1>\n", false),
            ("deploy.sh", DEPLOY_SH, true),
        ],
    );
    w.server.cli(&[
        "env",
        "create",
        "web",
        "--tier",
        "dev",
        "--selector",
        "tier=web-1",
        "--ssh-targets",
        "--drift-interval",
        "1s",
    ]);
    // The plan names the SSH target like an agent.
    let plan = w
        .server
        .cli(&["deploy", "site-1", "--env", "web", "--dry-run"]);
    assert_eq!(
        plan["waves"][0]["targets"][0]["agentName"], "web-1",
        "{plan}"
    );

    let done = w.deploy("site-1", "web");
    assert_eq!(done["state"], "succeeded", "{done:#}");
    assert_eq!(done["targets"][0]["agentName"], "web-1", "{done:#}");
    assert_eq!(w.remote_file("live.html").as_deref(), Some("<h1>v1</h1>\n"));
    let task = w
        .server
        .task(done["targets"][0]["tasks"][0].as_str().expect("a task"));
    assert_eq!(task["type"], "ssh.deploy", "{task:#}");
    assert_eq!(
        task["agentId"],
        w.agent.id.as_str(),
        "run by the via agent: {task:#}"
    );
    let sticker: Value =
        serde_json::from_str(&w.remote_file(".berth-sticker.json").unwrap()).unwrap();
    assert_eq!(sticker["releaseName"], "site-1", "{sticker:#}");

    // Drift is read back over SSH by the via agent: in sync, then drifted once the target's
    // sticker says another release.
    let in_sync = wait_for(DEPLOY, "web-1 read back in sync", || {
        let t = w.status_target("web");
        (t["drift"] == "in_sync")
            .then_some(t.clone())
            .ok_or_else(|| t.to_string())
    });
    assert_eq!(in_sync["runningRelease"], "site-1", "{in_sync:#}");
    let mut edited = sticker.clone();
    edited["releaseId"] = "someone-else".into();
    edited["releaseName"] = "hand-made".into();
    let sticker_path = Path::new(&w.deploy_dir()).join(".berth-sticker.json");
    std::fs::write(&sticker_path, edited.to_string()).unwrap();
    let drifted = wait_for(DEPLOY, "web-1 read back drifted", || {
        let t = w.status_target("web");
        (t["drift"] == "drifted")
            .then_some(t.clone())
            .ok_or_else(|| t.to_string())
    });
    assert_eq!(drifted["runningRelease"], "hand-made", "{drifted:#}");
    std::fs::write(&sticker_path, sticker.to_string()).unwrap();

    // A release whose script fails: the target is restored from its backup and the deployment
    // returns it to site-1.
    w.release(
        "site-2",
        &[
            ("index.html", "<h1>v2</h1>\n", false),
            (
                "deploy.sh",
                "#!/bin/sh\ncp index.html live.html\nexit 3\n",
                true,
            ),
        ],
    );
    let last = w.deploy("site-2", "web");
    assert_eq!(last["state"], "rolled_back", "{last:#}");
    assert_eq!(last["errorCode"], "DEPLOY_SCRIPT_FAILED", "{last:#}");
    assert_eq!(w.remote_file("live.html").as_deref(), Some("<h1>v1</h1>\n"));
    let sticker: Value =
        serde_json::from_str(&w.remote_file(".berth-sticker.json").unwrap()).unwrap();
    assert_eq!(sticker["releaseName"], "site-1", "{sticker:#}");

    w.assert_key_sealed();
    // Removing the target ends it in the registry.
    w.server.cli(&["ssh-target", "rm", "web-1"]);
    assert!(w.server.try_cli(&["ssh-target", "show", "web-1"]).is_err());
}

/// The via agent is killed while the deploy script runs: its lease runs out, the task becomes
/// `unknown` (never run again), and the restarted agent's read-back reads the target's sticker
/// over SSH. The deploy never reached its sticker, so nothing proves it: it stays `unknown`.
#[test]
fn agent_killed_mid_ssh_deploy_is_read_back_over_ssh() {
    let Some(mut w) = World::start(
        "agent_killed_mid_ssh_deploy_is_read_back_over_ssh",
        &["--heartbeat-interval-secs", "1", "--lease-grace-secs", "1"],
    ) else {
        return;
    };
    w.add_target("slow-1");
    let started = w.remote.path().join("started");
    let script = format!(
        "#!/bin/sh\ntouch '{}'\nsleep 60\ncp index.html live.html\n",
        started.display()
    );
    w.release(
        "slow-1",
        &[
            ("index.html", "<h1>slow</h1>\n", false),
            ("deploy.sh", &script, true),
        ],
    );
    w.server.cli(&[
        "env",
        "create",
        "slow",
        "--tier",
        "dev",
        "--selector",
        "tier=slow-1",
        "--ssh-targets",
        "--no-auto-rollback",
        "--health-timeout",
        "10",
        "--task-timeout",
        "15",
    ]);
    let created = w.server.cli(&["deploy", "slow-1", "--env", "slow"]);
    wait_for(DEPLOY, "the deploy script to start on the target", || {
        started
            .exists()
            .then_some(())
            .ok_or_else(|| w.server.cli(&["deployment", "ls"]).to_string())
    });
    w.agent.proc.kill9();
    let deployment = str_of(&created, "id").to_string();
    let task_id = wait_for(DEPLOY, "the deployment's task", || {
        let d = w.server.cli(&["deployment", "show", &deployment]);
        d["targets"][0]["tasks"][0]
            .as_str()
            .map(str::to_string)
            .ok_or_else(|| d.to_string())
    });
    let unknown = w.server.wait_task_state(&task_id, DEPLOY, "unknown");
    assert_eq!(attempts(&unknown)[0]["state"], "expired", "{unknown:#}");

    w.agent.proc = Agent::restart(
        &w.server.url,
        &w.agent.state_dir,
        &w.agent.sticker_dir,
        "edge-1 (restarted)",
        &["--labels", "role=edge"],
    );
    let resolved = w
        .server
        .wait_task(&task_id, DEPLOY, "read-back evidence", |t| {
            t["result"]["found"].is_boolean()
        });
    assert_eq!(resolved["state"], "unknown", "{resolved:#}");
    assert_eq!(resolved["result"]["found"], false, "{resolved:#}");
    assert_eq!(attempts(&resolved).len(), 1, "re-run: {resolved:#}");
    let read_back = w
        .server
        .tasks(&["--type", "read-sticker"])
        .into_iter()
        .find(|t| t["readBackOf"] == task_id.as_str())
        .expect("a read-back of the lost deploy");
    let read_back = w.server.task(str_of(&read_back, "id"));
    assert_eq!(read_back["state"], "succeeded", "{read_back:#}");
    let logs = read_back["result"]["logs"].as_str().unwrap_or_default();
    assert!(
        logs.contains("matches the pin") && logs.contains(&w.deploy_dir()),
        "read over SSH, with the pin: {read_back:#}"
    );
    // Never deployed again: the script's second half never ran.
    assert!(w.remote_file("live.html").is_none());
    let target = wait_for(DEPLOY, "the target held unknown", || {
        let d = w.server.cli(&["deployment", "show", &deployment]);
        let t = d["targets"][0].clone();
        (t["phase"] == "unknown")
            .then_some(t)
            .ok_or_else(|| d.to_string())
    });
    assert_eq!(target["errorCode"], "UNKNOWN", "{target:#}");
    w.assert_key_sealed();
}
