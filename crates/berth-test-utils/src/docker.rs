//! The real Docker engine and the local registries of `scripts/registry.sh`: the environment
//! check ([`env`]: skip, or fail when services are required), test images made from
//! busybox-static and pushed to those registries, HTTP reads, executor tasks, and a cleanup
//! guard that removes everything a test created (by its unique prefix) even when it fails.
//!
//! The CLI is used freely here; the executors under test use the Engine API.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use berth_exec::{Outcome, Task};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

/// What `scripts/registry.sh` exports.
#[derive(Debug, Clone)]
pub struct Env {
    pub registry: String,
    pub auth_registry: String,
    pub user: String,
    pub password: String,
}

/// The registries and a working engine, or `None` (a SKIP line) when either is missing and
/// services are not required; when they are ([`crate::services_required`]), a failure.
pub fn env(test: &str) -> Option<Env> {
    let docker_ok = Command::new("docker")
        .args(["version", "--format", "{{.Server.Version}}"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
    match (
        var("BERTH_TEST_REGISTRY"),
        var("BERTH_TEST_AUTH_REGISTRY"),
        var("BERTH_TEST_REGISTRY_USER"),
        var("BERTH_TEST_REGISTRY_PASSWORD"),
    ) {
        _ if !docker_ok => crate::require_service(test, "the docker engine is not reachable"),
        (Some(registry), Some(auth_registry), Some(user), Some(password)) => Some(Env {
            registry,
            auth_registry,
            user,
            password,
        }),
        _ => crate::require_service(
            test,
            "BERTH_TEST_REGISTRY* are not set (run: eval \"$(bash scripts/registry.sh | grep '^export ')\")",
        ),
    }
}

/// `<kind>-<10 hex>` (`berth-test-…` for executor tests, `berth-e2e-…` for end-to-end tests):
/// the prefix of every name a test creates.
pub fn unique(kind: &str) -> String {
    format!(
        "{kind}-{}",
        &uuid::Uuid::new_v4().simple().to_string()[..10]
    )
}

/// Runs `docker args…`; `(success, stdout + stderr)`.
pub fn docker(args: &[&str]) -> (bool, String) {
    docker_with(args, &[], None)
}

fn docker_with(args: &[&str], env: &[(&str, &str)], stdin: Option<&str>) -> (bool, String) {
    let mut cmd = Command::new("docker");
    cmd.args(args)
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().expect("docker CLI");
    if let Some(input) = stdin {
        child
            .stdin
            .take()
            .unwrap()
            .write_all(input.as_bytes())
            .unwrap();
    }
    let out = child.wait_with_output().unwrap();
    let mut text = String::from_utf8_lossy(&out.stdout).into_owned();
    text.push_str(&String::from_utf8_lossy(&out.stderr));
    (out.status.success(), text)
}

fn lines(s: &str) -> Vec<String> {
    s.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .map(str::to_string)
        .collect()
}

/// Removes, on drop, every container, compose project, volume, network and image whose name
/// carries `prefix` (so nothing this test did not create is touched).
pub struct Cleanup {
    pub prefix: String,
    compose: Vec<(Vec<String>, String, PathBuf)>,
}

impl Cleanup {
    pub fn new(prefix: &str) -> Cleanup {
        Cleanup {
            prefix: prefix.to_string(),
            compose: Vec::new(),
        }
    }

    /// A compose project (named with the prefix) deployed from `dir`.
    pub fn compose_project(&mut self, command: &[String], project: &str, dir: &Path) {
        assert!(project.starts_with(&self.prefix));
        self.compose
            .push((command.to_vec(), project.to_string(), dir.to_path_buf()));
    }
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        for (command, project, dir) in &self.compose {
            let lock = dir.join(berth_exec::compose::LOCK_FILE);
            if lock.exists() {
                let _ = Command::new(&command[0])
                    .args(&command[1..])
                    .args(["-p", project, "-f"])
                    .arg(&lock)
                    .args(["down", "-v", "--remove-orphans"])
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .status();
            }
            let filter = format!("label=com.docker.compose.project={project}");
            let (_, ids) = docker(&["ps", "-aq", "--filter", &filter]);
            for id in lines(&ids) {
                docker(&["rm", "-f", "-v", &id]);
            }
        }
        let name = format!("name={}", self.prefix);
        let (_, ids) = docker(&["ps", "-aq", "--filter", &name]);
        for id in lines(&ids) {
            docker(&["rm", "-f", "-v", &id]);
        }
        let (_, vols) = docker(&["volume", "ls", "-q", "--filter", &name]);
        for v in lines(&vols).iter().filter(|v| v.contains(&self.prefix)) {
            docker(&["volume", "rm", "-f", v]);
        }
        let (_, nets) = docker(&["network", "ls", "--format", "{{.Name}}", "--filter", &name]);
        for n in lines(&nets).iter().filter(|n| n.contains(&self.prefix)) {
            docker(&["network", "rm", n]);
        }
        let (_, images) = docker(&[
            "images",
            "--digests",
            "--format",
            "{{.Repository}} {{.Tag}} {{.Digest}}",
        ]);
        for line in lines(&images) {
            let parts: Vec<&str> = line.split(' ').collect();
            if parts.len() != 3 || !parts[0].contains(&self.prefix) {
                continue;
            }
            if parts[1] != "<none>" {
                docker(&["rmi", &format!("{}:{}", parts[0], parts[1])]);
            }
            if parts[2] != "<none>" {
                docker(&["rmi", &format!("{}@{}", parts[0], parts[2])]);
            }
        }
    }
}

/// Test image behaviours.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Variant {
    /// busybox httpd on 8080 serving `/www/index.html`, with a HEALTHCHECK that fetches it.
    Healthy,
    /// Serves like `Healthy`, but its HEALTHCHECK fetches a port nobody listens on.
    Unhealthy,
    /// Exits at once with status 1.
    Crash,
}

