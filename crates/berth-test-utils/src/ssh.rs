//! The sshd of `scripts/sshd.sh` for the `ssh.deploy` tests: where it listens, as whom, the
//! client's private key, the host key to pin, and a directory the SSH user owns.

use std::path::{Path, PathBuf};

use crate::require_service;

/// The `BERTH_TEST_SSH_*` variables `scripts/sshd.sh` prints.
#[derive(Debug, Clone)]
pub struct SshEnv {
    pub host: String,
    pub port: u16,
    pub user: String,
    /// The client's private key, OpenSSH format (the `sshPrivateKey` credential).
    pub private_key: String,
    /// `ssh-ed25519 AAAA…`, the server's host key to pin.
    pub host_key: String,
    /// Owned by `user`; tests make their deploy directories below it.
    pub workdir: PathBuf,
    /// sshd's log, `LogLevel VERBOSE`: each connection's client port and authentication.
    pub log: PathBuf,
}

/// The sshd, or `None` (SKIP; a failure when services are required).
pub fn env(test: &str) -> Option<SshEnv> {
    let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
    let (Some(host), Some(port), Some(user), Some(key), Some(host_key), Some(workdir), Some(log)) = (
        var("BERTH_TEST_SSH_HOST"),
        var("BERTH_TEST_SSH_PORT").and_then(|p| p.parse().ok()),
        var("BERTH_TEST_SSH_USER"),
        var("BERTH_TEST_SSH_KEY"),
        var("BERTH_TEST_SSH_HOST_KEY"),
        var("BERTH_TEST_SSH_WORKDIR"),
        var("BERTH_TEST_SSH_LOG"),
    ) else {
        return require_service(
            test,
            "BERTH_TEST_SSH_* are not set (run scripts/sshd.sh and export what it prints)",
        );
    };
    let private_key = match std::fs::read_to_string(&key) {
        Ok(k) => k,
        Err(e) => return require_service(test, &format!("cannot read {key}: {e}")),
    };
    if std::net::TcpStream::connect((host.as_str(), port)).is_err() {
        return require_service(test, &format!("no sshd answers on {host}:{port}"));
    }
    Some(SshEnv {
        host,
        port,
        user,
        private_key,
        host_key,
        workdir: PathBuf::from(workdir),
        log: PathBuf::from(log),
    })
}

impl SshEnv {
    /// A fresh directory below [`workdir`](Self::workdir), owned by the SSH user (the tests run as
    /// root), removed on drop.
    pub fn tempdir(&self) -> tempfile::TempDir {
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::Builder::new()
            .prefix("berth-ssh-")
            .tempdir_in(&self.workdir)
            .expect("a temp dir in the sshd work dir");
        let owner = std::fs::metadata(&self.workdir).expect("the sshd work dir");
        chown(dir.path(), owner.uid(), owner.gid());
        dir
    }

    /// What sshd logged about the client connection from local port `port`.
    pub fn log_of_connection(&self, port: u16) -> Vec<String> {
        let needle = format!(" port {port}");
        // ` port 4996` must not match ` port 49964`.
        let names_it = |line: &str| {
            line.match_indices(&needle)
                .any(|(i, _)| !line[i + needle.len()..].starts_with(|c: char| c.is_ascii_digit()))
        };
        std::fs::read_to_string(&self.log)
            .unwrap_or_default()
            .lines()
            .filter(|l| names_it(l))
            .map(str::to_string)
            .collect()
    }

    /// The payload's `target`.
    pub fn target(&self) -> serde_json::Value {
        serde_json::json!({"host": self.host, "port": self.port, "user": self.user,
                           "hostKey": self.host_key, "connectTimeout": 10})
    }
}

/// Gives `path` to `uid:gid`, as the SSH user must own what it deploys into.
pub fn chown(path: &Path, uid: u32, gid: u32) {
    std::os::unix::fs::chown(path, Some(uid), Some(gid))
        .unwrap_or_else(|e| panic!("chown {}: {e}", path.display()));
}

/// The sshd's second client key and host key, both RSA (`BERTH_TEST_SSH_RSA_*`).
#[derive(Debug, Clone)]
pub struct RsaKeys {
    /// OpenSSH format; the SSH user is let in with it.
    pub private_key: String,
    /// `ssh-rsa AAAA…`, the server's RSA host key to pin.
    pub host_key: String,
}

/// The RSA keys, or `None` (SKIP; a failure when services are required).
pub fn rsa(test: &str) -> Option<RsaKeys> {
    let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
    let (Some(key), Some(host_key)) = (
        var("BERTH_TEST_SSH_RSA_KEY"),
        var("BERTH_TEST_SSH_RSA_HOST_KEY"),
    ) else {
        return require_service(
            test,
            "BERTH_TEST_SSH_RSA_* are not set (run scripts/sshd.sh again and export what it prints)",
        );
    };
    match std::fs::read_to_string(&key) {
        Ok(private_key) => Some(RsaKeys {
            private_key,
            host_key,
        }),
        Err(e) => require_service(test, &format!("cannot read {key}: {e}")),
    }
}