/// An image in a registry, by digest.
#[derive(Debug, Clone)]
pub struct Image {
    pub repository: String,
    pub digest: String,
}

impl Image {
    pub fn reference(&self) -> String {
        format!("{}@{}", self.repository, self.digest)
    }

    /// A `docker.run` payload of this image (see [`crate::deploy::deploy`]).
    pub fn deploy(&self, name: &str, port: u16, health: serde_json::Value) -> serde_json::Value {
        crate::deploy::deploy(&self.repository, &self.digest, name, port, health)
    }
}

/// Makes a `FROM scratch` image holding `/bin/busybox` (busybox-static) and `/www/index.html`
/// = `content`, pushes it to `registry` as `<registry>/<prefix>/<name>`, and removes it locally
/// so the executor has to pull it. `docker import` instead of `docker build`: the same image
/// in a fifth of a second instead of three and a half.
pub fn make_image(
    registry: &str,
    prefix: &str,
    name: &str,
    variant: Variant,
    content: &str,
    login: Option<(&str, &str)>,
) -> Image {
    let busybox = Path::new("/bin/busybox");
    assert!(
        busybox.exists(),
        "/bin/busybox is missing: run scripts/registry.sh"
    );
    let dir = tempfile::tempdir().unwrap();
    let rootfs = dir.path().join("rootfs");
    std::fs::create_dir_all(rootfs.join("bin")).unwrap();
    std::fs::create_dir_all(rootfs.join("www")).unwrap();
    std::fs::copy(busybox, rootfs.join("bin/busybox")).unwrap();
    std::fs::write(rootfs.join("www/index.html"), content).unwrap();
    let tar = dir.path().join("rootfs.tar");
    let ok = Command::new("tar")
        .arg("-C")
        .arg(&rootfs)
        .arg("-cf")
        .arg(&tar)
        .arg(".")
        .status()
        .unwrap()
        .success();
    assert!(ok, "tar failed");

    // PID 1 is a shell that exits on SIGTERM, so `docker stop` takes no 10 s grace period.
    let serve = r#"ENTRYPOINT ["/bin/busybox", "sh", "-c", "trap 'exit 0' TERM; /bin/busybox httpd -f -p 8080 -h /www & wait"]"#;
    let crash = r#"ENTRYPOINT ["/bin/busybox", "false"]"#;
    let health = |port: u16| {
        format!(
            r#"HEALTHCHECK --interval=1s --timeout=2s --retries=2 CMD ["/bin/busybox", "wget", "-q", "-O-", "http://127.0.0.1:{port}/"]"#
        )
    };
    let changes: Vec<String> = match variant {
        Variant::Healthy => vec![serve.into(), health(8080)],
        Variant::Unhealthy => vec![serve.into(), health(9)],
        Variant::Crash => vec![crash.into(), health(8080)],
    };
    let repository = format!("{registry}/{prefix}/{name}");
    let tag = format!("{repository}:t");
    let mut args: Vec<String> = vec!["import".into()];
    for c in &changes {
        args.push("--change".into());
        args.push(c.clone());
    }
    args.push(tar.display().to_string());
    args.push(tag.clone());
    let argv: Vec<&str> = args.iter().map(String::as_str).collect();
    let (ok, out) = docker(&argv);
    assert!(ok, "docker import: {out}");

    let config = tempfile::tempdir().unwrap();
    let config_path = config.path().display().to_string();
    let env = [("DOCKER_CONFIG", config_path.as_str())];
    if let Some((user, password)) = login {
        let (ok, out) = docker_with(
            &["login", "-u", user, "--password-stdin", registry],
            &env,
            Some(password),
        );
        assert!(ok, "docker login {registry}: {out}");
    }
    let (ok, out) = docker_with(&["push", &tag], &env, None);
    assert!(ok, "docker push {tag}: {out}");
    let (ok, out) = docker(&["inspect", "--format", "{{index .RepoDigests 0}}", &tag]);
    assert!(ok, "docker inspect {tag}: {out}");
    let digest = out
        .trim()
        .rsplit_once('@')
        .map(|(_, d)| d.to_string())
        .expect("a repo digest after push");
    let (ok, out) = docker(&["rmi", &tag]);
    assert!(ok, "docker rmi {tag}: {out}");
    Image { repository, digest }
}

/// The body `GET /` answers on `127.0.0.1:port`, if it answers 200.
pub async fn http_body(port: u16) -> Option<String> {
    let get = async {
        let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .ok()?;
        s.write_all(b"GET / HTTP/1.0\r\nHost: localhost\r\n\r\n")
            .await
            .ok()?;
        let mut buf = Vec::new();
        s.read_to_end(&mut buf).await.ok()?;
        let text = String::from_utf8_lossy(&buf).into_owned();
        let (head, body) = text.split_once("\r\n\r\n")?;
        head.starts_with("HTTP/1.0 200")
            .then(|| body.to_string())
            .or_else(|| head.starts_with("HTTP/1.1 200").then(|| body.to_string()))
    };
    tokio::time::timeout(Duration::from_secs(3), get)
        .await
        .ok()
        .flatten()
}

/// An executor task of `task_type` with `payload`, no credentials and two minutes to run.
pub fn task(task_type: &str, payload: serde_json::Value) -> Task {
    Task {
        task_id: uuid::Uuid::new_v4(),
        task_type: task_type.into(),
        payload,
        credentials: BTreeMap::new(),
        variables: BTreeMap::new(),
        timeout: Duration::from_secs(120),
        cancel: CancellationToken::new(),
        lease: berth_exec::Lease::unfenced(),
    }
}

/// `task` with registry credentials.
pub fn with_login(mut task: Task, user: &str, password: &str) -> Task {
    task.credentials
        .insert(berth_exec::CREDENTIAL_REGISTRY_USERNAME.into(), user.into());
    task.credentials.insert(
        berth_exec::CREDENTIAL_REGISTRY_PASSWORD.into(),
        password.into(),
    );
    task
}

/// Names of containers (running or not) whose name contains `fragment`.
pub fn container_names(fragment: &str) -> Vec<String> {
    let (_, out) = docker(&[
        "ps",
        "-a",
        "--format",
        "{{.Names}}",
        "--filter",
        &format!("name={fragment}"),
    ]);
    lines(&out)
}

/// The id of the container named exactly `name`.
pub fn container_id(name: &str) -> Option<String> {
    let (ok, out) = docker(&["inspect", "--format", "{{.Id}}", name]);
    ok.then(|| out.trim().to_string())
}

/// Panics with the outcome's logs when it is not a success.
pub fn assert_success(outcome: &Outcome) {
    assert!(
        outcome.success,
        "expected success, got {:?}: {}\n--- logs ---\n{}",
        outcome.error_type, outcome.message, outcome.logs
    );
}

/// Panics with the outcome's logs when it did not fail with `code`.
pub fn assert_failed(outcome: &Outcome, code: &str) {
    assert!(
        !outcome.success && outcome.error_type.as_deref() == Some(code),
        "expected {code}, got success={} {:?}: {}\n--- logs ---\n{}",
        outcome.success,
        outcome.error_type,
        outcome.message,
        outcome.logs
    );
}
